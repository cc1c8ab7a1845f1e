"""Tool and reasoning items, cancel, the stateless chat API, key rotation and size limits, over a
real socket with the OpenAI SDK."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.serverproc import start_server

KEYS = "alice nk-alice-0123456789abcdef\nbob nk-bob-0123456789abcdef00\n"
ALICE, BOB = "nk-alice-0123456789abcdef", "nk-bob-0123456789abcdef00"
TOOLS = [{"type": "function", "name": "read", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                         "required": ["path"]}}]


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory, embedded_models_dir):
    d = tmp_path_factory.mktemp("items")
    (d / "models").symlink_to(embedded_models_dir)
    (d / "keys").write_text(KEYS)
    (d / "keys").chmod(0o600)
    return d


@pytest.fixture(scope="module")
def server(state_dir):
    srv = start_server(state_dir)
    yield srv
    srv.stop()


def sdk(server, key=ALICE):
    return openai.OpenAI(base_url=server.api_url, api_key=key, max_retries=0)


def post(server, path, body, key=ALICE, **kw):
    return httpx.post(server.api_url + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}, **kw)


def count(server, **body):
    r = post(server, "/responses/input_tokens", {"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_tool_items_render_into_the_prompt(server):
    call = {"type": "function_call", "call_id": "call_1", "name": "read",
            "arguments": json.dumps({"path": "README.md"})}
    out_str = {"type": "function_call_output", "call_id": "call_1", "output": "# Title"}
    out_arr = {"type": "function_call_output", "call_id": "call_1",
               "output": [{"type": "input_text", "text": "# Title"}]}
    user = {"type": "message", "role": "user", "content": "Read the readme."}
    base = count(server, input=[user], tools=TOOLS)
    assert base > count(server, input=[user])  # the tool definitions are in the system turn
    with_call = count(server, input=[user, call, out_str], tools=TOOLS)
    assert with_call > base
    assert count(server, input=[user, call, out_arr], tools=TOOLS) == with_call
    r = sdk(server).responses.create(model="tiny", input=[user, call, out_str], tools=TOOLS,
                                     temperature=0, max_output_tokens=4)
    assert r.usage.input_tokens == with_call
    assert r.tools[0].name == "read" and r.tool_choice == "auto"


def test_unsupported_inputs_get_clear_400s(server):
    cases = [
        ({"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
         "unsupported_content", "input[0].content[0]"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "unsupported_tool",
         "tools[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "read",
                     "arguments": "{oops"}]}, None, "input[0].arguments"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, None,
         "text.format.schema"),
    ]
    for body, code, param in cases:
        r = post(server, "/responses", {"model": "tiny", **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == (code, param) and err["message"]


def test_oversized_body_is_refused_in_the_api_format(server):
    r = httpx.post(server.api_url + "/responses", content=b"x" * (33 * 1024 * 1024),
                   headers={"Authorization": f"Bearer {ALICE}",
                            "Content-Type": "application/json"}, timeout=120)
    assert r.status_code == 413
    assert r.json()["error"]["message"]


def test_reasoning_is_an_item_that_replays_exactly(server):
    c = sdk(server)
    kw = dict(model="tiny", instructions="Think, then answer.", temperature=0,
              reasoning={"effort": "low", "summary": "auto"}, prompt_cache_key="rs-1",
              include=["reasoning.encrypted_content"])
    r1 = c.responses.create(input="What is 2+2?", max_output_tokens=24, **kw)
    kinds = [o.type for o in r1.output]
    assert kinds[0] == "reasoning", kinds
    assert 1 <= r1.usage.output_tokens_details.reasoning_tokens <= r1.usage.output_tokens
    # chained continuation
    r2 = c.responses.create(input="And 3+3?", previous_response_id=r1.id,
                            max_output_tokens=64, **kw)
    cached = r2.usage.input_tokens_details.cached_tokens
    assert cached >= r1.usage.input_tokens + r1.usage.output_tokens - 1
    # The same conversation resent whole (a client resuming): the echoed reasoning and message
    # items are matched to the stored ones, so the prompt is the same token sequence, the
    # cached state is found and the greedy continuation is identical.
    transcript = [{"type": "message", "role": "user", "content": "What is 2+2?"}]
    transcript += [o.model_dump(exclude_none=True) for o in r1.output]
    transcript += [{"type": "message", "role": "user", "content": "And 3+3?"}]
    r3 = c.responses.create(input=transcript, max_output_tokens=64, **kw)
    assert r3.usage.input_tokens == r2.usage.input_tokens
    assert r3.usage.input_tokens_details.cached_tokens == cached
    ids2 = [o.model_dump() for o in r2.output]
    ids3 = [o.model_dump() for o in r3.output]
    for a, b in zip(ids2, ids3):  # ids and sealed blobs (fresh nonces) differ by design
        for k in ("id", "encrypted_content"):
            a.pop(k, None), b.pop(k, None)
    assert ids2 == ids3
    text = "".join(p.text for o in r2.output if o.type == "reasoning" for p in o.content or [])
    text += r2.output_text
    assert len(text) >= 64 and len(set(text)) >= 16
    assert r1.output[0].encrypted_content.startswith("ninfer-rs1.")
    # echoed with only its encrypted_content (no text): the sealed token ids stand for it
    bare = [dict(x) for x in transcript]
    bare[1] = {"type": "reasoning", "id": bare[1]["id"], "summary": [],
               "encrypted_content": bare[1]["encrypted_content"]}
    r5 = c.responses.create(input=bare, max_output_tokens=64, **kw)
    assert r5.usage.input_tokens == r2.usage.input_tokens
    assert r5.usage.input_tokens_details.cached_tokens == cached
    # negative control: a transcript whose reasoning differs does not match, computes more
    altered = [dict(x) for x in transcript]
    altered[1] = dict(altered[1], content=[{"type": "reasoning_text", "text": "other"}],
                      summary=[], encrypted_content=None)
    r4 = c.responses.create(input=altered, max_output_tokens=4, **kw)
    assert r4.usage.input_tokens_details.cached_tokens < cached


def test_cancel_stops_a_response_in_flight(server):
    c = sdk(server)
    events, seen_id = [], threading.Event()

    def consume():
        stream = c.responses.create(model="tiny", input="Write a long story.",
                                    max_output_tokens=4000, temperature=1, stream=True,
                                    prompt_cache_key="cancel-1")
        for ev in stream:
            events.append(ev)
            if ev.type == "response.created":
                seen_id.set()

    t = threading.Thread(target=consume)
    t.start()
    assert seen_id.wait(120)
    rid = events[0].response.id
    # another principal cannot cancel it: the id is unknown to them
    assert post(server, f"/responses/{rid}/cancel", None, key=BOB).status_code == 404
    while not any(e.type == "response.output_text.delta" for e in events):
        time.sleep(0.05)
    r = post(server, f"/responses/{rid}/cancel", None)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled"
    t.join(60)
    assert not t.is_alive()
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "cancelled"
    assert events[-1].response.usage.output_tokens < 4000
    stored = c.responses.retrieve(rid)
    assert stored.status == "cancelled" and stored.output_text == events[-1].response.output_text
    # cancelling a finished response changes nothing
    again = post(server, f"/responses/{rid}/cancel", None).json()
    assert again["status"] == "cancelled" and again["output_text"] == stored.output_text
    assert post(server, "/responses/resp_nope/cancel", None).status_code == 404


def test_chat_completions_stateless(server):
    c = sdk(server)
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Read the readme."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "read", "arguments": '{"path": "README.md"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "# Title"}]
    tools = [{"type": "function", "function": {k: TOOLS[0][k] for k in
                                               ("name", "description", "parameters")}}]
    r = c.chat.completions.create(model="tiny", messages=msgs, tools=tools, temperature=0,
                                  max_tokens=12, seed=1)
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    again = c.chat.completions.create(model="tiny", messages=msgs, tools=tools,
                                      temperature=0, max_tokens=12)
    assert again.choices[0].message.content == r.choices[0].message.content
    # the shared prefix (system turn with the tools) is reused for a stateless request
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, tools=tools,
                                            temperature=0, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    for name, value in (("stop", ["\n"]), ("logprobs", True), ("presence_penalty", 0.5)):
        bad = post(server, "/chat/completions", {"model": "tiny", name: value,
                                                 "messages": [{"role": "user", "content": "x"}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == name, bad.text
    bad = post(server, "/chat/completions", {"model": "tiny", "messages": [], "n": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    bad = post(server, "/chat/completions", {"model": "tiny", "n": 2,
                                             "messages": [{"role": "user", "content": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"


def test_key_rotation_keeps_the_principals_sessions(server, state_dir):
    c = sdk(server, BOB)
    r1 = c.responses.create(model="tiny", input="Hello.", temperature=0, max_output_tokens=6,
                            prompt_cache_key="rot-1")
    new_bob = "nk-bob-rotated-000000000000001"
    keys = state_dir / "keys"
    tmp = state_dir / "keys.new"
    tmp.write_text(KEYS.replace(BOB, new_bob))
    tmp.chmod(0o600)
    tmp.replace(keys)
    deadline = time.monotonic() + 10
    while post(server, "/responses/input_tokens", {"model": "tiny", "input": "x"},
               key=BOB).status_code != 401:
        assert time.monotonic() < deadline, "the old key still works"
        time.sleep(0.2)
    c2 = sdk(server, new_bob)
    assert c2.responses.retrieve(r1.id).id == r1.id
    r2 = c2.responses.create(model="tiny", input="Again.", previous_response_id=r1.id,
                             temperature=0, max_output_tokens=6, prompt_cache_key="rot-1")
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    # a key file that becomes readable by others fails closed
    keys.chmod(0o644)
    try:
        deadline = time.monotonic() + 10
        while post(server, "/responses/input_tokens", {"model": "tiny", "input": "x"},
                   key=ALICE).status_code != 401:
            assert time.monotonic() < deadline, "an unsafe key file is still trusted"
            time.sleep(0.2)
    finally:
        keys.chmod(0o600)
    deadline = time.monotonic() + 10
    while post(server, "/responses/input_tokens", {"model": "tiny", "input": "x"},
               key=ALICE).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
