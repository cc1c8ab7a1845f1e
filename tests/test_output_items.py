"""Input items to template messages, and the model's output text to output items: the pieces
between the Responses API and the chat template, without a server."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from engine.text.chat import default_chat_template, render_chat
from server.errors import APIError
from server.response_objects import EventStream, OutputAssembler, ResponseState, split_token_ids
from server.input_items import items_to_messages
from server.request_model import parse_response_request

TOOLS = [{"type": "function", "name": "read", "description": "Read a file",
          "parameters": {"type": "object", "properties": {
              "path": {"type": "string"}, "limit": {"type": "integer"}},
              "required": ["path"]}}]

CALL = ("<tool_call>\n<function=read>\n<parameter=path>\nsrc/main.py\n</parameter>\n"
        "<parameter=limit>\n40\n</parameter>\n</function>\n</tool_call>")


def test_items_group_into_template_turns():
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "look first"}]},
        {"type": "message", "role": "assistant", "id": "msg_1",
         "content": [{"type": "output_text", "text": "Let me read it.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "read",
         "arguments": '{"path": "a.py"}'},
        {"type": "function_call", "call_id": "call_2", "name": "read",
         "arguments": '{"path": "b.py"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "print(1)"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "print(2)"}]},
        {"type": "message", "role": "developer", "content": "be brief"},
    ]
    msgs = items_to_messages(items)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "system"]
    a = msgs[1]
    assert a["content"] == "Let me read it." and a["reasoning_content"] == "look first"
    assert [c["function"]["name"] for c in a["tool_calls"]] == ["read", "read"]
    assert msgs[3]["content"] == "print(2)"
    text = render_chat(default_chat_template(), msgs[:4], tools=None,
                       add_generation_prompt=True, preserve_thinking=True)
    assert "<think>\nlook first\n</think>\n\nLet me read it.\n\n<tool_call>" in text
    assert "<parameter=path>\nb.py\n</parameter>" in text
    assert text.count("<tool_response>") == 2 and text.count("<|im_start|>user") == 2


@pytest.mark.parametrize("item, code", [
    ({"type": "message", "role": "user",
      "content": [{"type": "input_image", "image_url": "data:x"}]}, "unsupported_content"),
    ({"type": "function_call", "call_id": "c", "name": "read", "arguments": "{not json"},
     None),
    ({"type": "function_call", "call_id": "c", "name": "read", "arguments": "[1]"}, None),
    ({"type": "function_call_output", "call_id": "c", "output": 5}, None),
    ({"type": "function_call_output", "output": "x"}, None),
    ({"type": "item_reference", "id": "x"}, "unsupported_item"),
    ({"type": "message", "role": "robot", "content": "x"}, None),
])
def test_bad_items_are_refused_with_the_parameter_named(item, code):
    with pytest.raises(APIError) as e:
        items_to_messages([item])
    assert e.value.status == 400 and e.value.param.startswith("input[0]")
    assert e.value.code == code


def test_request_options_are_validated():
    base = {"model": "m", "input": "x"}
    ok = parse_response_request({**base, "tools": TOOLS, "tool_choice": {
        "type": "function", "name": "read"}, "reasoning": {"effort": "low", "summary": "auto"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"},
                            "strict": True}}, "include": ["reasoning.encrypted_content"]})
    assert ok.tool_choice_name == "read" and ok.reasoning.thinking
    assert ok.template_tools[0]["function"]["name"] == "read"
    assert not parse_response_request(base).reasoning.thinking
    for bad, param in [({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS},
                        "tool_choice.name"),
                       ({"tool_choice": "required"}, "tool_choice"),
                       ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                       ({"tools": TOOLS + TOOLS}, "tools[1].name"),
                       ({"reasoning": {"effort": "max"}}, "reasoning.effort"),
                       ({"text": {"format": {"type": "json_schema", "name": "s"}}},
                        "text.format.schema"),
                       ({"include": ["file_search_call.results"]}, "include")]:
        with pytest.raises(APIError) as e:
            parse_response_request({**base, **bad})
        assert e.value.param == param, bad


def _run(asm: OutputAssembler, pieces, status="completed"):
    ops = []
    for p in pieces:
        ops += asm.push(p)
    return ops + asm.finish(status)


def test_thinking_text_and_calls_become_items_in_order():
    asm = OutputAssembler(tools=TOOLS, thinking=True, summary=True)
    _run(asm, ["I should ", "read it.\n</th", "ink>\n\nReading now.\n\n", CALL[:30],
               CALL[30:], "\n", CALL])
    kinds = [i["type"] for i in asm.items]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    r = asm.items[0]
    assert r["content"][0]["text"] == "I should read it."
    assert r["summary"] == [{"type": "summary_text", "text": "I should read it."}]
    assert asm.items[1]["content"][0]["text"] == "Reading now."
    assert json.loads(asm.items[2]["arguments"]) == {"path": "src/main.py", "limit": 40}
    assert asm.items[2]["call_id"] != asm.items[3]["call_id"]
    assert all(i["status"] == "completed" for i in asm.items)


@pytest.mark.parametrize("tools", [None, []])
def test_without_tools_call_markup_stays_message_text(tools):
    """A request that offered no tools gets no function_call back: markup the model writes
    is its message, character for character (what `.strip()` keeps), in any split."""
    text = "Here:\n" + CALL + "\n" + CALL[:40]
    for cuts in ([len(text)], [3, 20, 41, 90, 130]):
        asm = OutputAssembler(tools=tools, thinking=False)
        pieces, last = [], 0
        for c in cuts:
            pieces.append(text[last:c])
            last = c
        pieces.append(text[last:])
        ops = _run(asm, pieces)
        assert [i["type"] for i in asm.items] == ["message"]
        assert asm.items[0]["content"][0]["text"] == text.strip()
        assert "".join(o.text for o in ops if o.kind == "text_delta") == text.strip()
    asm = OutputAssembler(tools=TOOLS, thinking=False)  # the same text with tools: a call
    _run(asm, [text])
    assert [i["type"] for i in asm.items] == ["message", "function_call", "message"]


def test_unfinished_thinking_is_an_incomplete_reasoning_item():
    asm = OutputAssembler(tools=None, thinking=True)
    _run(asm, ["still thinking </thi"], status="incomplete")
    assert [i["type"] for i in asm.items] == ["reasoning"]
    assert asm.items[0]["status"] == "incomplete"
    assert asm.items[0]["content"][0]["text"] == "still thinking </thi"
    assert asm.items[0]["summary"] == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=12))
def test_streamed_events_match_the_final_items_for_any_split(cuts):
    text = "hmm </think>\n\nSure." + CALL + "\n" + CALL + " trailing"
    pieces, pos = [], 0
    for c in cuts:
        pieces.append(text[pos:pos + c])
        pos += c
    pieces.append(text[pos:])
    asm = OutputAssembler(tools=TOOLS, thinking=True)
    state = ResponseState(model="m")
    state.items = asm.items
    es = EventStream(state)
    frames = es.ops(_run(asm, pieces))
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == asm.items
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == list(range(len(asm.items)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "".join(i["content"][0]["text"] for i in asm.items
                             if i["type"] == "message")
    args = [e["arguments"] for e in events
            if e["type"] == "response.function_call_arguments.done"]
    assert args == [i["arguments"] for i in asm.items if i["type"] == "function_call"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_token_ids_split_at_think_end_and_tool_call_tokens():
    THINK_END, TOOL_CALL = 900, 901
    items = [{"type": "reasoning"}, {"type": "message"}, {"type": "function_call"},
             {"type": "function_call"}]
    ids = [1, 2, THINK_END, 3, 4, TOOL_CALL, 5, 6, TOOL_CALL, 7]
    parts = split_token_ids(items, ids, think_end_id=THINK_END, tool_call_id=TOOL_CALL)
    assert parts == [[1, 2, THINK_END], [3, 4], [TOOL_CALL, 5, 6], [TOOL_CALL, 7]]
    # a call the parser kept as text: everything after the reasoning goes to the next item
    parts = split_token_ids(items[:3], ids, think_end_id=THINK_END, tool_call_id=TOOL_CALL)
    assert parts == [[1, 2, THINK_END], ids[3:], []]
    assert sum(parts, []) == ids


def test_reasoning_seal_binds_token_ids_to_a_principal(tmp_path):
    from server.reasoning_seal import ReasoningSeal

    seal = ReasoningSeal.from_state_dir(tmp_path)
    assert (tmp_path / "secrets" / "reasoning.key").stat().st_mode & 0o777 == 0o600
    blob = seal.seal("alice", [5, 6, 7])
    assert seal.open("alice", blob) == [5, 6, 7]
    assert seal.open("bob", blob) is None                       # another principal's
    flipped = blob[:-3] + ("A" if blob[-3] != "A" else "B") + blob[-2:]
    assert seal.open("alice", flipped) is None                   # tampered
    assert ReasoningSeal.from_state_dir(tmp_path).open("alice", blob) == [5, 6, 7]  # restart
    assert seal.open("alice", "not a blob") is None and seal.open("alice", None) is None
    assert blob != seal.seal("alice", [5, 6, 7])  # a fresh nonce every time
