"""Qwen XML tool-call parser: conversion rules, malformed forms, streaming == batch, round trips."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.text.toolcall import (ParseResult, StreamingToolParser, TextDelta, ToolCallArgsDelta,
                                  ToolCallEnd, ToolCallStart, parse_tool_calls)

SCHEMA = {
    "type": "object",
    "properties": {
        "s": {"type": "string"},
        "i": {"type": "integer"},
        "n": {"type": "number"},
        "b": {"type": "boolean"},
        "z": {"type": "null"},
        "o": {"type": "object"},
        "a": {"type": "array"},
        "os": {"type": ["object", "string"]},
        "u": {"type": ["integer", "string"]},
        "ub": {"anyOf": [{"type": "string"}, {"type": "boolean"}, {"type": "null"}]},
        "un": {"oneOf": [{"type": "number"}, {"type": "array"}]},
        "e": {"enum": ["x", 1]},
        "free": {},
    },
}
TOOLS = [{"type": "function", "name": "f", "parameters": SCHEMA},
         {"type": "function", "function": {"name": "g", "parameters": SCHEMA}}]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def render(name: str, args: list[tuple[str, str]]) -> str:
    """The chat template's layout; values already rendered to text."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def one(name: str, raw_value: str, tools=TOOLS):
    r = parse_tool_calls(render("f", [(name, raw_value)]), tools)
    assert len(r.calls) == 1, r
    return r.calls[0].arguments[name]


def stream(text: str, cuts: list[int], tools=TOOLS) -> ParseResult:
    p = StreamingToolParser(tools)
    events, prev = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        events += p.feed(text[prev:c])
        prev = c
    events += p.finish()
    return collect(events)


def collect(events) -> ParseResult:
    text, calls, open_calls = [], [], {}
    for ev in events:
        if isinstance(ev, TextDelta):
            assert ev.text
            text.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            assert ev.index == len(calls) and ev.index not in open_calls
            open_calls[ev.index] = [ev.name, ""]
        elif isinstance(ev, ToolCallArgsDelta):
            open_calls[ev.index][1] += ev.fragment
        else:
            assert isinstance(ev, ToolCallEnd)
            name, args = open_calls.pop(ev.index)
            assert (name, args) == (ev.call.name, ev.call.arguments_json)
            calls.append(ev.call)
    assert not open_calls
    return ParseResult("".join(text), calls)


def check_invariants(text: str, result: ParseResult) -> None:
    """Every character outside calls is in content; arguments_json round-trips."""
    rest, pos = [], 0
    for call in result.calls:
        at = text.index(call.raw, pos)
        rest.append(text[pos:at])
        pos = at + len(call.raw)
        assert json.loads(call.arguments_json) == call.arguments
    rest.append(text[pos:])
    assert result.content == "".join(rest).strip()


# ---- explicit conversion rules ----------------------------------------------------------------

def test_example_from_the_template():
    text = ("I'll look.\n\n" + render("read_file", [("path", "src/main.py"), ("limit", "40")])
            + "\n")
    tools = [{"type": "function", "name": "read_file", "parameters": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}}}]
    r = parse_tool_calls(text, tools)
    assert r.content == "I'll look."
    [c] = r.calls
    assert (c.name, c.arguments) == ("read_file", {"path": "src/main.py", "limit": 40})
    assert c.arguments_json == '{"path":"src/main.py","limit":40}'
    assert c.raw == render("read_file", [("path", "src/main.py"), ("limit", "40")])


def test_string_strips_exactly_one_newline_each_side():
    assert one("s", "") == ""
    assert one("s", "\n  x  \n") == "\n  x  \n"
    assert one("s", " 40 ") == " 40 "
    assert one("s", "true") == "true"
    r = parse_tool_calls("<tool_call><function=f><parameter=s>x</parameter></function></tool_call>",
                         TOOLS)
    assert r.calls[0].arguments == {"s": "x"}


def test_integers_exact():
    big = "-" + "9" * 200
    assert one("i", big) == int(big)
    assert one("i", " 40 ") == 40
    assert one("i", "+7") == 7
    assert one("i", "3.0") == 3 and isinstance(one("i", "3.000"), int)
    c = parse_tool_calls(render("f", [("i", "123456789012345678901234567890")]), TOOLS).calls[0]
    assert c.arguments_json == '{"i":123456789012345678901234567890}'


def test_numbers_keep_their_lexeme():
    def js(v):
        return parse_tool_calls(render("f", [("n", v)]), TOOLS).calls[0].arguments_json

    assert js("1.50") == '{"n":1.5}'
    assert js("10") == '{"n":10}' and isinstance(one("n", "10"), int)
    assert js("3.0") == '{"n":3.0}'
    assert js("0.1000000000000000000001") == '{"n":0.1000000000000000000001}'
    assert js("-.5") == '{"n":-0.5}' and js("5.") == '{"n":5.0}' and js("1E+05") == '{"n":1e+05}'
    assert js("12345678901234567890123") == '{"n":12345678901234567890123}'
    assert one("n", "0.1000000000000000000001") == 0.1


def test_booleans_and_null_case_insensitive():
    assert one("b", "True") is True and one("b", " FALSE ") is False and one("b", "true") is True
    assert one("z", "null") is None and one("z", "None") is None


def test_object_and_array():
    assert one("o", '{"k": [1, 2.50, "é"], "n": null}') == {"k": [1, 2.5, "é"], "n": None}
    c = parse_tool_calls(render("f", [("o", '{"x": 2.50}')]), TOOLS).calls[0]
    assert c.arguments_json == '{"o":{"x":2.50}}'
    assert one("a", "[1, [true]]") == [1, [True]]
    assert one("os", "{not json") == "{not json"  # string allowed: raw text
    assert one("os", '{"a": 1}') == {"a": 1}


@pytest.mark.parametrize("param,value", [("o", "{not json"), ("o", "[1]"), ("a", '{"a": 1}'),
                                         ("a", "[1,"), ("o", "NaN"), ("un", "nope")])
def test_bad_object_or_array_makes_call_malformed(param, value):
    text = render("f", [(param, value)])
    r = parse_tool_calls(text, TOOLS)
    assert r.calls == [] and r.content == text.strip()


def test_union_precedence():
    # null, boolean, integer, number, object, array, string
    assert one("u", "42") == 42 and one("u", "4x") == "4x" and one("u", "4.0") == 4
    assert one("ub", "null") is None and one("ub", "FALSE") is False and one("ub", "x") == "x"
    assert one("un", "1.5") == 1.5 and one("un", "[1]") == [1]
    assert one("e", "1") == 1 and one("e", "x") == "x"


def test_scalar_mismatch_is_best_effort():
    assert one("i", "all") == "all"
    assert one("i", '"7"') == "7"
    assert one("b", "yes") == "yes"
    assert one("n", "[1]") == [1]


def test_unknown_parameter_and_function_best_effort():
    assert one("other", "12") == 12 and one("other", "[1, 2]") == [1, 2]
    assert one("other", "hello\n") == "hello\n" and one("free", "True") == "True"
    r = parse_tool_calls(render("nope", [("x", "1.50"), ("y", "a b"), ("z", '{"q": 1}')]), TOOLS)
    assert r.calls[0].arguments == {"x": 1.5, "y": "a b", "z": {"q": 1}}
    assert r.calls[0].arguments_json == '{"x":1.50,"y":"a b","z":{"q":1}}'
    assert parse_tool_calls(render("f", [("i", "5")]), None).calls[0].arguments == {"i": 5}


def test_chat_completions_tool_shape_and_no_params():
    chat_style = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    assert one("i", "5", tools=chat_style) == 5
    r = parse_tool_calls("<tool_call>\n<function=g>\n</function>\n</tool_call>", TOOLS)
    assert r.calls[0].arguments == {} and r.calls[0].arguments_json == "{}"


def test_duplicate_parameter_last_wins():
    r = parse_tool_calls(render("f", [("i", "1"), ("s", "x"), ("i", "2")]), TOOLS)
    assert r.calls[0].arguments_json == '{"i":2,"s":"x"}'


def test_embedded_markup_balanced():
    inner = render("f", [("s", "a"), ("i", "1")])
    r = parse_tool_calls(render("f", [("s", inner), ("i", "3")]), TOOLS)
    assert r.calls[0].arguments == {"s": inner, "i": 3}
    # a </parameter> that is not followed by structure is content
    tricky = "x</parameter>y\n</parameter>\n\n</function>"
    assert one("s", tricky) == tricky


def test_embedded_unclosed_opening_falls_back():
    value = "header\n<parameter=q>\nno close here"
    text = render("f", [("i", "3"), ("s", value)])
    r = parse_tool_calls(text, TOOLS)
    assert r.calls[0].arguments == {"i": 3, "s": value}
    assert stream(text, list(range(len(text)))) == r
    # Later parameters in the template's layout keep the value unterminated: fallback.
    text = render("f", [("s", value), ("i", "3")]) + render("f", [("i", "4")])
    r = parse_tool_calls(text, TOOLS)
    assert [c.arguments for c in r.calls] == [{"s": value, "i": 3}, {"i": 4}]
    assert stream(text, list(range(len(text)))) == r
    # The documented ambiguity: a parameter off that layout is swallowed.
    text = render("f", [("s", value)]).replace("</function>", "<parameter=i>3</parameter>\n"
                                                               "</function>")
    r = parse_tool_calls(text, TOOLS)
    assert r.calls[0].arguments == {"s": value + "\n</parameter>\n<parameter=i>3"}


def test_embedded_unbalanced_close_ends_value_early():
    value = "a\n</parameter>\n<parameter=i>\n5"
    r = parse_tool_calls(render("f", [("s", value)]), TOOLS)
    assert r.calls[0].arguments == {"s": "a", "i": 5}


def test_multiple_calls_and_text():
    a, b = render("f", [("i", "1")]), render("g", [("b", "true")])
    r = parse_tool_calls(f"  pre {a} mid\n{b}\n post  ", TOOLS)
    assert r.content == "pre  mid\n\n post"
    assert [c.name for c in r.calls] == ["f", "g"]


@pytest.mark.parametrize("text", [
    "<tool_call>",
    "<tool_call>\n<function=f>\n<parameter=i>\n1\n</parameter>\n</function>",  # no </tool_call>
    "<tool_call>\n<function=f>\n<parameter=i>\n1\n",  # unterminated value
    "<tool_call>\n<function=>\n</function>\n</tool_call>",  # no name
    "<tool_call>\n<function=  >\n</function>\n</tool_call>",
    "<tool_call>\n<function=f\n>\n</function>\n</tool_call>",  # newline in name
    "<tool_call>\ntext<function=f>\n</function>\n</tool_call>",  # stray text
    "<tool_call>\n<function=f>\nstray\n</function>\n</tool_call>",
    "<tool_call>\n<function=f>\n<parameter=>\n1\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=f>\n</function>\nx</tool_call>",
    "<tool_call>\n<function=f>\n<parameter=i>\n1\n</parameter>\nx</function>\n</tool_call>",
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',  # JSON (Hermes) form
])
def test_malformed_is_text(text):
    r = parse_tool_calls("before " + text + " after", TOOLS)
    assert r.calls == [] and r.content == "before " + text + " after"
    assert stream("before " + text + " after", list(range(0, 200, 3))) == r


def test_malformed_then_good_call():
    good = render("f", [("i", "1")])
    r = parse_tool_calls("<tool_call>\n<tool_call>oops " + good, TOOLS)
    assert r.content == "<tool_call>\n<tool_call>oops" and r.calls[0].arguments == {"i": 1}


def test_streaming_holds_back_and_emits_calls_when_complete():
    p = StreamingToolParser(TOOLS)
    assert p.feed("Hi <tool") == [TextDelta("Hi")]
    assert p.feed("_call>\n<function=f>\n<parameter=i>\n4") == []
    assert p.feed("2\n</parameter>\n</function>\n</tool_call") == []
    events = p.feed(">")
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta, ToolCallEnd]
    assert events[2].call.arguments == {"i": 42} and p.finish() == []
    p = StreamingToolParser(TOOLS)
    assert p.feed("a <tool") == [TextDelta("a")]
    assert p.feed("box> b") == [TextDelta(" <toolbox> b")]
    with pytest.raises(RuntimeError):
        p.finish() + p.finish()


def test_streaming_emits_call_before_finish_once_decided():
    p = StreamingToolParser(TOOLS)
    events = p.feed(render("f", [("i", "1")]) + " after")
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta, ToolCallEnd, TextDelta]


# ---- properties -------------------------------------------------------------------------------

PLAIN = st.text(st.characters(blacklist_characters="<>", blacklist_categories=("Cs",)),
                max_size=8)
NAMES = st.sampled_from(["s", "i", "path", "x_1", "ü"])
HARMLESS = st.sampled_from(["y</parameter>x", "<parameter=", "<tool_call>", "</tool_call>",
                            "<function=f>", "</function>", "</", "<", "\n", "\n\n", " ",
                            "é中🙂", "&lt;"])


def _balanced(inner):
    return st.tuples(NAMES, inner).map(lambda t: f"\n<parameter={t[0]}>\n{t[1]}\n</parameter>")


MARKUP = st.recursive(st.one_of(PLAIN, HARMLESS),
                      lambda inner: st.lists(st.one_of(inner, _balanced(inner)), max_size=4)
                      .map("".join), max_leaves=10)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**30, 10**30)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=8)
INT_LIKE = r"\s*[+-]?[0-9]+(\.0*)?\s*"


NOT_INT = PLAIN.filter(lambda s: not re.fullmatch(INT_LIKE, s))
NOT_KEYWORD = PLAIN.filter(lambda s: s.strip().lower() not in ("true", "false", "null", "none"))
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
INDENT = st.sampled_from([None, 2])


@st.composite
def typed_args(draw):
    """(expected arguments, rendered (key, text) pairs) for the schema of `f`."""
    keys = draw(st.lists(st.sampled_from(["s", "i", "n", "b", "z", "o", "a", "u", "ub", "un"]),
                         unique=True, max_size=6))
    expected, rendered = {}, []
    for k in keys:
        if k == "s":
            v = text = draw(MARKUP)
        elif k == "i":
            v = draw(st.integers(-10**40, 10**40))
            text = draw(st.sampled_from([str(v), f"{v}.0", f" {v} "]))
        elif k == "n":
            v = draw(FLOATS | st.integers(-10**25, 10**25))
            text = repr(v)
        elif k == "b":
            v = draw(st.booleans())
            text = draw(st.sampled_from([str(v), str(v).lower(), str(v).upper()]))
        elif k == "z":
            v, text = None, draw(st.sampled_from(["null", "None"]))
        elif k == "o":
            v = draw(st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=3))
            text = json.dumps(v, ensure_ascii=draw(st.booleans()), indent=draw(INDENT))
        elif k == "a":
            v = draw(st.lists(JSON_VALUES, max_size=3))
            text = json.dumps(v, ensure_ascii=draw(st.booleans()), indent=draw(INDENT))
        elif k == "u":
            v = draw(st.integers(-10**30, 10**30) | NOT_INT)
            text = str(v)
        elif k == "ub":
            v = draw(st.booleans() | st.none() | NOT_KEYWORD)
            text = "null" if v is None else str(v)
        else:
            v = draw(FLOATS | st.lists(st.integers(), max_size=3))
            text = repr(v) if isinstance(v, float) else json.dumps(v)
        expected[k] = v
        rendered.append((k, text))
    return expected, rendered


@FAST
@given(st.lists(st.tuples(st.text("abc \n.!", max_size=6), typed_args()), min_size=1, max_size=3),
       st.text(" \n", max_size=2), st.data())
def test_round_trip(parts, tail, data):
    text = "".join(noise + render("f", rendered) for noise, (_, rendered) in parts) + tail
    r = parse_tool_calls(text, TOOLS)
    assert [c.arguments for c in r.calls] == [expected for _, (expected, _) in parts]
    assert r.content == "".join(noise for noise, _ in parts).strip()
    check_invariants(text, r)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert stream(text, cuts) == r


@FAST
@given(st.lists(st.tuples(NAMES, JSON_VALUES | MARKUP), max_size=4))
def test_round_trip_unknown_function(args):
    """Best effort: JSON values rendered as JSON, strings that are not JSON rendered raw."""
    def not_json(s):
        try:
            json.loads(s)
            return False
        except ValueError:
            return True

    args = [(k, v) for k, v in args if not isinstance(v, str) or not_json(v.strip())]
    rendered = [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in args]
    r = parse_tool_calls(render("unknown", rendered), TOOLS)
    assert r.calls[0].arguments == dict(args)


FRAGMENTS = st.sampled_from([
    "<tool_call>", "</tool_call>", "<function=f>", "<function=g>", "<function=", "</function>",
    "<parameter=i>", "<parameter=s>", "<parameter=o>", "<parameter=", "</parameter>", "\n", " ",
    "42", "{\"a\": 1}", "<", ">", "=", "<tool_", "</param", "x", "é🙂", "True",
])
FUZZ_TEXT = st.lists(FRAGMENTS | PLAIN | typed_args().map(lambda t: render("f", t[1])),
                     max_size=25).map("".join)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FUZZ_TEXT, st.data())
def test_fuzz_streaming_equals_batch(text, data):
    r = parse_tool_calls(text, TOOLS)
    check_invariants(text, r)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    assert stream(text, cuts) == r
    assert stream(text, list(range(len(text)))) == r


@FAST
@given(st.text(max_size=200), st.data())
def test_fuzz_arbitrary_text(text, data):
    r = parse_tool_calls(text, None)
    check_invariants(text, r)
    assert stream(text, data.draw(st.lists(st.integers(0, len(text)), max_size=10)), None) == r
