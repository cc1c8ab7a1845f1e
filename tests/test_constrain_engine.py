"""Constraints inside the engine: masks in the batched decode step, on the embedded models.

The tool-happy model (`embedded:tiny-tools`) starts tool calls on its own, so "none" has
something to prevent and "required" has calls of its own to complete."""
from __future__ import annotations

import dataclasses
import json
import queue

import jsonschema
import pytest

from engine.constrain.compiler import ConstraintCompiler
from engine.engine import DoneEvent, Engine, GenerationRequest
from engine.model.config import TINY
from engine.runtime.sampling import SamplingParams
from engine.text.chat import render_chat
from engine.text.toolcall import parse_tool_calls

TINY_TOOLS_SHA256 = "7cfa6f7150a0bb60872cfcbef87a0e1904edf3cb38d201fc7c15bf52229f886f"
TOOL_CALL = 248058
TOOLS = [
    {"type": "function", "name": "read", "description": "Read a file.", "strict": True,
     "parameters": {"type": "object", "additionalProperties": False, "required": ["path"],
                    "properties": {"path": {"type": "string"},
                                   "offset": {"type": "integer", "minimum": 0}}}},
    {"type": "function", "name": "grep", "description": "Search files.",
     "parameters": {"type": "object", "required": ["pattern", "max"],
                    "properties": {"pattern": {"type": "string"},
                                   "max": {"type": "integer", "maximum": 100},
                                   "paths": {"type": "array", "items": {"type": "string"}}}}},
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
PROMPTS = ["What is in README.md?", "List the files here.", "Fix the bug in main.py.",
           "Run the tests.", "Explain engine.py.", "Read config.toml.", "Where is sample()?",
           "Summarize the repo."]
POINT = {"type": "object", "additionalProperties": False, "required": ["label", "x", "tags"],
         "properties": {"label": {"type": "string", "maxLength": 10},
                        "x": {"type": "number"},
                        "tags": {"type": "array", "maxItems": 2,
                                 "items": {"enum": ["a", "b", "c"]}}}}


@pytest.fixture(scope="module")
def tools_model(shared_state_dir):
    from engine.io.loader import ensure_embedded, load_model

    model = load_model(ensure_embedded(shared_state_dir, "tiny-tools", TINY_TOOLS_SHA256))
    assert model.cfg.name == "tiny-tools"
    # Same shapes as `tiny`: under tiny's static config the jitted steps are the ones the other
    # engine tests already compiled (the config is a static jit argument, its name included).
    return dataclasses.replace(model, cfg=TINY)


@pytest.fixture(scope="module")
def compiler(tools_model):
    return ConstraintCompiler(tools_model.tokenizer)


@pytest.fixture(scope="module")
def tools_engine(tools_model):
    eng = Engine(tools_model, context_tokens=2048, prefill_chunk=64, max_concurrency=2,
                 max_queue=32)
    eng.start()
    yield eng
    eng.stop()


def run_all(engine, model, requests):
    """Submit (prompt, sampling, max_tokens, constraint) tuples together; returns
    [(tokens, DoneEvent)] in order. A prompt is ids or (ids, end of the system turn): the
    system turn (the tool definitions) is then computed once and reused."""
    queues = []
    for ids, sampling, max_tokens, constraint in requests:
        ids, boundary = ids if isinstance(ids, tuple) else (ids, 0)
        q: queue.Queue = queue.Queue()
        engine.submit(GenerationRequest(prompt_ids=ids, sampling=sampling, max_tokens=max_tokens,
                                        stop_ids=frozenset(model.tokenizer.eos_ids),
                                        emit=q.put, constraint=constraint, principal="t",
                                        prefix_boundary=boundary))
        queues.append(q)
    out = []
    for q in queues:
        toks = []
        while not isinstance(ev := q.get(timeout=300), DoneEvent):
            toks.append(ev.token_id)
        out.append((toks, ev))
    return out


def prompt(model, i, thinking=False, tools=TOOLS):
    """(prompt ids, end of the system turn) of a one-message chat."""
    text = render_chat(model.chat_template, [{"role": "user", "content": PROMPTS[i % 8]}],
                       tools=tools, enable_thinking=thinking)
    system = text[:text.index("<|im_end|>\n") + len("<|im_end|>\n")] if tools else ""
    return model.tokenizer.encode(text), len(model.tokenizer.encode(system))


def t1(seed):
    return SamplingParams(temperature=1.0, seed=seed)


class Broken:
    """A constraint that fails while building its mask."""
    terminated = False

    def fill_mask(self, row, remaining):
        raise RuntimeError("boom")

    def accept(self, token):
        pass


def test_constrained_row_leaves_the_other_row_exact(tools_model, tools_engine, compiler):
    model, greedy = tools_model, SamplingParams(temperature=0.0)
    plain = (model.tokenizer.encode("def fibonacci(n):\n    "), greedy, 24, None)
    [(alone, _)] = run_all(tools_engine, model, [plain])
    con = compiler.compile(text_format={"type": "json_schema", "name": "point", "schema": POINT,
                                        "strict": True})
    (together, _), (js, done) = run_all(tools_engine, model, [
        plain, (prompt(model, 0, tools=None), greedy, 40, con)])
    assert together == alone and len(set(alone)) >= 8
    assert done.finish_reason == "stop"
    jsonschema.validate(json.loads(model.tokenizer.decode(js)), POINT)
    # a constraint that fails ends its own sequence; the engine thread and the other row go on
    (again, ok), (_, failed) = run_all(tools_engine, model, [plain, plain[:3] + (Broken(),)])
    assert failed.finish_reason == "error" and ok.finish_reason in ("stop", "length")
    assert again == alone


def test_tool_happy_model_calls_unless_none(tools_model, tools_engine, compiler):
    reqs = [(prompt(tools_model, i), t1(i), 32, None) for i in range(10)]
    starts = [toks.index(TOOL_CALL) if TOOL_CALL in toks else -1
              for toks, _ in run_all(tools_engine, tools_model, reqs)]
    assert sum(s >= 0 for s in starts) > len(starts) / 2, starts
    assert sum(s == 0 for s in starts) < len(starts) / 2, starts  # not just always first
    reqs = [(ids, sp, 20, compiler.compile(tools=TOOLS, tool_choice="none"))
            for ids, sp, _, _ in reqs[:8]]
    for toks, done in run_all(tools_engine, tools_model, reqs):
        assert TOOL_CALL not in toks
        assert not parse_tool_calls(tools_model.tokenizer.decode(toks), TOOLS).calls
        assert done.finish_reason in ("stop", "length")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "grep"}],
                         ids=["required", "named"])
def test_required_and_named_calls_validate(tools_model, tools_engine, compiler, choice):
    reqs = [(prompt(tools_model, i), t1(100 + i), 64,
             compiler.compile(tools=TOOLS, tool_choice=choice)) for i in range(6)]
    for toks, done in run_all(tools_engine, tools_model, reqs):
        text = tools_model.tokenizer.decode(toks)
        calls = parse_tool_calls(text, TOOLS).calls
        assert done.finish_reason == "stop" and calls, text
        for call in calls:
            assert isinstance(choice, str) or call.name == "grep"
            jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_thinking_then_call_within_budget(tools_model, tools_engine, compiler):
    reqs = [(prompt(tools_model, i, thinking=True), t1(200 + i), 64,
             compiler.compile(tools=TOOLS, tool_choice="required", thinking=True,
                              thinking_budget=12)) for i in range(4)]
    for toks, done in run_all(tools_engine, tools_model, reqs):
        text = tools_model.tokenizer.decode(toks)
        assert done.finish_reason == "stop" and toks.index(248069) <= 12
        calls = parse_tool_calls(text.split("</think>", 1)[1], TOOLS).calls
        assert calls
        for call in calls:
            jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_bounded_json_schema_always_completes(tools_model, tools_engine, compiler):
    fmt = {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}
    need = compiler.compile(text_format=fmt).close_out_tokens
    reqs = [(prompt(tools_model, i, tools=None), t1(300 + i), budget,
             compiler.compile(text_format=fmt)) for i in range(4) for budget in (need, 40)]
    for (toks, done), req in zip(run_all(tools_engine, tools_model, reqs), reqs):
        text = tools_model.tokenizer.decode(toks)
        assert done.finish_reason == "stop" and len(toks) <= req[2], text
        jsonschema.validate(json.loads(text), POINT)
