"""Every accepted parameter does what it says, or is refused: log-probabilities of the sampled
tokens, truncation and background refused, store: false never stored, context overflow in the
words a client's compaction reacts to. Against the real server, through the OpenAI SDK."""
from __future__ import annotations

import math
import sqlite3

import httpx
import openai
import pytest

from tests.serverproc import start_server


@pytest.fixture(scope="module")
def server(shared_state_dir):
    srv = start_server(shared_state_dir)
    yield srv
    assert srv.stop() in (0, -15), "".join(srv.log)


def _sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=server.key, max_retries=0)


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.api_url + "/responses", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {server.key}"})


def _check_logprobs(entries: list, k: int) -> None:
    for e in entries:
        assert set(e) == {"token", "bytes", "logprob", "top_logprobs"}, e
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
        assert e["logprob"] <= 0.0 and math.isfinite(e["logprob"])
        top = e["top_logprobs"]
        assert len(top) == k
        lps = [t["logprob"] for t in top]
        assert lps == sorted(lps, reverse=True)
        # the sampled token is at most as likely as the most likely one, and is among the
        # alternatives whenever it is at least as likely as the last of them
        if k:
            assert e["logprob"] <= lps[0] + 1e-5
            if e["logprob"] > lps[-1] + 1e-5:
                assert e["token"] in [t["token"] for t in top]


def test_logprobs_are_the_sampled_tokens_own(server):
    """Greedy decoding picks the most likely token: its log-probability is the top one's, and
    the probabilities of the alternatives sum to at most 1."""
    client = _sdk(server)
    r = client.responses.create(model="tiny", input="Count: one two three",
                                max_output_tokens=12, temperature=0, top_logprobs=3,
                                include=["message.output_text.logprobs"])
    (msg,) = [o for o in r.output if o.type == "message"]
    part = msg.content[0]
    entries = [e.model_dump() for e in part.logprobs]
    assert entries, "no logprobs came back"
    _check_logprobs(entries, 3)
    assert "".join(e["token"] for e in entries).strip() == part.text.strip()
    for e in entries:  # greedy: the sampled token is the most likely one
        assert e["token"] == e["top_logprobs"][0]["token"]
        assert abs(e["logprob"] - e["top_logprobs"][0]["logprob"]) < 1e-5
        assert sum(math.exp(t["logprob"]) for t in e["top_logprobs"]) <= 1.0 + 1e-4
    # asked for nothing: nothing
    plain = client.responses.create(model="tiny", input="Count: one two three",
                                    max_output_tokens=12, temperature=0)
    assert [o for o in plain.output if o.type == "message"][0].content[0].logprobs == []


def test_logprobs_stream_with_each_delta(server):
    """Streamed with temperature 1: each delta carries its tokens; together they are the
    message's logprobs in the done event and the final response."""
    client = _sdk(server)
    with client.responses.stream(model="tiny", input="Say something long.", temperature=1.0,
                                 extra_body={"seed": 7}, max_output_tokens=16, top_logprobs=2,
                                 include=["message.output_text.logprobs"]) as s:
        events = list(s)
    final = events[-1].response  # response.incomplete: the budget ends the tiny model's text
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [lp.model_dump() for d in deltas for lp in d.logprobs]
    done = [e for e in events if e.type == "response.output_text.done"][0]
    msg = [o for o in final.output if o.type == "message"][0]
    assert streamed and streamed == [lp.model_dump() for lp in done.logprobs]
    assert streamed == [lp.model_dump() for lp in msg.content[0].logprobs]
    _check_logprobs(streamed, 2)
    assert all(d.logprobs for d in deltas)  # no delta without its tokens


@pytest.mark.parametrize("body,param", [
    ({"truncation": "auto"}, "truncation"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"background": True}, "background"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2.5}, "top_logprobs"),
])
def test_parameters_it_cannot_honour_are_refused(server, body, param):
    r = _post(server, {"model": "tiny", "input": "hi", "max_output_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_truncation_disabled_and_background_false_are_served(server):
    r = _post(server, {"model": "tiny", "input": "hi", "max_output_tokens": 2,
                       "truncation": "disabled", "background": False})
    assert r.status_code == 200, r.text
    assert r.json()["truncation"] == "disabled"


def test_store_false_is_never_stored(server):
    client = _sdk(server)
    marker = "unstored-marker-7f3a"
    r = client.responses.create(model="tiny", input=f"Remember {marker}", store=False,
                                max_output_tokens=4)
    assert r.store is False
    with client.responses.stream(model="tiny", input=f"Remember {marker} too", store=False,
                                 max_output_tokens=4) as s:
        streamed = list(s)[-1].response
    for rid in (r.id, streamed.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            client.responses.input_items.list(rid)
        cont = _post(server, {"model": "tiny", "input": "go on", "previous_response_id": rid,
                              "max_output_tokens": 2})
        assert cont.status_code in (400, 404), cont.text
        assert cont.json()["error"]["code"] == "previous_response_not_found"
    # nothing in the database: no id, no text
    dbs = list(server.state_dir.rglob("responses.db"))
    assert dbs
    for db in dbs:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'"):
                for row in con.execute(f'SELECT * FROM "{table}"'):
                    flat = repr(row)
                    assert r.id not in flat and streamed.id not in flat and marker not in flat
        finally:
            con.close()


def test_context_overflow_speaks_the_words_compaction_reacts_to(server):
    """OMP (pi-ai's error flags) takes an error for a context overflow when its text says
    `context_length_exceeded`, `maximum context length is N tokens` or `exceeds the context
    window`: the server's says all three, before streaming, as a 400."""
    r = _post(server, {"model": "tiny", "input": "word " * 40_000, "max_output_tokens": 2,
                       "stream": True})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "input"
    import re
    assert re.search(r"maximum context length is \d+ tokens", err["message"])
    assert "exceeds the context window" in err["message"]


def test_health_answers_503_while_the_model_loads(tmp_path, embedded_models_dir):
    """The real server process, probed from its first listening moment: `/health` answers 503
    `loading` (and generation 503 `model_loading`) until the model is loaded, then 200."""
    import time

    d = tmp_path / "state"
    d.mkdir()
    (d / "models").symlink_to(embedded_models_dir)
    srv = start_server(d, wait_ready=False)
    seen, refused = [], None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            r = httpx.get(srv.base_url + "/health", timeout=5)
            seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
            if refused is None:
                refused = _post(srv, {"model": "tiny", "input": "hi", "max_output_tokens": 2})
            time.sleep(0.01)
    finally:
        srv.stop()
    assert seen[-1] == (200, {"status": "ok"}), seen[-3:]
    loading = [s for s in seen if s[0] != 200]
    assert loading and all(s == (503, {"status": "loading"}) for s in loading), seen[:3]
    assert refused is not None and refused.status_code == 503
    assert refused.json()["error"]["code"] == "model_loading"
    print(f"{len(loading)} probes answered 503 before the model was ready")
