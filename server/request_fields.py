"""Request fields the Responses and chat-completions APIs share, validated: the JSON body and
its common checks, numbers in a range, function tools, tool_choice, the output format and
parallel_tool_calls. Every rejection is an APIError naming the offending parameter."""
from __future__ import annotations

import json

from server.errors import invalid

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_TOOLS = 256
MAX_NAME = 128


def parse_number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"'{name}' must be a number", param=name)
    if not lo <= v <= hi:
        raise invalid(f"'{name}' must be between {lo} and {hi}, got {v}", param=name)
    return float(v)


def parse_tools(body: dict) -> tuple:
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array", param="tools")
    if len(tools) > MAX_TOOLS:
        raise invalid(f"at most {MAX_TOOLS} tools are allowed", param="tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid(f"'{w}' must be an object", param=w)
        if t.get("type") != "function":
            raise invalid(f"'{w}': tool type {t.get('type')!r} is not supported; only "
                          "function tools are", param=f"{w}.type", code="unsupported_tool")
        name = t.get("name")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME or any(
                c in name for c in "<>\n"):
            raise invalid(f"'{w}.name' must be a non-empty string of at most {MAX_NAME} "
                          "characters without '<', '>' or newlines", param=f"{w}.name")
        if name in names:
            raise invalid(f"'{w}.name': duplicate tool name {name!r}", param=f"{w}.name")
        names.add(name)
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid(f"'{w}.parameters' must be a JSON schema object",
                          param=f"{w}.parameters")
        desc = t.get("description")
        if desc is not None and not isinstance(desc, str):
            raise invalid(f"'{w}.description' must be a string", param=f"{w}.description")
        out.append({k: v for k, v in t.items() if v is not None})
    return tuple(out)


def parse_tool_choice(body: dict, tools: tuple):
    tc = body.get("tool_choice", "auto")
    if tc is None:
        return "auto"
    if tc in ("auto", "none", "required"):
        if tc == "required" and not tools:
            raise invalid("'tool_choice' is 'required' but no tools were given",
                          param="tool_choice")
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function":
        name = tc.get("name")
        if not isinstance(name, str) or name not in {t["name"] for t in tools}:
            raise invalid(f"'tool_choice' names the function {name!r}, which is not among "
                          "the tools", param="tool_choice.name")
        return {"type": "function", "name": name}
    raise invalid("'tool_choice' must be 'auto', 'none', 'required' or "
                  "{\"type\": \"function\", \"name\": ...}", param="tool_choice")


def parse_text_format(body: dict) -> dict:
    text = body.get("text")
    if text is None:
        return {"type": "text"}
    if not isinstance(text, dict):
        raise invalid("'text' must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                              "json_schema"):
        raise invalid("'text.format.type' must be 'text', 'json_object' or 'json_schema'",
                      param="text.format.type")
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("'text.format.schema' must be a JSON schema object",
                          param="text.format.schema")
        name = fmt.get("name")
        if not isinstance(name, str) or not name:
            raise invalid("'text.format.name' must be a non-empty string",
                          param="text.format.name")
        strict = fmt.get("strict", False)
        if not isinstance(strict, bool) and strict is not None:
            raise invalid("'text.format.strict' must be a boolean", param="text.format.strict")
        return {"type": "json_schema", "name": name, "schema": fmt["schema"],
                "strict": bool(strict), **({"description": fmt["description"]}
                                          if isinstance(fmt.get("description"), str) else {})}
    return {"type": fmt["type"]}


MAX_DEPTH = 64  # nesting of a request body's arrays and objects


def json_body(raw: bytes | None):
    """The request body as JSON; a 400 in the API's format when it is not, when it nests
    deeper than MAX_DEPTH, or when a string holds a lone UTF-16 surrogate (JSON's "\\ud800"
    escapes decode to text no UTF-8 encoder, tokenizer or database accepts)."""
    try:
        body = json.loads(raw or b"null")
    except RecursionError:
        raise invalid(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError):
        raise invalid("the request body is not valid JSON") from None
    _check_values(body)
    return body


def _check_values(body) -> None:
    stack = [(body, 0, "")]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            _check_text(v, where)
        elif isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                raise invalid(f"the request body nests deeper than {MAX_DEPTH} levels")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                path = f"{where}.{k}" if isinstance(k, str) else f"{where}[{k}]"
                if isinstance(k, str):
                    _check_text(k, path)
                stack.append((x, depth + 1, path))


def _check_text(s: str, where: str) -> None:
    if s.isascii():  # most strings: no surrogate possible, nothing to encode
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"'{where.lstrip('.') or 'body'}' holds a lone UTF-16 surrogate, which is "
                      f"not text", param=where.lstrip(".") or None) from None


def common_fields(body, known: set) -> tuple[str, bool]:
    """Checks every create request shares: a JSON object of known fields, a model, a stream
    flag. Returns (model, stream)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(f"unknown parameter '{unknown[0]}'", param=unknown[0],
                      code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", param="stream")
    return model, stream


def parse_seed(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid("'seed' must be an integer", param="seed")
    if seed is not None and not -(2 ** 63) <= seed < 2 ** 63:
        raise invalid("'seed' must fit in 64 bits", param="seed")
    return seed


def parallel_calls(body: dict) -> bool:
    v = body.get("parallel_tool_calls", True)
    if v is None:
        return True
    if not isinstance(v, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    return v
