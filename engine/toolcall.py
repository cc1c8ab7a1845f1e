"""Parser for the Qwen XML tool-call form, in one batch and one streaming flavour.

The Qwen3.5 chat template renders a call as

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

with string values raw and other values as JSON (booleans may come out as Jinja's `True`/`False`).

Grammar (WS is any run of whitespace, NAME is one or more characters other than `<`, `>` and
newline, stripped of surrounding spaces and non-empty):

    call  := "<tool_call>" WS "<function=" NAME ">" WS (param WS)* "</function>" WS "</tool_call>"
    param := "<parameter=" NAME ">" VALUE "</parameter>"

Rules, each tested in tests/test_toolcall.py:

1. Where a value ends. A `</parameter>` closes the value only if what follows it is structure:
   WS then `<parameter=NAME>`, or WS `</function>` WS `</tool_call>`. Any other `</parameter>` is
   part of the value. Embedded markup is balanced first: inside a value, a line-start opening
   `\\n<parameter=NAME>\\n` (the form the template writes) opens a nested level, and only a
   line-start `\\n</parameter>` closes it; while a level is open no `</parameter>` can end the
   value. So a file being written that itself holds rendered tool calls round-trips. If
   balancing leaves the value unterminated at the end of the output (an embedded opening that is
   never closed), the call is parsed once more without balancing. Text that defeats both is
   inherently ambiguous and gets the balanced reading: an embedded `</parameter>` followed by
   structure with no embedded opening before it ends the value early; an embedded opening never
   closed makes the value swallow later parameters written off the template's line layout
   (`<parameter=k>v</parameter>`). Later parameters in that layout re-open a level each, so
   the value stays unterminated and the fallback reads it right. An unclosed embedded opening also delays a call in streaming until `finish()`.
2. Malformed calls stay text. A `<tool_call>` that does not start a complete call by the rule above
   (unterminated, no function name, stray text between tags, an object/array parameter whose value
   is not JSON and whose schema does not allow a string) is kept as literal text; scanning resumes
   right after that `<tool_call>`, so a later well-formed call is still found. No exception, no
   lost character.
3. Content is the text outside calls, concatenated, with leading and trailing whitespace removed.
4. Values are converted by the tool's JSON schema for that parameter (`properties[KEY]`):
   - the allowed types come from `type` (a string or a list), `anyOf`/`oneOf` (union), `allOf`
     (intersection), or the JSON types of `enum`/`const`;
   - they are tried in the order null, boolean, integer, number, object, array, string: the most
     constrained lexical forms first, string last because it accepts anything;
   - null: `null`/`none`; boolean: `true`/`false`; both case-insensitive, surrounding whitespace
     ignored (as for every non-string type);
   - integer: `[+-]?digits` optionally followed by `.` and zeros (`3.0` -> 3), exact at any size
     up to Python's 4300-digit int limit;
   - number: a decimal lexeme; integral forms become JSON integers (`10` -> 10), others keep their
     exact digits in `arguments_json` (`1.50` -> `1.5`, `0.1000000000000000000001` unchanged);
     `.arguments` holds what a JSON reader sees (float);
   - object/array: JSON; numbers inside keep their lexemes;
   - string: the raw text with exactly one leading and one trailing newline removed;
   - no allowed type fits: malformed if object or array was allowed (the output is garbled),
     otherwise best effort, so the client's validator can report the slip to the model;
   - best effort (unknown parameter, unknown function, schema without types): JSON if the
     value parses, else the string.
5. Duplicate parameters: the last value wins, at the position of the first, as for duplicate keys
   in a JSON object.
6. `arguments_json` is compact JSON (`ensure_ascii=False`, separators `,` and `:`), and
   `json.loads(call.arguments_json) == call.arguments`.

Streaming holds back text that may still become a call (a partial `<tool_call>`, or a call not
yet decided) and trailing whitespace, and emits a call only once it is complete: until its
`</tool_call>` it may still turn out malformed and have to come back as text. For any split of
the input, the events add up to exactly the batch result.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_FUNC_OPEN = "<function="
_FUNC_CLOSE = "</function>"
_PARAM_OPEN = "<parameter="
_PARAM_CLOSE = "</parameter>"

_WS = re.compile(r"\s*")
_NAME = re.compile(r"([^<>\n]*)(>?)")
_NESTED_OPEN = re.compile(r"\n<parameter=[^<>\n]+>(?=\n)")
_INTEGER = re.compile(r"[+-]?[0-9]+(?:\.0*)?")
_NUMBER = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?(?:[eE]([+-]?[0-9]+))?")
_PRECEDENCE = ("null", "boolean", "integer", "number", "object", "array", "string")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    arguments_json: str
    raw: str  # the exact model text of the call, `<tool_call>` to `</tool_call>`


@dataclass(frozen=True)
class ParseResult:
    content: str
    calls: list[ToolCall]


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    fragment: str  # the fragments of one call concatenate to its arguments_json


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    call: ToolCall


Event = TextDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


def parse_tool_calls(text: str, tools: list[dict] | None) -> ParseResult:
    """Split one finished assistant message into content and tool calls."""
    pieces, _ = _scan(text, _index_tools(tools), final=True)
    content = "".join(p for p in pieces if isinstance(p, str)).strip()
    return ParseResult(content, [p for p in pieces if isinstance(p, ToolCall)])


class StreamingToolParser:
    """Incremental form of `parse_tool_calls`: feed deltas, then call `finish()` once."""

    def __init__(self, tools: list[dict] | None):
        self._schemas = _index_tools(tools)
        self._buf = ""
        self._started = False  # a non-whitespace character of content has been emitted
        self._pending_ws = ""  # trailing whitespace, emitted only if more content follows
        self._calls = 0
        self._finished = False

    def feed(self, delta: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Event]:
        pieces, self._buf = _scan(self._buf, self._schemas, final)
        events: list[Event] = []
        for p in pieces:
            if isinstance(p, str):
                events.extend(self._text(p))
            else:
                i, self._calls = self._calls, self._calls + 1
                events += [ToolCallStart(i, p.name), ToolCallArgsDelta(i, p.arguments_json),
                           ToolCallEnd(i, p)]
        return events

    def _text(self, text: str) -> list[Event]:
        # Emits exactly what `.strip()` of the whole content keeps.
        if not self._started:
            text = text.lstrip()
            if not text:
                return []
            self._started = True
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        return [TextDelta(body)] if body else []


# ---- scanning -------------------------------------------------------------------------------

class _Signal:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


_MORE = _Signal("MORE")  # the text ends before the answer is known
_UNTERMINATED = _Signal("UNTERMINATED")  # at the end of the output, a value never closed


def _scan(buf: str, schemas: dict, final: bool) -> tuple[list, str]:
    """Cut `buf` into text pieces and ToolCalls; returns (pieces, the undecided rest).

    Each decision looks only at the text from the current position on, so scanning a prefix and
    then the held rest gives the same pieces as scanning the whole at once."""
    pieces: list = []
    pos = 0
    while True:
        q = buf.find(TOOL_CALL_OPEN, pos)
        if q < 0:
            hold = 0 if final else _partial_suffix(buf, pos, TOOL_CALL_OPEN)
            pieces.append(buf[pos:len(buf) - hold])
            return [p for p in pieces if p != ""], buf[len(buf) - hold:]
        pieces.append(buf[pos:q])
        found = _parse_call(buf, q, schemas, final, nested=True)
        if found is _UNTERMINATED:
            found = _parse_call(buf, q, schemas, final, nested=False)
        if found is _MORE:
            return [p for p in pieces if p != ""], buf[q:]
        if isinstance(found, tuple):
            pieces.append(found[0])
            pos = found[1]
        else:  # malformed: the opening tag is text, look again just after it
            pieces.append(TOOL_CALL_OPEN)
            pos = q + len(TOOL_CALL_OPEN)


def _partial_suffix(buf: str, pos: int, lit: str) -> int:
    for n in range(min(len(lit) - 1, len(buf) - pos), 0, -1):
        if buf.endswith(lit[:n]):
            return n
    return 0


def _match(text: str, i: int, lit: str):
    """True if `lit` is at i, _MORE if the text ends inside a prefix of it, else False."""
    if text.startswith(lit, i):
        return True
    return _MORE if len(text) - i < len(lit) and lit.startswith(text[i:]) else False


def _read_name(text: str, i: int):
    """NAME> at i -> (name, index after '>'), (_MORE, i) or (None, i)."""
    m = _NAME.match(text, i)
    if m.group(2):
        name = m.group(1).strip()
        return (name or None), m.end()
    return (_MORE if m.end() == len(text) else None), i


def _parse_call(text: str, pos: int, schemas: dict, final: bool, nested: bool):
    """The call whose `<tool_call>` is at pos -> (ToolCall, end), None, _MORE or _UNTERMINATED."""
    def fail(m):  # m: False or _MORE, from a tag that did not match
        return _MORE if m is _MORE and not final else None

    i = _WS.match(text, pos + len(TOOL_CALL_OPEN)).end()
    if (m := _match(text, i, _FUNC_OPEN)) is not True:
        return fail(m)
    name, i = _read_name(text, i + len(_FUNC_OPEN))
    if not isinstance(name, str):
        return fail(name)
    params = []
    while True:
        i = _WS.match(text, i).end()
        m = _match(text, i, _PARAM_OPEN)
        if m is True:
            key, i = _read_name(text, i + len(_PARAM_OPEN))
            if not isinstance(key, str):
                return fail(key)
            close = _value_end(text, i, final, nested)
            if not isinstance(close, int):
                return close
            params.append((key, text[i:close]))
            i = close + len(_PARAM_CLOSE)
            continue
        if m is _MORE:
            return fail(m)
        if (m := _match(text, i, _FUNC_CLOSE)) is not True:
            return fail(m)
        i = _WS.match(text, i + len(_FUNC_CLOSE)).end()
        if (m := _match(text, i, TOOL_CALL_CLOSE)) is not True:
            return fail(m)
        end = i + len(TOOL_CALL_CLOSE)
        call = _build_call(name, params, schemas.get(name), text[pos:end])
        return None if call is None else (call, end)


def _value_end(text: str, start: int, final: bool, nested: bool):
    """Index of the `</parameter>` closing the value at start (rule 1), or _MORE/_UNTERMINATED."""
    depth = 0
    seg = start
    while True:
        k = text.find(_PARAM_CLOSE, seg)
        if k < 0:
            return _UNTERMINATED if final else _MORE
        if nested:
            # An opening's newline is never before seg: seg follows a '>' (tag end).
            depth += sum(1 for _ in _NESTED_OPEN.finditer(text, seg, k))
        seg = k + len(_PARAM_CLOSE)
        if depth > 0:
            if k > start and text[k - 1] == "\n":  # a line-start close ends one nested level
                depth -= 1
            continue
        follows = _structure_follows(text, seg)
        if follows is True:
            return k
        if follows is _MORE and not final:
            return _MORE


def _structure_follows(text: str, i: int):
    i = _WS.match(text, i).end()
    m = _match(text, i, _PARAM_OPEN)
    if m is True:
        name, _ = _read_name(text, i + len(_PARAM_OPEN))
        return name if name is _MORE else name is not None
    if m is _MORE:
        return _MORE
    if (m := _match(text, i, _FUNC_CLOSE)) is not True:
        return m
    return _match(text, _WS.match(text, i + len(_FUNC_CLOSE)).end(), TOOL_CALL_CLOSE)


# ---- values ---------------------------------------------------------------------------------

def _index_tools(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> its parameters schema; accepts Responses and chat-completions shapes."""
    out: dict[str, dict] = {}
    for tool in tools or ():
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            continue
        fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
        if isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def _build_call(name: str, params: list, schema: dict | None, raw: str) -> ToolCall | None:
    props = schema.get("properties") if schema else None
    props = props if isinstance(props, dict) else {}
    values: dict[str, str] = {}
    for key, value in params:
        encoded = _convert(value, props.get(key))
        if encoded is None:
            return None
        values[key] = encoded  # duplicates: last wins (rule 5)
    arguments_json = "{" + ",".join(_dumps(k) + ":" + v for k, v in values.items()) + "}"
    try:
        arguments = json.loads(arguments_json)
    except (ValueError, RecursionError):
        return None
    return ToolCall(name, arguments, arguments_json, raw)


def _convert(value: str, schema) -> str | None:
    """Raw parameter text -> JSON text by rule 4; None when the call is malformed."""
    types = _allowed_types(schema)
    if not types:
        return _best_effort(value)
    lexeme = value.strip()
    for t in _PRECEDENCE:
        if t in types:
            encoded = _CONVERTERS[t](value, lexeme)
            if encoded is not None:
                return encoded
    return None if types & {"object", "array"} else _best_effort(value)


def _allowed_types(schema) -> set[str] | None:
    if not isinstance(schema, dict):
        return None
    types = _declared_types(schema)
    if types is not None and schema.get("nullable") is True:  # OpenAPI-style
        types.add("null")
    return types


def _declared_types(schema: dict) -> set[str] | None:
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            members = [_allowed_types(s) for s in schema[key]]
            return None if None in members else set().union(*members)
    if isinstance(schema.get("allOf"), list):
        members = [m for m in map(_allowed_types, schema["allOf"]) if m is not None]
        return set.intersection(*members) if members else None
    if isinstance(schema.get("enum"), list):
        return {_json_type(v) for v in schema["enum"]}
    if "const" in schema:
        return {_json_type(schema["const"])}
    return None


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    return {float: "number", str: "string", dict: "object"}.get(type(v), "array")


def _as_string(value: str, lexeme: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return _dumps(value)


def _as_null(value: str, lexeme: str) -> str | None:
    return "null" if lexeme.lower() in ("null", "none") else None


def _as_boolean(value: str, lexeme: str) -> str | None:
    low = lexeme.lower()
    return low if low in ("true", "false") else None


def _as_integer(value: str, lexeme: str) -> str | None:
    if not _INTEGER.fullmatch(lexeme):
        return None
    try:
        return str(int(lexeme.partition(".")[0]))
    except ValueError:  # beyond Python's int string-conversion limit
        return None


def _as_number(value: str, lexeme: str) -> str | None:
    m = _NUMBER.fullmatch(lexeme)
    if not m or not (m.group(2) or m.group(3)):
        return None
    sign, whole, frac, exp = m.groups()
    if frac is None and exp is None:
        return _as_integer(value, lexeme)
    out = ("-" if sign == "-" else "") + (whole.lstrip("0") or "0")
    if frac is not None:
        out += "." + (frac.rstrip("0") or "0")
    return out + ("e" + exp if exp is not None else "")


def _as_object(value: str, lexeme: str) -> str | None:
    return _json_of_kind(lexeme, dict)


def _as_array(value: str, lexeme: str) -> str | None:
    return _json_of_kind(lexeme, list)


_CONVERTERS = {"null": _as_null, "boolean": _as_boolean, "integer": _as_integer,
               "number": _as_number, "object": _as_object, "array": _as_array,
               "string": _as_string}


def _best_effort(value: str) -> str:
    return _json_of_kind(value.strip(), object) or _as_string(value, "")


class _RawNumber:
    """A JSON number kept as its lexeme, so no digit is lost to float rounding."""
    __slots__ = ("lexeme",)

    def __init__(self, lexeme: str):
        self.lexeme = lexeme


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _json_of_kind(text: str, kind: type) -> str | None:
    try:
        v = json.loads(text, parse_float=_RawNumber, parse_constant=_reject_constant)
        return _dump(v) if isinstance(v, kind) else None
    except (ValueError, RecursionError):
        return None


def _dump(v) -> str:
    if isinstance(v, _RawNumber):
        return v.lexeme
    if isinstance(v, dict):
        return "{" + ",".join(_dumps(k) + ":" + _dump(x) for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_dump(x) for x in v) + "]"
    return _dumps(v)


def _dumps(v) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
