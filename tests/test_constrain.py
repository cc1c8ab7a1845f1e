"""Constraints on their own (no model): random logits through the masks, outputs checked by the
real parsers and by jsonschema. A random "model" is the adversary a grammar must survive."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from engine.constrain.compiler import ConstraintCompiler, ConstraintError
from engine.text.tokenizer import Tokenizer
from engine.text.toolcall import parse_tool_calls

TOOL_CALL, THINK_END, EOS = 248058, 248069, 248046

TOOLS = [
    {"type": "function", "name": "read", "description": "Read a file.", "strict": True,
     "parameters": {"type": "object", "additionalProperties": False, "required": ["path"],
                    "properties": {"path": {"type": "string", "maxLength": 40},
                                   "limit": {"type": "integer", "minimum": 1}}}},
    {"type": "function", "name": "bash", "description": "Run a command.",
     "parameters": {"type": "object", "required": ["cmd", "timeout"],
                    "properties": {"cmd": {"type": "string"},
                                   "timeout": {"type": "number", "maximum": 600},
                                   "mode": {"enum": ["fast", "safe"]},
                                   "env": {"type": "object",
                                           "additionalProperties": {"type": "string"}}}}},
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
BOUNDED = {"type": "object", "additionalProperties": False,
           "required": ["name", "age", "tags", "where"],
           "properties": {"name": {"type": "string", "maxLength": 12},
                          "age": {"type": "integer", "minimum": 0, "maximum": 150},
                          "tags": {"type": "array", "maxItems": 3,
                                   "items": {"type": "string", "maxLength": 8}},
                          "where": {"type": "object", "required": ["x"],
                                    "additionalProperties": False,
                                    "properties": {"x": {"type": "number"},
                                                   "ok": {"type": "boolean"}}}}}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.qwen35()


@pytest.fixture(scope="module")
def cc(tok):
    return ConstraintCompiler(tok)


def allowed(row: np.ndarray, n: int) -> np.ndarray:
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:n].astype(bool)


def drive(con, tok, max_tokens: int, seed: int, bias: dict | None = None):
    """Sample under `con` with random logits as the engine does; returns (ids, finish)."""
    rng = np.random.default_rng(seed)
    row = np.zeros(con.mask_words, np.int32)
    out = []
    for step in range(max_tokens):
        logits = rng.random(tok.vocab_size, dtype=np.float32) * 12
        for t, b in (bias or {}).items():
            logits[t] += b
        if con.fill_mask(row, max_tokens - step):
            logits[~allowed(row, tok.vocab_size)] = -np.inf
        t = int(np.argmax(logits))
        con.accept(t)
        if t in tok.eos_ids:
            return out, "stop"
        out.append(t)
        if con.terminated:
            return out, "stop"
    return out, "length"


def body_text(tok, ids, thinking: bool) -> str:
    text = tok.decode(ids)
    if thinking:
        assert text.count("</think>") == 1
        text = text.split("</think>", 1)[1]
    return text


def test_no_constraint_when_nothing_asks_for_one(cc):
    assert cc.compile(tools=TOOLS, tool_choice="auto") is None
    assert cc.compile(tools=TOOLS, thinking=True) is None
    assert cc.compile(text_format={"type": "text"}) is None
    assert cc.compile(thinking=True, thinking_budget=8) is not None


def test_bad_requests_are_refused(cc):
    with pytest.raises(ConstraintError):
        cc.compile(tools=TOOLS, tool_choice={"type": "function", "name": "write"})
    with pytest.raises(ConstraintError):
        cc.compile(tools=[], tool_choice="required")
    with pytest.raises(ConstraintError):
        cc.compile(text_format={"type": "json_schema", "strict": True,
                                "schema": {"type": "string", "format": "no-such-format"}})
    # non-strict: unknown keywords are ignored, not refused
    assert cc.compile(text_format={"type": "json_schema", "strict": False,
                                   "schema": {"type": "string", "format": "no-such-format"}})


def test_none_makes_a_call_impossible(cc, tok):
    con = cc.compile(tools=TOOLS, tool_choice="none")
    row = np.zeros(con.mask_words, np.int32)
    con.fill_mask(row, 100)
    assert not allowed(row, tok.vocab_size)[TOOL_CALL]
    assert allowed(row, tok.vocab_size)[EOS]  # text may end anywhere
    # the spelled-out form is cut off at its last piece, whatever the tokenization
    pieces = tok.encode_ordinary("ok <tool_call>")
    for i, t in enumerate(pieces):
        con.fill_mask(row, 100)
        if not allowed(row, tok.vocab_size)[t]:
            assert i == len(pieces) - 1
            break
        con.accept(t)
    else:
        pytest.fail("the text form of <tool_call> was allowed")
    # a random walk pushed towards the call pieces never writes one
    push = {TOOL_CALL: 50.0, **{t: 20.0 for t in tok.encode_ordinary("<tool_call>")}}
    for seed in range(4):
        ids, _ = drive(cc.compile(tools=TOOLS, tool_choice="none"), tok, 48, seed, push)
        assert TOOL_CALL not in ids and "<tool_call>" not in tok.decode(ids)


@pytest.mark.parametrize("thinking", [False, True])
def test_required_calls_parse_and_validate(cc, tok, thinking):
    for seed in range(10):
        con = cc.compile(tools=TOOLS, tool_choice="required", thinking=thinking,
                         thinking_budget=6)
        ids, finish = drive(con, tok, 96, seed)
        text = body_text(tok, ids, thinking)
        calls = parse_tool_calls(text, TOOLS).calls
        assert finish == "stop" and calls, (seed, text)
        for call in calls:
            jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_named_function_only(cc, tok):
    for seed in range(6):
        con = cc.compile(tools=TOOLS, tool_choice={"type": "function", "name": "bash"},
                         parallel_tool_calls=False)
        ids, finish = drive(con, tok, 96, seed)
        calls = parse_tool_calls(tok.decode(ids), TOOLS).calls
        assert finish == "stop" and [c.name for c in calls] == ["bash"]
        jsonschema.validate(calls[0].arguments, SCHEMAS["bash"])


def test_eos_only_where_the_json_can_end(cc, tok):
    con = cc.compile(text_format={"type": "json_schema", "name": "p", "schema": BOUNDED,
                                  "strict": True})
    row = np.zeros(con.mask_words, np.int32)
    text = '{"name": "x", "age": 3, "tags": [], "where": {"x": 1}}'
    for t in tok.encode(text):
        con.fill_mask(row, 1000)
        assert not allowed(row, tok.vocab_size)[EOS]
        assert allowed(row, tok.vocab_size)[t]
        con.accept(t)
    assert con.terminated  # the object is closed: nothing may follow


@pytest.mark.parametrize("strict", [True, False])
def test_bounded_json_always_completes(cc, tok, strict):
    fmt = {"type": "json_schema", "name": "p", "schema": BOUNDED, "strict": strict}
    shortest = cc.compile(text_format=fmt).close_out_tokens
    for seed in range(8):
        for budget in (shortest, shortest + 7, 80):
            ids, finish = drive(cc.compile(text_format=fmt), tok, budget, seed)
            assert finish == "stop" and len(ids) <= budget, (seed, budget, tok.decode(ids))
            jsonschema.validate(json.loads(tok.decode(ids)), BOUNDED)


def test_json_object_and_thinking_budget(cc, tok):
    for seed in range(4):
        con = cc.compile(text_format={"type": "json_object"}, thinking=True, thinking_budget=5)
        ids, finish = drive(con, tok, 60, seed)
        assert ids.index(THINK_END) <= 5  # forced once 5 thinking tokens are spent
        assert finish == "stop"
        assert isinstance(json.loads(body_text(tok, ids, True)), dict)


def test_thinking_is_cut_to_leave_room_for_the_answer(cc, tok):
    fmt = {"type": "json_schema", "name": "p", "schema": BOUNDED, "strict": True}
    need = cc.compile(text_format=fmt).close_out_tokens
    for seed in range(4):
        con = cc.compile(text_format=fmt, thinking=True)  # no thinking budget at all
        ids, finish = drive(con, tok, need + 12, seed, bias={EOS: 30.0})
        assert finish == "stop", tok.decode(ids)
        jsonschema.validate(json.loads(body_text(tok, ids, True)), BOUNDED)
