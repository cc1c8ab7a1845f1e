"""Holes closed, against one real server: Host headers that are not loopback names (DNS
rebinding), files and directories other users could read, and a key swapped in place that keeps
the file's size and modification time."""
from __future__ import annotations

import os
import stat
import time

import httpx
import pytest

from server.routes.gate import loopback_host
from tests.serverproc import start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("hardening") / "state")
    yield srv
    srv.stop()


def _get(srv, path: str, host: str | None = None, key: str | None = None):
    headers = {"Authorization": f"Bearer {key or srv.key}"}
    if host is not None:
        headers["Host"] = host
    return httpx.get(srv.base_url + path, headers=headers, timeout=30)


def test_loopback_names():
    for ok in ("localhost", "localhost:18089", "127.0.0.1", "127.0.0.1:80", "127.9.9.9:1",
               "[::1]", "[::1]:18089", "::1", "LOCALHOST:5"):
        assert loopback_host(ok), ok
    for bad in ("", "evil.example", "evil.example:18089", "10.0.0.1:18089", "192.168.1.2",
                "[2001:db8::1]:80", "localhost.evil.example", "127.0.0.1.nip.io:18089"):
        assert not loopback_host(bad), bad


def test_a_host_that_is_not_loopback_is_refused_on_every_route(server):
    port = server.base_url.rsplit(":", 1)[1]
    for path in ("/health", "/v1/models"):
        r = _get(server, path, host=f"rebind.example:{port}")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "host_not_allowed"
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
            assert _get(server, path, host=host).status_code == 200


def test_everything_in_the_state_directory_is_the_owners_alone(server):
    h = {"Authorization": f"Bearer {server.key}"}
    first = httpx.post(server.api_url + "/responses", headers=h, timeout=300, json={
        "model": "tiny", "input": "hello", "max_output_tokens": 4,
        "prompt_cache_key": "perm-test"}).json()
    httpx.post(server.api_url + "/responses", headers=h, timeout=300, json={
        "model": "tiny", "input": "again", "max_output_tokens": 4,
        "previous_response_id": first["id"], "prompt_cache_key": "perm-test"})
    saved = httpx.post(server.api_url + "/ninfer/checkpoints", headers=h, timeout=300,
                       json={"prompt_cache_key": "perm-test"})
    assert saved.status_code == 200, saved.text
    wrong = []
    for root, dirs, files in os.walk(server.state_dir):
        for d in dirs:
            mode = stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode)
            if mode & 0o077:
                wrong.append((os.path.join(root, d), oct(mode)))
        for f in files:
            st = os.lstat(os.path.join(root, f))
            if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
                wrong.append((os.path.join(root, f), oct(stat.S_IMODE(st.st_mode))))
    assert not wrong, wrong[:10]
    assert any("sessions" in root for root, _, _ in os.walk(server.state_dir))


def test_a_key_swapped_in_place_is_noticed_by_content(server):
    keys = server.state_dir / "keys"
    text = keys.read_text()
    old = server.key
    new = old[:-4] + ("abcd" if old[-4:] != "abcd" else "wxyz")
    st = keys.stat()
    keys.write_text(text.replace(old, new))
    os.utime(keys, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    assert keys.stat().st_size == st.st_size and keys.stat().st_mtime_ns == st.st_mtime_ns
    try:
        deadline = time.monotonic() + 10
        while _get(server, "/v1/models", key=old).status_code != 401:
            assert time.monotonic() < deadline, "the old key is still accepted"
            time.sleep(0.3)
        assert _get(server, "/v1/models", key=new).status_code == 200
    finally:
        keys.write_text(text)
        os.utime(keys, ns=(st.st_atime_ns, st.st_mtime_ns))
        deadline = time.monotonic() + 10
        while _get(server, "/v1/models", key=old).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.3)


def _deep(n: int) -> str:
    return '{"model": "tiny", "input": ' + "[" * n + "]" * n + "}"


@pytest.mark.parametrize("path, raw, says", [
    ("/v1/responses", _deep(1000), "nests deeper than 64"),
    ("/v1/chat/completions", _deep(1000), "nests deeper than 64"),
    ("/v1/ninfer/checkpoints", '{"a": ' + "[" * 1000 + "]" * 1000 + "}", "nests deeper"),
    ("/v1/responses", '{"model": "tiny", "input": "hi \\ud800 there"}', "lone UTF-16 surrogate"),
    ("/v1/responses", '{"model": "tiny", "input": "hi", "stream": true, '
                      '"instructions": "\\udfff"}', "lone UTF-16 surrogate"),
    ("/v1/responses", '{"model": "tiny", "input": [{"role": ["user"], "content": "x"}]}',
     "role"),
    ("/v1/responses", '{"model": "tiny", "input": [{"role": {"a": 1}, "content": "x"}]}',
     "role"),
    ("/v1/responses", '{"model": "tiny", "input": "x", "include": [{}]}', "include"),
    ("/v1/responses", '{"model": "tiny", "input": "x", "seed": 1267650600228229401496703205376}',
     "64 bits"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": ["user"], "content": '
                             '"x"}]}', "role"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "x"}],'
                             ' "stream": true, "stream_options": 5}', "stream_options"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "x"}],'
                             ' "stream_options": [1]}', "stream_options"),
    ("/v1/responses", '{"model": "tiny", "input": "x", "tools": [{"type": "function", "name": '
                      '"f", "parameters": {"type": "object", "required": 5}}]}',
     "parameters cannot be used"),
    ("/v1/responses", '{"model": "tiny", "input": "x", "tools": [{"type": "function", "name": '
                      '"f", "parameters": {"type": "object", "required": [{}]}}]}',
     "parameters cannot be used"),
    ("/v1/responses", '{"model": "tiny", "input": "x", "text": {"format": {"type": '
                      '"json_schema", "name": "a", "schema": {"x-guidance": 1}}}}',
     "cannot be compiled"),
    ("/v1/responses", '{"model": "tiny", "input": "x", "text": {"format": {"type": '
                      '"json_schema", "name": "a", "schema": {"$ref": "#"}}}}',
     "cannot be generated"),
    ("/v1/responses", '{"model": "tiny", "input": "x", "text": {"format": {"type": '
                      '"json_schema", "name": "a", "schema": {"$defs": {"a": {"$ref": '
                      '"#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}}',
     "cannot be generated"),
    ("/v1/responses", '{"model": "tiny", "input": "x", "tool_choice": {"type": "function", '
                      '"name": "f"}, "tools": [{"type": "function", "name": "f", "parameters": '
                      '{"type": "object", "properties": {"a": {"type": "string", "maxLength": '
                      '1000000000}}, "required": ["a"]}}]}', "cannot be generated"),
])
def test_bodies_that_gave_500s_get_a_400_in_the_api_format(server, path, raw, says):
    r = httpx.post(server.base_url + path, content=raw.encode(), timeout=60,
                   headers={"Authorization": f"Bearer {server.key}",
                            "Content-Type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and says in err["message"], err
    assert _get(server, "/health").status_code == 200  # the server lives on


SESSION_KEYS = ["a/b", "with space", "ünïcode ☃", "*", "%41", "a?b=c", "a#frag", "..", ".",
                "tab\there", "semi;colon", "plus+sign", "back\\slash", "quote\"s"]


def test_every_session_key_can_be_purged(server):
    """DELETE /v1/ninfer/sessions/{key} decodes the percent-encoded key: keys with '/', spaces,
    unicode, '*', '%', '?', '#' and dot segments (encoded as %2E) all purge their session."""
    from urllib.parse import quote

    auth = {"Authorization": f"Bearer {server.key}"}
    for key in SESSION_KEYS:
        r = httpx.post(server.api_url + "/responses", headers=auth, timeout=120,
                       json={"model": "tiny", "input": "hi", "max_output_tokens": 1,
                             "prompt_cache_key": key})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        encoded = quote(key, safe="").replace(".", "%2E")
        d = httpx.delete(server.api_url + "/ninfer/sessions/" + encoded, headers=auth,
                         timeout=60)
        assert d.status_code == 200, (key, d.status_code, d.text)
        assert d.json()["responses"] == 1, key
        assert httpx.get(server.api_url + f"/responses/{rid}", headers=auth,
                         timeout=30).status_code == 404, key
    bad = httpx.delete(server.api_url + "/ninfer/sessions/%FF%FE", headers=auth, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_key"


def test_long_urls_get_414_and_long_keys_400(server):
    auth = {"Authorization": f"Bearer {server.key}"}
    for n in (5_000, 7_900):
        r = httpx.delete(server.api_url + "/ninfer/sessions/" + "k" * n, headers=auth,
                         timeout=30)
        assert r.status_code == 414, (n, r.status_code, r.text[:200])
        assert r.json()["error"]["code"] == "uri_too_long"
    r = httpx.post(server.api_url + "/responses", headers=auth, timeout=60,
                   json={"model": "tiny", "input": "hi", "prompt_cache_key": "k" * 513})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key"
    r = httpx.post(server.api_url + "/responses", headers=auth, timeout=60,
                   json={"model": "tiny", "input": "hi", "previous_response_id": "r" * 129})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert _get(server, "/health").status_code == 200


def test_a_bounded_string_under_a_forced_call_generates(server):
    """A raw string parameter with maxLength 100 under a forced call answered 500 once the
    budget steering had walked it (the lexer's fuel); it now generates a call."""
    r = httpx.post(server.api_url + "/responses", timeout=120,
                   headers={"Authorization": f"Bearer {server.key}"},
                   json={"model": "tiny", "input": "x", "max_output_tokens": 64,
                         "tool_choice": {"type": "function", "name": "f"},
                         "tools": [{"type": "function", "name": "f", "parameters": {
                             "type": "object", "properties": {
                                 "a": {"type": "string", "maxLength": 100}},
                             "required": ["a"]}}]})
    assert r.status_code == 200, r.text[:300]
    out = r.json()["output"]
    calls = [x for x in out if x["type"] == "function_call"]
    assert r.json()["status"] == "incomplete" or (calls and calls[0]["name"] == "f")


def test_a_graceful_stop_exits_0_with_the_wal_checkpointed(tmp_path):
    """SIGTERM: the stop report, then exit status 0 (not an abort from threads still inside
    XLA at interpreter finalization), and responses.db holds everything: its WAL is empty."""
    import sqlite3

    state = tmp_path / "state"
    srv = start_server(state, "--checkpoints", "off")
    try:
        r = httpx.post(srv.api_url + "/responses", timeout=120,
                       headers={"Authorization": f"Bearer {srv.key}"},
                       json={"model": "tiny", "input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
    finally:
        code = srv.stop()
    log = "".join(srv.log)
    assert code == 0, log[-2000:]
    assert "stop report" in log and "FATAL" not in log
    wal = state / "responses.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    db = sqlite3.connect(f"file:{state / 'responses.db'}?mode=ro", uri=True)
    try:
        assert db.execute("SELECT COUNT(*) FROM responses WHERE id = ?", (rid,)).fetchone()[0]
    finally:
        db.close()


_PROBE = r"""
import json, sys, time, urllib.request
url, n = sys.argv[1], int(sys.argv[2])
out = []
for _ in range(n):
    t = time.monotonic()
    with urllib.request.urlopen(url, timeout=30) as r:
        r.read()
    out.append(time.monotonic() - t)
    time.sleep(0.1)
print(json.dumps(out))
"""


def test_health_answers_within_100ms_while_a_32mb_body_is_processed(server):
    """A 32 MB chat message is parsed, rendered and tokenized off the event loop: /health,
    probed 50 times from another process meanwhile, answers within 100 ms; the message itself
    gets context_length_exceeded. One probe in 50 may take up to 300 ms: on CI's two shared
    cores the probe's own process, the server's loop and its tokenizing thread take turns, and
    one CI run saw a single 141 ms answer among 49 under 22 ms. A loop that waited for the
    tokenizer would hold every probe for seconds."""
    import json
    import subprocess
    import sys
    import threading

    text = "word " * (32_000_000 // 5)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}],
                       "max_tokens": 4}).encode()
    result = {}

    def post():
        result["r"] = httpx.post(server.api_url + "/chat/completions", content=body,
                                 timeout=600, headers={"Authorization": f"Bearer {server.key}",
                                                       "Content-Type": "application/json"})
    t = threading.Thread(target=post)
    t.start()
    time.sleep(2.0)  # the body is on the server
    probe = subprocess.run([sys.executable, "-c", _PROBE, server.base_url + "/health", "50"],
                           capture_output=True, text=True, timeout=300)
    busy = t.is_alive()
    t.join(600)
    latencies = json.loads(probe.stdout)
    assert busy, "the large request finished before the probes ended: nothing was measured"
    print("health latencies, slowest:", sorted(latencies)[-6:])
    slow = [x for x in latencies if x >= 0.1]
    assert len(latencies) == 50 and len(slow) <= 1 and max(latencies) < 0.3, \
        sorted(latencies)[-5:]
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
