"""The wire format of `POST /v1/chat/completions` (the route: server/routes/chat.py): the
stateless chat API, for generic OpenAI clients. Request parsing and a completion's message,
finish reason and usage.

Nothing is stored: every request carries its whole conversation. The engine still reuses the
principal's cached states (the shared system prefix, or an earlier turn's state when the client
resends the conversation it had), so a client that appends to its transcript computes only the
new tokens. One choice per request (`n` = 1). Tool calls come back as `tool_calls` in the
chat-completions shape, thinking as `reasoning_content` (the field the Qwen ecosystem uses).
"""
from __future__ import annotations

import json

from server.errors import invalid
from server.input_items import content_text
from server.request_model import (EFFORTS, Reasoning, ResponseRequest, common_fields,
                                   parallel_calls, parse_sampling, parse_seed, parse_text_format,
                                   parse_tool_choice, parse_tools)

_KNOWN = {"model", "messages", "stream", "stream_options", "max_tokens",
          "max_completion_tokens", "temperature", "top_p", "n", "tools", "tool_choice",
          "response_format", "reasoning_effort", "seed", "user", "metadata", "store",
          "parallel_tool_calls", "prompt_cache_key", "service_tier", "stop", "logprobs",
          "top_logprobs", "frequency_penalty", "presence_penalty"}
# tuples, not sets: `x in` them is a plain test for any JSON value (a list too)
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("'messages' must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(msgs):
        w = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise invalid(f"'{w}.role' must be one of {sorted(_ROLES)}", param=f"{w}.role")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": content_text(m.get("content"), w)}
        if role == "assistant":
            if isinstance(m.get("reasoning_content"), str):
                msg["reasoning_content"] = m["reasoning_content"]
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise invalid(f"'{w}.tool_calls' must be an array", param=f"{w}.tool_calls")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                        not isinstance(fn.get("arguments", ""), str):
                    raise invalid(f"'{w}.tool_calls[{j}]' must be a function call with a name "
                                  "and JSON string arguments", param=f"{w}.tool_calls[{j}]")
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise invalid(f"'{w}.tool_calls[{j}].function.arguments' must be a JSON "
                                  "object string", param=f"{w}.tool_calls[{j}].function")
            if calls:
                msg["tool_calls"] = calls
        out.append(msg)
    return out


# Accepted only at their neutral value: anything else would be silently wrong.
_NEUTRAL = {"stop": (None, [], ""), "logprobs": (None, False), "top_logprobs": (None, 0),
            "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
            "n": (None, 1)}


def parse_chat_request(body, defaults: dict | None = None) -> ResponseRequest:
    model, stream = common_fields(body, _KNOWN)
    for name, neutral in _NEUTRAL.items():
        if name in body and not any(body[name] == x and type(body[name]) is type(x)
                                    for x in neutral):
            raise invalid(f"'{name}' is not supported by this server (only its default)",
                          param=name, code="unsupported_parameter")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or not isinstance(
            so.get("include_usage", False), bool)):
        raise invalid("'stream_options' must be an object whose include_usage is a boolean",
                      param="stream_options")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        raise invalid("'max_completion_tokens' must be a positive integer",
                      param="max_completion_tokens")
    # Chat tools are {"type": "function", "function": {...}}: flatten to the Responses shape.
    tools_body = body.get("tools")
    if isinstance(tools_body, list):
        tools_body = [dict(t.get("function") or {}, type=t.get("type"))
                      if isinstance(t, dict) and isinstance(t.get("function"), dict) else t
                      for t in tools_body]
    tools = parse_tools({"tools": tools_body})
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and isinstance(tc.get("function"), dict):
        tc = {"type": "function", "name": tc["function"].get("name")}
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and isinstance(
            rf.get("json_schema"), dict):
        rf = {"type": "json_schema", **rf["json_schema"]}
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"'reasoning_effort' must be one of {list(EFFORTS)}",
                      param="reasoning_effort")
    seed = parse_seed(body)
    return ResponseRequest(
        model=model, messages=tuple(_messages(body)), stream=stream, max_output_tokens=mt,
        **parse_sampling(body, defaults), store=False,
        previous_response_id=None, prompt_cache_key=None, tools=tools,
        tool_choice=parse_tool_choice({"tool_choice": tc}, tools),
        text_format=parse_text_format({"text": {"format": rf}} if rf is not None else {}),
        reasoning=Reasoning(effort=effort), seed=seed,
        parallel_tool_calls=parallel_calls(body))


def _tool_calls(items: list[dict]) -> list[dict]:
    return [{"index": k, "id": it["call_id"], "type": "function",
             "function": {"name": it["name"], "arguments": it["arguments"]}}
            for k, it in enumerate(x for x in items if x["type"] == "function_call")]


def completion_message(state) -> dict:
    """The assistant message of a finished completion: its text, thinking and tool calls."""
    message = {"role": "assistant", "content": state.text or None}
    reasoning = "".join(i["content"][0]["text"] for i in state.items
                        if i["type"] == "reasoning" and i["content"])
    if reasoning:
        message["reasoning_content"] = reasoning
    calls = _tool_calls(state.items)
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return message


def finish_reason(state) -> str:
    if state.status == "completed":
        return "tool_calls" if any(i["type"] == "function_call" for i in state.items) \
            else "stop"
    return "length"


def completion_usage(state) -> dict:
    return {"prompt_tokens": state.input_tokens, "completion_tokens": state.output_tokens,
            "total_tokens": state.input_tokens + state.output_tokens,
            "prompt_tokens_details": {"cached_tokens": state.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": state.reasoning_tokens}}
