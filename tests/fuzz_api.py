"""Property-based fuzzing of the server's HTTP API from its OpenAPI document (docs/openapi.yaml).

Cases are hypothesis strategies in classes:
- `valid`: a request body drawn from the route's request schema, with the few values the schema
  cannot say pinned (the served model, a small output budget, a tool_choice naming a sent tool,
  a `previous_response_id` of a response this run stored); expected to succeed.
- `schema`: drawn from the request schema alone (any model name, any id): mostly refused.
- `mutated`: a valid body with one thing broken (a required field gone, a value of another
  type, an unknown field, a lone surrogate, a 100-bit integer, NaN, deep nesting, a long
  string).
- `raw`: bodies that are not a JSON object (bytes, truncated JSON, scalars, wrong content type).
- `paths`: the routes with path and query parameters from their schemas and beside them
  (unknown ids, odd session keys, limits out of range), other methods and unknown paths.
- `auth`: a missing or wrong key.

`check` holds each answer to the properties: never a 5xx, every error in the OpenAI format (the
document's `Error` schema), a stream that ends with its terminal event.
"""
from __future__ import annotations

import json
import math
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import yaml
from hypothesis import strategies as st

DOC = yaml.safe_load((Path(__file__).resolve().parent.parent / "docs" / "openapi.yaml")
                     .read_text())
SCHEMAS = DOC["components"]["schemas"]
ERROR_SCHEMA = {**SCHEMAS["Error"], "components": DOC["components"]}
PREV = "$PREV"  # replaced when sent by an id this run stored (`Fuzzer.stored`)

# Small values: a case must run in milliseconds on the CPU lane's tiny model.
_CHARS = st.characters(min_codepoint=32, max_codepoint=0x2FFF,
                       whitelist_categories=("L", "N", "P", "Zs"))
_TEXT = st.text(_CHARS, max_size=24)
_JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                         st.floats(allow_nan=False, allow_infinity=False), _TEXT)
ANY_JSON = st.recursive(_JSON_SCALAR, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(_TEXT, c, max_size=4)), max_leaves=12)


def _resolve(schema: dict) -> dict:
    while "$ref" in schema:
        schema = SCHEMAS[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def from_schema(schema: dict, overrides: dict | None = None, depth: int = 0):
    """A strategy for JSON values valid for `schema` (the subset the document uses), with small
    strings and arrays; `overrides` replace the strategies of an object's top-level
    properties (a value of None leaves the property out)."""
    schema = _resolve(schema)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("oneOf", "anyOf"):
        if key in schema:
            subs = [{**{k: v for k, v in schema.items() if k != key}, **_resolve(s)}
                    for s in schema[key]]
            return st.one_of([from_schema(s, None, depth + 1) for s in subs])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, overrides, depth) for k in kind])
    if kind == "object" or (kind is None and "properties" in schema):
        return _object(schema, overrides or {}, depth)
    if kind == "array":
        lo = schema.get("minItems", 0)
        hi = min(schema.get("maxItems", 3), lo + 3, 3 if depth < 3 else lo)
        return st.lists(from_schema(schema.get("items", {}), None, depth + 1),
                        min_size=lo, max_size=max(lo, hi))
    if kind == "string":
        return st.text(_CHARS, min_size=schema.get("minLength", 0),
                       max_size=min(schema.get("maxLength", 24), 24))
    if kind == "integer":
        return st.integers(schema.get("minimum", -2**31), schema.get("maximum", 2**31))
    if kind == "number":
        return st.floats(schema.get("minimum", -1e6), schema.get("maximum", 1e6),
                         allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY_JSON if depth < 3 else _JSON_SCALAR


def _object(schema: dict, overrides: dict, depth: int):
    props = schema.get("properties", {})
    required = set(schema.get("required", ()))
    fixed, optional = {}, {}
    for name, sub in props.items():
        if name in overrides:
            if overrides[name] is not None:
                (fixed if name in required else optional)[name] = overrides[name]
            continue
        s = from_schema(sub, None, depth + 1)
        (fixed if name in required else optional)[name] = s
    for name, s in overrides.items():  # overrides for properties the schema does not list
        if s is not None and name not in props:
            optional[name] = s
    return st.fixed_dictionaries(fixed, optional=optional)


# ---- valid requests: the schema, with what it cannot say pinned ------------------------------
_NAME = st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True)
_PARAMS = st.sampled_from([
    {"type": "object", "properties": {}},
    {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    {"type": "object", "properties": {"n": {"type": "integer"}, "flag": {"type": "boolean"}}}])
_TOOL = st.fixed_dictionaries({"type": st.just("function"), "name": _NAME},
                              optional={"description": _TEXT, "parameters": _PARAMS})
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]),  # a system turn only comes first
     "content": st.one_of(_TEXT, st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["input_text", "output_text", "text"]), "text": _TEXT}),
         min_size=1, max_size=2))},
    optional={"type": st.just("message")})
_USER = st.fixed_dictionaries({"role": st.just("user"), "content": _TEXT.filter(bool)})
_FORMAT = st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}),
                    st.just({"type": "json_schema", "name": "answer", "schema": {
                        "type": "object", "properties": {"a": {"type": "integer"}}}}))


@st.composite
def valid_response_body(draw, route: str = "/v1/responses"):
    tools = draw(st.lists(_TOOL, max_size=2, unique_by=lambda t: t["name"]))
    choices = ["auto", "none"] + (["required", {"type": "function", "name": tools[0]["name"]}]
                                  if tools else [])
    body = draw(from_schema(SCHEMAS["CreateResponse"], {
        "model": st.just("tiny"),
        "input": st.one_of(_TEXT.filter(bool), st.lists(_MESSAGE, min_size=1, max_size=3)
                           .map(lambda m: m + [{"role": "user", "content": "hi"}]),
                           st.lists(_USER, min_size=1, max_size=2)),
        "max_output_tokens": st.integers(1, 4),
        "previous_response_id": st.just(PREV) if route == "/v1/responses" else None,
        "tools": st.just(tools), "tool_choice": st.sampled_from(choices),
        "text": st.fixed_dictionaries({"format": _FORMAT}),
        "seed": st.integers(0, 2**31 - 1), "instructions": _TEXT,
        "metadata": st.dictionaries(_NAME, _TEXT, max_size=2),
        "prompt_cache_key": st.sampled_from(["fuzz-a", "fuzz-b", "fuzz-c"]),
        "reasoning": st.just({"effort": "none"}) | st.just({})}))
    body["max_output_tokens"] = draw(st.integers(1, 4))  # optional in the schema: always here
    if not body.get("tools") and body.get("tool_choice") not in (None, "auto", "none"):
        body["tool_choice"] = "auto"  # the tools were left out, their choice was not
    if route != "/v1/responses":
        body.pop("stream", None)
    return body


@st.composite
def valid_chat_body(draw):
    body = draw(from_schema(SCHEMAS["CreateChatCompletion"], {
        "model": st.just("tiny"),
        "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                    "content": _TEXT.filter(bool)}),
                             min_size=1, max_size=2),
        "max_tokens": st.integers(1, 4), "max_completion_tokens": None,
        "seed": st.integers(0, 2**31 - 1), "tools": None, "tool_choice": None,
        "response_format": st.just({"type": "text"}) | st.just({"type": "json_object"}),
        "stream_options": st.just({"include_usage": True}) | st.just({})}))
    body["max_tokens"] = draw(st.integers(1, 4))
    return body


# ---- mutations -------------------------------------------------------------------------------
_WEIRD = st.sampled_from([None, True, 0, -1, 2**100, 1.5, "", "x" * 5000, [], {}, [{}],
                          {"": None}, "\ud800", ["\udfff"], {"\ud83d": 1}, -2**63])


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def _set(value, path, new):
    if not path:
        return new
    value = json.loads(json.dumps(value))
    cur = value
    for p in path[:-1]:
        cur = cur[p]
    if new is _DELETE:
        del cur[path[-1]]
    else:
        cur[path[-1]] = new
    return value


_DELETE = object()
_BUDGETS = ("max_output_tokens", "max_tokens")


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


@st.composite
def mutate(draw, body_strategy):
    """(kind, JSON text) of a valid body with one thing broken."""
    body = draw(body_strategy)
    kind = draw(st.sampled_from(["drop", "retype", "unknown", "weird", "nan", "deep",
                                 "long", "null_all"]))
    # the output budget stays: a body without it is valid and runs to the lane's default
    paths = [p for p in _paths(body) if p and p[0] not in _BUDGETS]
    if kind == "drop" and paths:
        return kind, json.dumps(_set(body, draw(st.sampled_from(paths)), _DELETE))
    if kind in ("retype", "weird") and paths:
        new = draw(ANY_JSON if kind == "retype" else _WEIRD)
        return kind, json.dumps(_set(body, draw(st.sampled_from(paths)), new))
    if kind == "unknown":
        return kind, json.dumps({**body, draw(_NAME) + "_x": draw(ANY_JSON)})
    if kind == "nan":
        key = draw(st.sampled_from(["temperature", "top_p", "max_output_tokens", "seed"]))
        return kind, json.dumps({**body, key: draw(st.sampled_from([math.nan, math.inf]))})
    if kind == "deep":
        key = draw(st.sampled_from(sorted(set(body) - set(_BUDGETS))))
        depth = draw(st.sampled_from([50, 900, 1100, 5000]))
        text = json.dumps({k: v for k, v in body.items() if k != key})
        return kind, text[:-1] + (", " if len(body) > 1 else "") + \
            f'"{key}": {_nest(depth)}}}'
    if kind == "long" and paths:
        return kind, json.dumps(_set(body, draw(st.sampled_from(paths)), "y" * 300_000))
    return "null_all", json.dumps({k: body[k] if k in _BUDGETS else None for k in body})


_RAW = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b'{"model": "tiny", "input": "hi"', b"[]", b"null", b"1",
                     b'"text"', b'{"model": "tiny", "input": "hi", "model": 1}',
                     b"\xff\xfe{}", b'{"input": "\\ud800x"}', b"{}" * 3]),
    ANY_JSON.map(lambda v: json.dumps(v).encode()))


@dataclass
class Case:
    klass: str         # valid | schema | mutated | raw | paths | auth
    method: str
    path: str          # may carry a query string
    body: bytes | None = None
    ctype: str = "application/json"
    auth: bool = True
    detail: str = ""   # the mutation or route kind


def _json_case(klass, path, value, detail=""):
    return Case(klass, "POST", path, json.dumps(value).encode(), detail=detail)


_POST_ROUTES = ["/v1/responses", "/v1/responses/input_tokens", "/v1/chat/completions"]
_ID = st.one_of(st.just(PREV), st.just("resp_" + "0" * 48), _TEXT.filter(bool),
                st.text(max_size=40).filter(bool))


def _quote(s: str) -> str:
    return urllib.parse.quote(s.encode("utf-8", "surrogatepass"), safe="")


@st.composite
def path_case(draw) -> Case:
    kind = draw(st.sampled_from(["get", "delete", "cancel", "items", "session", "status",
                                 "models", "metrics", "checkpoints", "unknown", "method"]))
    rid = _quote(draw(_ID))
    if kind in ("get", "delete"):
        return Case("paths", kind.upper(), f"/v1/responses/{rid}", detail=kind)
    if kind == "cancel":
        return Case("paths", "POST", f"/v1/responses/{rid}/cancel", detail=kind)
    if kind == "items":
        q = draw(st.dictionaries(st.sampled_from(["after", "limit", "order", "x"]), st.one_of(
            st.integers(-5, 150).map(str), st.sampled_from(["asc", "desc", "", "%", "1e3"]),
            _TEXT), max_size=3))
        return Case("paths", "GET", f"/v1/responses/{rid}/input_items?"
                    + urllib.parse.urlencode(q), detail=kind)
    if kind == "session":
        key = draw(st.one_of(st.sampled_from(["fuzz-a", "a/b", "x" * 600, "%", "*"]),
                             st.text(min_size=1, max_size=30)))
        return Case("paths", "DELETE", f"/v1/ninfer/sessions/{_quote(key)}", detail=kind)
    if kind in ("status", "models", "metrics"):
        path = {"status": "/v1/ninfer/status", "models": "/v1/models",
                "metrics": "/metrics"}[kind]
        return Case("paths", "GET", path, detail=kind)
    if kind == "checkpoints":
        body = draw(st.one_of(from_schema({"type": "object", "properties": {
            "prompt_cache_key": {"type": "string"}}}), ANY_JSON))
        return _json_case("paths", "/v1/ninfer/checkpoints", body, detail=kind)
    if kind == "unknown":
        return Case("paths", draw(st.sampled_from(["GET", "POST"])),
                    "/v1/" + _quote(draw(_TEXT)), detail=kind)
    return Case("paths", draw(st.sampled_from(["PUT", "PATCH", "GET"])),
                draw(st.sampled_from(_POST_ROUTES)), detail="method")


@st.composite
def fuzz_case(draw) -> Case:
    """One case; about half are valid requests (the rest split among the other classes)."""
    klass = draw(st.sampled_from(["valid"] * 9 + ["schema", "schema", "mutated", "mutated",
                                                  "mutated", "raw", "paths", "paths",
                                                  "auth"]))
    route = draw(st.sampled_from(["/v1/responses"] * 4 + _POST_ROUTES[1:]))
    valid = valid_chat_body() if route.endswith("completions") else valid_response_body(route)
    if klass == "valid":
        return _json_case("valid", route, draw(valid), detail=route)
    if klass == "schema":
        name = "CreateChatCompletion" if route.endswith("completions") else "CreateResponse"
        body = draw(from_schema(SCHEMAS[name]))
        body["max_tokens" if "Chat" in name else "max_output_tokens"] = draw(st.integers(1, 4))
        return _json_case("schema", route, body, detail=route)
    if klass == "mutated":
        kind, text = draw(mutate(valid))
        return Case("mutated", "POST", route, text.encode("utf-8", "surrogatepass"),
                    detail=kind)
    if klass == "raw":
        ctype = draw(st.sampled_from(["application/json", "text/plain", ""]))
        return Case("raw", "POST", route, draw(_RAW), ctype=ctype, detail=route)
    if klass == "paths":
        return draw(path_case())
    return Case("auth", "POST", route, json.dumps(draw(valid)).encode(), auth=False,
                detail=route)
