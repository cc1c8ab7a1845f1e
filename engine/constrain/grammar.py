r"""Request -> the grammar of the text after thinking (llguidance Lark), or None for free text.

Pure functions over the request's fields; nothing here touches a tokenizer.

Tool calls follow the chat template's layout exactly, which is what engine/text/toolcall.py parses:

    <tool_call>                 the special token 248058, never its spelling in plain text
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>                the special token 248059

Parameters come in the schema's declared order: each required one once, each optional one at
most once, no other key (so `required` and `additionalProperties: false` hold). A parameter
whose schema allows a string is written raw (engine/text/toolargs.py reads it as a string); raw text
never contains `</parameter>` or `<parameter=`, so the parser's first `</parameter>` is the
close. Any other parameter is JSON constrained by its own schema (`%json`), which toolargs
converts back exactly. Several calls are separated by one newline, as the template renders them.

Limits (documented in docs/constrained_decoding.md): a raw string value honours `enum`/`const`
and `minLength`/`maxLength`, not `pattern` or `format`; a JSON-valued parameter may in principle
contain the text `</parameter>` inside a JSON string.
"""
from __future__ import annotations

import json

from engine.text.toolargs import json_type

TOOL_CALL_ID = 248058
TOOL_CALL_END_ID = 248059
EXCLUDED_IN_RAW = ("</parameter>", "<parameter=")
_TYPE_WORDS = ("null", "boolean", "integer", "number", "object", "array", "string")


class ConstraintError(ValueError):
    """A request whose tools, tool_choice or text format cannot be turned into a grammar."""


def json_ref(schema: dict | None, *, strict: bool) -> str:
    """The `%json` reference of `schema` (None: any JSON object). Non-strict schemas are
    compiled leniently: keywords llguidance does not implement are ignored, not refused."""
    schema = {"type": "object"} if schema is None else dict(schema)
    if not strict:
        schema["x-guidance"] = {**schema.get("x-guidance", {}), "lenient": True}
    return "%json " + json.dumps(schema, separators=(",", ":"))


def json_grammar(ref: str) -> str:
    """Grammar of one JSON value (after optional whitespace) given its `%json` reference."""
    return "start: WS? body\n" + _WS_RULE + "body: " + ref + "\n"


def no_call_grammar() -> str:
    """Any text in which no tool call can start: no `<tool_call>` token, no such spelling."""
    return ('start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/\n')


def calls_grammar(tools: list[dict], *, parallel: bool, json_alternative: str | None = None) -> str:
    """One call (or several, one per line) of any of `tools`, optionally or one JSON value.

    tools: normalized function tools ({name, parameters, strict}); json_alternative: the `%json`
    reference of a text format that may be written instead of calls (tool_choice auto)."""
    if not tools:
        raise ConstraintError("tool_choice requires a call but no function tool is given")
    lines = ["start: WS? body", _WS_RULE.rstrip("\n"),
             "calls: call" + (' ("\\n" call)*' if parallel else ""),
             "call: " + " | ".join(f"c{i}" for i in range(len(tools))),
             'sval[suffix="\\n</parameter>\\n"]: RAW',
             "RAW: /(?s:.*)/ & ~/(?s:.*)(" + "|".join(_rx(x) for x in EXCLUDED_IN_RAW)
             + ")(?s:.*)/"]
    lines.append("body: calls" + (" | " + json_alternative if json_alternative else ""))
    for i, tool in enumerate(tools):
        lines += _call_rules(f"c{i}", tool)
    return "\n".join(lines) + "\n"


def normalize_tools(tools: list[dict] | None) -> list[dict]:
    """Responses (or chat-completions) function tools -> [{name, parameters, strict}]."""
    out = []
    for tool in tools or ():
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            continue  # built-in tools have no text form in this template
        fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip() or any(c in name for c in "<>\n"):
            raise ConstraintError(f"function tool name {name!r} cannot be written in a call")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ConstraintError(f"function {name!r}: parameters must be a JSON schema object")
        out.append({"name": name.strip(), "parameters": params or {},
                    "strict": fn.get("strict") is not False})
    return out


# ---- pieces ---------------------------------------------------------------------------------

_WS_RULE = "WS: /[ \\t\\r\\n]{1,4}/\n"  # what the model writes after </think>: "\\n\\n"


def _lit(text: str) -> str:
    return json.dumps(text)


def _rx(text: str) -> str:
    return "".join("\\" + c if c in "\\/.*+?()[]{}|^$" else c for c in text)


def _call_rules(rule: str, tool: dict) -> list[str]:
    params = tool["parameters"]
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or ())
    missing = required - set(props)
    if missing:
        raise ConstraintError(f"function {tool['name']!r}: required {sorted(missing)} are not "
                              "in properties")
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    parts, lines = [], []
    for j, (key, schema) in enumerate(props.items()):
        if any(c in key for c in "<>\n") or not key.strip():
            raise ConstraintError(f"function {tool['name']!r}: parameter name {key!r} cannot "
                                  "be written in a call")
        prule = f"{rule}_p{j}"
        lines.append(f"{prule}: {_lit(f'<parameter={key}>' + chr(10))} "
                     + _value(schema, defs, tool["strict"], f"{prule}_v", lines))
        parts.append(prule if key in required else prule + "?")
    head = _lit(f"<function={tool['name']}>\n")
    lines.insert(0, f"{rule}: <[{TOOL_CALL_ID}]> {_lit(chr(10))} {head} {' '.join(parts)} "
                    f"{_lit('</function>' + chr(10))} <[{TOOL_CALL_END_ID}]>")
    return lines


def _value(schema, defs: dict, strict: bool, rule: str, lines: list[str]) -> str:
    """The grammar of one parameter's VALUE plus its `\\n</parameter>\\n`."""
    close = _lit("\n</parameter>\n")
    if not isinstance(schema, dict):
        schema = {}
    types = _types(schema)
    if types is None or "string" in types:
        options = [v for v in _enum(schema) if isinstance(v, str)]
        if options and types == {"string"}:
            alts = " | ".join(_lit(v) for v in options)
            lines.append(f"{rule}: ({alts}) {close}")
            return rule
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        if types == {"string"} and (isinstance(lo, int) or isinstance(hi, int)):
            bounded = f"/(?s:.{{{lo or 0},{hi if isinstance(hi, int) else ''}}})/"
            lines.append(f'{rule}[suffix="\\n</parameter>\\n"]: {rule.upper()}_T')
            lines.append(f"{rule.upper()}_T: {bounded} & RAW")
            return rule
        return "sval"
    lines.append(f"{rule}: {json_ref({**schema, **defs}, strict=strict)} {close}")
    return rule


def _enum(schema: dict) -> list:
    if isinstance(schema.get("enum"), list):
        return schema["enum"]
    return [schema["const"]] if "const" in schema else []


def _types(schema: dict) -> set[str] | None:
    """The JSON types a schema allows (None: unknown, any)."""
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if x in _TYPE_WORDS}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            members = [_types(s) if isinstance(s, dict) else None for s in schema[key]]
            return None if None in members else set().union(*members)
    values = _enum(schema)
    if values:
        return {json_type(v) for v in values}
    return None
