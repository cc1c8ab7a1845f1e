"""Admission over HTTP with real concurrent clients: queue timeout (503), full queue (429), and a
client that disconnects frees its slot."""
from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from lanes.profile import PROFILE_DIR
from tests.serverproc import start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, embedded_models_dir):
    d = tmp_path_factory.mktemp("admission")
    (d / "models").symlink_to(embedded_models_dir)
    lane = (PROFILE_DIR / "cpu.toml").read_text()
    for old, new in (("max_concurrency = 2", "max_concurrency = 1"),
                     ("max_queue = 16", "max_queue = 1"),
                     ("queue_timeout_s = 120.0", "queue_timeout_s = 2.0"),
                     ("context_tokens = 32768", "context_tokens = 4096")):
        assert old in lane
        lane = lane.replace(old, new)
    (d / "tight.toml").write_text(lane)
    srv = start_server(d, "--lane", str(d / "tight.toml"))
    yield srv
    srv.stop()


def body(n, stream=False):
    return {"model": "tiny", "input": "Tell me a long story.", "max_output_tokens": n,
            "temperature": 0, "stream": stream}


def test_queue_timeout_full_queue_and_disconnect(server):
    headers = {"Authorization": f"Bearer {server.key}"}
    url = server.api_url + "/responses"
    # A: a long stream holds the only slot; we read its first event, then hold the connection
    a = httpx.Client(timeout=120)
    a_stream = a.stream("POST", url, json=body(3000, stream=True), headers=headers)
    a_resp = a_stream.__enter__()
    assert a_resp.status_code == 200
    a_lines = a_resp.iter_lines()  # keep a reference: a collected iterator closes the stream
    next(a_lines)
    # B waits in the queue (size 1) and times out with 503 after ~2 s
    result = {}

    def b():
        result["b"] = httpx.post(url, json=body(4), headers=headers, timeout=60)

    tb = threading.Thread(target=b)
    tb.start()
    # B is in the queue once the scheduler's gauge counts it (a fixed sleep could send C first
    # on a loaded machine); B's own timeout is 2 s
    deadline = time.monotonic() + 1.5
    while not re.search(r'^ninfer_sequences\{state="waiting"\} 1\.0$',
                        httpx.get(server.base_url + "/metrics", headers=headers).text, re.M):
        assert time.monotonic() < deadline, "B never reached the queue"
        time.sleep(0.02)
    # C finds the queue full: 429 at once
    c = httpx.post(url, json=body(4), headers=headers, timeout=60)
    assert c.status_code == 429 and c.json()["error"]["code"] == "server_overloaded"
    assert "retry-after" in c.headers
    tb.join(timeout=60)
    rb = result["b"]
    assert rb.status_code == 503 and rb.json()["error"]["code"] == "request_queue_timeout"
    # A's client goes away: its slot is freed and the next request is served promptly
    a_lines.close()
    a_stream.__exit__(None, None, None)
    a.close()
    t0 = time.monotonic()
    d = httpx.post(url, json=body(4), headers=headers, timeout=60)
    assert d.status_code == 200 and d.json()["usage"]["output_tokens"] >= 1
    assert time.monotonic() - t0 < 30
    metrics = httpx.get(server.base_url + "/metrics", headers=headers).text
    assert 'outcome="rejected_overloaded"' in metrics and 'outcome="cancelled"' in metrics
