r"""Parser for the Qwen XML tool-call form, in one batch and one streaming flavour.

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
   `\n<parameter=NAME>\n` (the form the template writes) opens a nested level, and only a
   line-start `\n</parameter>` closes it; while a level is open no `</parameter>` can end the
   value. So a file being written that itself holds rendered tool calls round-trips. If
   balancing leaves the value unterminated at the end of the output (an embedded opening that is
   never closed), the call is parsed once more without balancing. Text that defeats both is
   inherently ambiguous and gets the balanced reading: an embedded `</parameter>` followed by
   structure with no embedded opening before it ends the value early; an embedded opening never
   closed makes the value swallow later parameters written off the template's line layout
   (`<parameter=k>v</parameter>`). Later parameters in that layout re-open a level each, so
   the value stays unterminated and the fallback reads it right; in streaming, such a call is
   only decided at `finish()`.
2. Malformed calls stay text. A `<tool_call>` that does not start a complete call by the rule above
   (unterminated, no function name, stray text between tags, an object/array parameter whose value
   is not JSON and whose schema does not allow a string) is kept as literal text; scanning resumes
   right after that `<tool_call>`, so a later well-formed call is still found. No exception, no
   lost character.
3. Content is the text outside calls, concatenated, with leading and trailing whitespace removed.
4. Parameter values are converted to JSON by the tool's schema (engine/text/toolargs.py: union
   precedence null, boolean, integer, number, object, array, string; exact numbers; duplicate
   parameters: the last wins). `json.loads(call.arguments_json) == call.arguments`.

Streaming holds back text that may still become a call (a partial `<tool_call>`, or a call not
yet decided) and trailing whitespace, and emits a call only once it is complete: until its
`</tool_call>` it may still turn out malformed and have to come back as text. For any split of
the input, the events add up to exactly the batch result.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.text.toolargs import encode_arguments

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_FUNC_OPEN = "<function="
_FUNC_CLOSE = "</function>"
_PARAM_OPEN = "<parameter="
_PARAM_CLOSE = "</parameter>"

_WS = re.compile(r"\s*")
_NAME = re.compile(r"([^<>\n]*)(>?)")
_NESTED_OPEN = re.compile(r"\n<parameter=[^<>\n]+>(?=\n)")


def index_tools(tools: list[dict] | None) -> dict[str, dict]:
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
    pieces, _ = _scan(text, index_tools(tools), final=True)
    content = "".join(p for p in pieces if isinstance(p, str)).strip()
    return ParseResult(content, [p for p in pieces if isinstance(p, ToolCall)])


class StreamingToolParser:
    """Incremental form of `parse_tool_calls`: feed deltas, then call `finish()` once."""

    def __init__(self, tools: list[dict] | None, calls: bool = True):
        """calls=False: every character is text, `<tool_call>` markup included (a request
        that offered no tools gets no calls back, only what the model wrote)."""
        self._schemas = index_tools(tools)
        self._find_calls = calls
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
        if self._find_calls:
            pieces, self._buf = _scan(self._buf, self._schemas, final)
        else:
            pieces, self._buf = [self._buf], ""
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
        encoded = encode_arguments(params, schemas.get(name))
        if encoded is None:
            return None
        return ToolCall(name, encoded[0], encoded[1], text[pos:end]), end


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
