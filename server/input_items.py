"""Input items and content parts into chat-template messages (`items_to_messages`), for the
Responses API's `input` and a stored conversation's history:
- `message` (user, system, developer, assistant) -> a turn of that role (developer = system);
- `reasoning` -> the thinking of the assistant turn it precedes;
- `function_call` -> a tool call of the current assistant turn (consecutive reasoning, assistant
  messages and function calls form one assistant turn, as the model wrote them);
- `function_call_output` (string or content-array output) -> a `tool` turn.
`input_image` / `input_file` parts get a 400 `unsupported_content`: the model reads text only.
"""
from __future__ import annotations

import json

from server.errors import invalid

# tuples, not sets: `x in` them is a plain test for any JSON value (a list too)
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
MAX_ITEM_CHARS = 4 * 1024 * 1024


def content_text(content, where: str = "item") -> str:
    """The text of a content field: a string, or an array of text parts (concatenated)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise invalid(f"'{where}.content' must be a string or an array of content parts",
                      param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        p = f"{where}.content[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"'{p}' must be an object with a 'type'", param=p)
        if part["type"] in ("input_image", "input_file", "input_audio"):
            raise invalid(f"'{p}': {part['type']} is not supported: this model reads text only",
                          param=p, code="unsupported_content")
        if part["type"] == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if part["type"] not in _TEXT_PARTS:
            raise invalid(f"'{p}': unknown content part type {part['type']!r}", param=p)
        if not isinstance(part.get("text"), str):
            raise invalid(f"'{p}.text' must be a string", param=f"{p}.text")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, where: str, *, allow_empty: bool = False) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (not v and not allow_empty):
        raise invalid(f"'{where}.{key}' must be a {'' if allow_empty else 'non-empty '}string",
                      param=f"{where}.{key}")
    return v


def reasoning_text(item: dict, where: str = "item") -> str:
    """The thinking a `reasoning` item carries: its content texts, else its summary texts."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts:
            return content_text(parts, f"{where}.{key}")
    return ""


def items_to_messages(items, where: str = "input") -> list[dict]:
    """Input items -> chat-template messages (see the module docstring). Raises APIError."""
    msgs: list[dict] = []
    pending_reasoning: str | None = None
    open_assistant = False  # the last message is an assistant turn still being assembled

    def assistant() -> dict:
        nonlocal open_assistant, pending_reasoning
        if not open_assistant:
            msgs.append({"role": "assistant", "content": ""})
            open_assistant = True
        m = msgs[-1]
        if pending_reasoning is not None:
            m["reasoning_content"] = (m.get("reasoning_content") or "") + pending_reasoning
            pending_reasoning = None
        return m

    for i, item in enumerate(items):
        w = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{w}' must be an object", param=w)
        size = len(json.dumps(item, ensure_ascii=False))
        if size > MAX_ITEM_CHARS:
            raise invalid(f"'{w}' is {size} characters; an item may have at most "
                          f"{MAX_ITEM_CHARS}", param=w, code="item_too_large")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise invalid(f"'{w}.role' must be one of {sorted(_ROLES)}", param=f"{w}.role")
            text = content_text(item.get("content"), w)
            if role == "assistant":
                m = assistant()
                if m.get("tool_calls"):  # text after a call starts the next turn's text
                    m["content"] += ("\n\n" if m["content"] else "") + text
                else:
                    m["content"] += text
            else:
                msgs.append({"role": "system" if role == "developer" else role,
                             "content": text})
                open_assistant = False
        elif kind == "reasoning":
            text = reasoning_text(item, w)
            if open_assistant and (msgs[-1]["content"] or msgs[-1].get("tool_calls")):
                open_assistant = False  # reasoning after text or calls: a new assistant turn
            pending_reasoning = (pending_reasoning or "") + text
        elif kind == "function_call":
            name = _string(item, "name", w)
            args = item.get("arguments", "")
            if not isinstance(args, str):
                raise invalid(f"'{w}.arguments' must be a JSON string", param=f"{w}.arguments")
            _string(item, "call_id", w)
            if args.strip():
                try:
                    parsed = json.loads(args)
                except ValueError:
                    raise invalid(f"'{w}.arguments' is not valid JSON",
                                  param=f"{w}.arguments") from None
                if not isinstance(parsed, dict):
                    raise invalid(f"'{w}.arguments' must encode a JSON object",
                                  param=f"{w}.arguments")
            assistant().setdefault("tool_calls", []).append(
                {"type": "function", "id": item["call_id"],
                 "function": {"name": name, "arguments": args or "{}"}})
        elif kind == "function_call_output":
            _string(item, "call_id", w)
            out = item.get("output")
            if not isinstance(out, (str, list)):
                raise invalid(f"'{w}.output' must be a string or an array of content parts",
                              param=f"{w}.output")
            msgs.append({"role": "tool", "content": content_text(out, f"{w}.output")})
            open_assistant = False
        else:
            raise invalid(f"'{w}': input item type {kind!r} is not supported",
                          param=f"{w}.type", code="unsupported_item")
    if pending_reasoning is not None:  # reasoning with no turn after it: keep it as a turn
        assistant()
    return msgs
