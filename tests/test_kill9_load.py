"""kill -9 under load (slow tier): the real server as a subprocess, clients driving chained
requests (streamed and not) concurrently, the server killed with SIGKILL several times in the
middle of it and started again on the same state directory. Every response a client was
given (a 200, or a stream's terminal event) must be retrievable afterwards with the same
output, every chain must continue from its last acknowledged response, and the database must
pass SQLite's integrity check."""
from __future__ import annotations

import json
import random
import sqlite3
import threading
import time

import httpx
import openai
import pytest

from tests.serverproc import start_server

CLIENTS = 4
KILLS = 4


class Load:
    """The clients, the server they talk to now, and what each was acknowledged."""

    def __init__(self, srv):
        self.srv, self.lock = srv, threading.Lock()
        self.stop = threading.Event()
        self.acked: dict[str, str] = {}            # response id -> output text
        self.heads: dict[int, str | None] = {i: None for i in range(CLIENTS)}
        self.failures: list[str] = []              # answers that were not a dropped connection
        self.cut = 0                               # requests in flight when it was killed

    def client(self) -> openai.OpenAI:
        with self.lock:
            return openai.OpenAI(base_url=self.srv.api_url, api_key=self.srv.key,
                                 max_retries=0, timeout=120)

    def run(self, i: int) -> None:
        rng = random.Random(i)
        turn = 0
        while not self.stop.is_set():
            turn += 1
            body = dict(model="tiny", input=f"client {i} turn {turn}: go on",
                        max_output_tokens=rng.randint(2, 8),
                        prompt_cache_key=f"chain-{i}")
            if self.heads[i] is not None:
                body["previous_response_id"] = self.heads[i]
            try:
                rid, text = self._ask(body, stream=rng.random() < 0.5)
            except (openai.APIConnectionError, httpx.HTTPError) as e:
                # killed under it (unacknowledged: the chain goes on from its last
                # acknowledged response), or no server listening yet
                if type(e.__cause__ or e).__name__ != "ConnectError":  # (the SDK's own httpx)
                    self.cut += 1
                time.sleep(0.5)
                continue
            except openai.APIStatusError as e:
                if e.status_code == 503:  # still loading after a restart
                    time.sleep(0.5)
                    continue
                self.failures.append(f"{e.status_code}: {e.message}")
                continue
            except RuntimeError as e:
                self.failures.append(str(e))
                continue
            with self.lock:
                self.acked[rid] = text
                self.heads[i] = rid

    def _ask(self, body: dict, stream: bool) -> tuple[str, str]:
        c = self.client()
        if not stream:
            r = c.responses.create(**body)
            return r.id, r.output_text
        final = None
        for ev in c.responses.create(**body, stream=True):
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
            elif ev.type == "response.failed":
                raise RuntimeError(f"response.failed: {ev.response.error.code}")
        if final is None:  # the stream ended without its terminal event: never acknowledged
            raise httpx.RemoteProtocolError("no terminal event")
        return final.id, final.output_text


@pytest.mark.slow
def test_kill9_under_load_loses_nothing_acknowledged(tmp_path, embedded_models_dir):
    (tmp_path / "models").symlink_to(embedded_models_dir)
    load = Load(start_server(tmp_path))
    threads = [threading.Thread(target=load.run, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    rng, kills = random.Random(7), 0
    t0 = time.monotonic()
    try:
        for _ in range(KILLS):
            start = len(load.acked)
            deadline = time.monotonic() + 300
            while len(load.acked) < start + CLIENTS * 2:  # under load: answers are flowing
                assert time.monotonic() < deadline, "no progress"
                time.sleep(0.2)
            time.sleep(rng.uniform(0.0, 2.0))
            load.srv.proc.kill()  # SIGKILL: nothing is flushed, closed or saved
            load.srv.proc.wait()
            kills += 1
            srv = start_server(tmp_path)
            with load.lock:
                load.srv = srv
        start = len(load.acked)
        while len(load.acked) < start + CLIENTS * 2:
            time.sleep(0.2)
    finally:
        load.stop.set()
        for t in threads:
            t.join(timeout=180)
    assert not load.failures, load.failures[:5]
    srv, h = load.srv, {"Authorization": f"Bearer {load.srv.key}"}
    lost = []
    for rid, text in load.acked.items():
        r = httpx.get(f"{srv.api_url}/responses/{rid}", headers=h, timeout=60)
        got = "".join(p["text"] for o in r.json().get("output", []) if o["type"] == "message"
                      for p in o["content"]) if r.status_code == 200 else None
        if got != text:
            lost.append((rid, r.status_code))
    assert not lost, lost[:5]
    c = load.client()
    for i, head in load.heads.items():  # every chain continues from its last acknowledged turn
        r = c.responses.create(model="tiny", input="one more", previous_response_id=head,
                               max_output_tokens=2, prompt_cache_key=f"chain-{i}")
        assert r.previous_response_id == head
    srv.stop()
    conn = sqlite3.connect(tmp_path / "responses.db")
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    conn.close()
    print("kill9-summary " + json.dumps({
        "kills": kills, "clients": CLIENTS, "acknowledged": len(load.acked),
        "retrievable": len(load.acked) - len(lost), "cut_in_flight": load.cut,
        "chains_continued": len(load.heads), "seconds": round(time.monotonic() - t0, 1)}))
