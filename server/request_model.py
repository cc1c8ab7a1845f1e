"""Validation of `POST /v1/responses` bodies into a typed request.

Every rejection is an APIError with the offending parameter named, raised before any work starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from server.errors import invalid

_ROLES = {"user", "system", "developer", "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text"}
# Accepted and ignored: they change nothing in a local, single-model deployment.
_IGNORED = {"metadata", "user", "service_tier", "truncation", "parallel_tool_calls",
            "prompt_cache_retention", "safety_identifier", "background", "text",
            "top_logprobs", "stream_options", "include", "reasoning", "tool_choice", "tools",
            "prompt_cache_key", "store"}
_KNOWN = _IGNORED | {"model", "input", "instructions", "stream", "max_output_tokens",
                     "temperature", "top_p", "previous_response_id"}


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class ResponseRequest:
    model: str
    messages: tuple[Message, ...]  # the instructions (as a system message) + the input
    stream: bool
    max_output_tokens: int | None
    temperature: float
    top_p: float
    store: bool
    previous_response_id: str | None
    prompt_cache_key: str | None
    metadata: dict = field(default_factory=dict)
    instructions: str | None = None
    input_items: tuple = ()        # the input items as sent (string input as one message)

    @property
    def input_messages(self) -> tuple[Message, ...]:
        return self.messages[1:] if self.instructions is not None else self.messages


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"'{name}' must be a number", param=name)
    if not lo <= v <= hi:
        raise invalid(f"'{name}' must be between {lo} and {hi}, got {v}", param=name)
    return float(v)


def content_text(content, where: str = "item") -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"'{where}.content' must be a string or an array of content parts",
                      param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        p = f"{where}.content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"'{p}' must be an object with a 'type'", param=p)
        if part["type"] == "input_image" or part["type"] == "input_file":
            raise invalid(f"'{p}': {part['type']} is not supported: this model takes text only",
                          param=p, code="unsupported_content")
        if part["type"] not in _TEXT_PARTS:
            raise invalid(f"'{p}': unknown content part type {part['type']!r}", param=p)
        if not isinstance(part.get("text"), str):
            raise invalid(f"'{p}.text' must be a string", param=f"{p}.text")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict) -> list[Message]:
    msgs: list[Message] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("'instructions' must be a string", param="instructions")
        msgs.append(Message("system", instructions))
    items = body.get("input")
    if isinstance(items, str):
        return msgs + [Message("user", items)]
    if not isinstance(items, list) or not items:
        raise invalid("'input' must be a non-empty string or array of input items",
                      param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{where}' must be an object", param=where)
        kind = item.get("type", "message")
        if kind != "message":
            raise invalid(f"'{where}': input item type {kind!r} is not supported yet",
                          param=f"{where}.type", code="unsupported_item")
        role = item.get("role")
        if role not in _ROLES:
            raise invalid(f"'{where}.role' must be one of {sorted(_ROLES)}",
                          param=f"{where}.role")
        msgs.append(Message("system" if role == "developer" else role,
                            content_text(item.get("content"), where)))
    return msgs


def parse_response_request(body) -> ResponseRequest:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise invalid(f"unknown parameter '{unknown[0]}'", param=unknown[0],
                      code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", param="stream")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise invalid("'store' must be a boolean", param="store")
    mot = body.get("max_output_tokens")
    if mot is not None and (isinstance(mot, bool) or not isinstance(mot, int) or mot < 1):
        raise invalid("'max_output_tokens' must be a positive integer",
                      param="max_output_tokens")
    prev = body.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise invalid("'previous_response_id' must be a string", param="previous_response_id")
    pck = body.get("prompt_cache_key")
    if pck is not None and not isinstance(pck, str):
        raise invalid("'prompt_cache_key' must be a string", param="prompt_cache_key")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise invalid("'metadata' must be an object", param="metadata")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    return ResponseRequest(
        model=model, messages=tuple(_messages(body)), stream=stream, max_output_tokens=mot,
        instructions=body.get("instructions"), input_items=tuple(items),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        store=store, previous_response_id=prev, prompt_cache_key=pck, metadata=metadata)
