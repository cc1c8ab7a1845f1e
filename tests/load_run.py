"""Load on a real server: concurrent clients, each a chain of turns (`previous_response_id`),
half of them streamed. A shed request (429, or 503 from the queue) must carry Retry-After, and
the client waits that long and tries again; every response the server acknowledged must be
retrievable afterwards, its chain link intact. `run_load` returns what a results file records.
"""
from __future__ import annotations

import json
import statistics
import threading
import time

import httpx


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


def _create(client: httpx.Client, url: str, body: dict) -> tuple[int, dict, httpx.Headers]:
    """POST a response (streamed or not); (status, the response object or error, headers)."""
    if not body.get("stream"):
        r = client.post(url, json=body)
        return r.status_code, r.json(), r.headers
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json(), r.headers
        last = None
        for line in r.iter_lines():
            if line.startswith("data: "):
                last = json.loads(line[6:])
        if last is None or last.get("type") not in ("response.completed",
                                                    "response.incomplete"):
            return 599, {"error": {"message": f"stream ended with {last}"}}, r.headers
        return 200, last["response"], r.headers


def run_load(base_url: str, key: str, *, clients: int, turns: int,
             max_output_tokens: int = 4, max_retry_after: float = 2.0) -> dict:
    headers = {"Authorization": f"Bearer {key}"}
    url = base_url + "/v1/responses"
    lock = threading.Lock()
    acked: list[tuple[str, str | None, str]] = []  # (id, previous id, session)
    latencies: list[float] = []
    sheds = {"429": 0, "503": 0}
    problems: list[str] = []

    def client_main(c: int) -> None:
        session = f"load-{c}"
        prev = None
        with httpx.Client(timeout=600, headers=headers) as client:
            for t in range(turns):
                body = {"model": "tiny", "input": f"client {c} turn {t}: go on.",
                        "max_output_tokens": max_output_tokens, "prompt_cache_key": session,
                        "stream": (c + t) % 2 == 0, "temperature": 0}
                if prev is not None:
                    body["previous_response_id"] = prev
                while True:
                    t0 = time.monotonic()
                    status, obj, h = _create(client, url, body)
                    if status in (429, 503):
                        retry = h.get("retry-after")
                        with lock:
                            sheds[str(status)] += 1
                            if retry is None:
                                problems.append(f"{status} without Retry-After: {obj}")
                        time.sleep(min(float(retry or 1), max_retry_after))
                        continue
                    break
                if status != 200:
                    with lock:
                        problems.append(f"client {c} turn {t}: {status} {obj}")
                    return
                with lock:
                    latencies.append(time.monotonic() - t0)
                    acked.append((obj["id"], prev, session))
                prev = obj["id"]

    t0 = time.monotonic()
    threads = [threading.Thread(target=client_main, args=(c,)) for c in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    missing = []
    with httpx.Client(timeout=60, headers=headers) as client:
        for rid, prev, session in acked:
            r = client.get(f"{url}/{rid}")
            if r.status_code != 200 or r.json().get("previous_response_id") != prev \
                    or r.json().get("prompt_cache_key") != session:
                missing.append(f"{rid}: {r.status_code} {r.text[:200]}")
    return {"clients": clients, "turns_per_client": turns,
            "requests_acknowledged": len(acked), "requests_expected": clients * turns,
            "shed_429": sheds["429"], "shed_503": sheds["503"],
            "latency_s": {"p50": round(_percentile(latencies, 0.5), 3),
                          "p99": round(_percentile(latencies, 0.99), 3),
                          "mean": round(statistics.fmean(latencies), 3) if latencies else 0,
                          "max": round(max(latencies, default=0), 3)},
            "wall_s": round(wall, 1), "retrievable": len(acked) - len(missing),
            "missing": missing[:10], "problems": problems[:10]}
