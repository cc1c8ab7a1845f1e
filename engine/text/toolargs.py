"""Tool-call parameter text -> JSON, driven by the tool's JSON schema.

The Qwen template writes string values raw and every other value as JSON (booleans may come out
as Jinja's `True`/`False`), so the text alone cannot say "42" from 42: the schema decides.

1. Each value is converted by the schema of its parameter (`parameters.properties[KEY]`):
   - the allowed types come from `type` (a string or a list), `anyOf`/`oneOf` (union), `allOf`
     (intersection), the JSON types of `enum`/`const`, plus null where `nullable` is true;
   - they are tried in the order null, boolean, integer, number, object, array, string: the most
     constrained lexical forms first, string last because it accepts anything;
   - null: `null`/`none`; boolean: `true`/`false`; both case-insensitive, surrounding whitespace
     ignored (as for every non-string type);
   - integer: `[+-]?digits` optionally followed by `.` and zeros (`3.0` -> 3), exact at any size
     up to Python's 4300-digit int limit;
   - number: a decimal lexeme; integral forms become JSON integers (`10` -> 10), others keep their
     exact digits in `arguments_json` (`1.50` -> `1.5`, `0.1000000000000000000001` unchanged)
     while `arguments` holds what a JSON reader sees (a float);
   - object/array: JSON; numbers inside keep their lexemes;
   - string: the raw text with exactly one leading and one trailing newline removed;
   - no allowed type fits: the call is malformed if object or array was allowed (the output is
     garbled), otherwise best effort, so the client's validator can report the slip to the model;
   - best effort (unknown parameter, unknown function, schema without types): JSON if the
     value parses, else the string.
2. Duplicate parameters: the last value wins, at the position of the first, as for duplicate keys
   in a JSON object.
3. `arguments_json` is compact JSON (`ensure_ascii=False`, separators `,` and `:`), and
   `json.loads(arguments_json) == arguments`.
"""
from __future__ import annotations

import json
import re

_INTEGER = re.compile(r"[+-]?[0-9]+(?:\.0*)?")
_NUMBER = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?(?:[eE]([+-]?[0-9]+))?")
_PRECEDENCE = ("null", "boolean", "integer", "number", "object", "array", "string")


def encode_arguments(params: list[tuple[str, str]], schema: dict | None
                     ) -> tuple[dict, str] | None:
    """[(name, raw text)] of one call -> (arguments, arguments_json), or None if malformed.

    schema: the function's `parameters` (JSON schema of an object), None for an unknown function."""
    props = schema.get("properties") if schema else None
    props = props if isinstance(props, dict) else {}
    values: dict[str, str] = {}
    for key, value in params:
        encoded = _convert(value, props.get(key))
        if encoded is None:
            return None
        values[key] = encoded  # duplicates: the last wins (rule 2)
    arguments_json = "{" + ",".join(_dumps(k) + ":" + v for k, v in values.items()) + "}"
    try:
        return json.loads(arguments_json), arguments_json
    except (ValueError, RecursionError):
        return None


def _convert(value: str, schema) -> str | None:
    """Raw parameter text -> JSON text by rule 1; None when the call is malformed."""
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
        return {json_type(v) for v in schema["enum"]}
    if "const" in schema:
        return {json_type(schema["const"])}
    return None


def json_type(v) -> str:
    """The JSON Schema type name of a decoded JSON value."""
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
