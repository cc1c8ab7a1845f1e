"""Validation of `POST /v1/responses` bodies into a typed request (`ResponseRequest`).

Every rejection is an APIError with the offending parameter named, raised before any work starts.
The input items become chat-template messages (server/input_items.py); the fields the chat API
shares are checked by server/request_fields.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from server.errors import invalid
from server.input_items import items_to_messages
from server.request_fields import (EFFORTS, common_fields, parallel_calls, parse_number,
                                   parse_seed, parse_text_format, parse_tool_choice,
                                   parse_tools)

_SUMMARIES = (None, "auto", "concise", "detailed")
# Accepted and ignored: they change nothing in a local, single-model deployment.
_IGNORED = {"metadata", "user", "service_tier", "prompt_cache_retention", "safety_identifier",
            "stream_options", "prompt_cache_key", "store"}
_KNOWN = _IGNORED | {"truncation", "background", "top_logprobs",
                     "model", "input", "instructions", "stream", "max_output_tokens",
                     "temperature", "top_p", "previous_response_id", "tools", "tool_choice",
                     "text", "reasoning", "include", "seed", "parallel_tool_calls"}
# tuples, not sets: `x in` them is a plain test for any JSON value (a list too)
_INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs")

# Size limits (the body as a whole is capped by the HTTP layer at MAX_BODY_BYTES).
MAX_ITEMS = 10_000
# A session key names a session in URLs (DELETE /v1/ninfer/sessions/{key}, percent-encoded)
# and in the checkpoint store; an id is ours ("resp_" + 32 hex) or a client's mistake.
MAX_SESSION_KEY_BYTES = 512
MAX_ID_CHARS = 128
MAX_TOP_LOGPROBS = 20  # as the API documents (engine.runtime.batch_sampler's cap)


@dataclass(frozen=True)
class Reasoning:
    effort: str | None = None     # None: not asked (thinking off)
    summary: str | None = None

    @property
    def thinking(self) -> bool:
        return self.effort not in (None, "none", "minimal")


@dataclass(frozen=True)
class ResponseRequest:
    model: str
    messages: tuple[dict, ...]     # chat-template messages: instructions + the input
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
    tools: tuple = ()              # function tools, Responses shape
    tool_choice: object = "auto"   # "auto" | "none" | "required" | {"type": "function", ...}
    text_format: dict = field(default_factory=lambda: {"type": "text"})
    reasoning: Reasoning = Reasoning()
    include: tuple = ()
    seed: int | None = None
    parallel_tool_calls: bool = True  # False: at most one call (enforced by the constraint)
    # None: no log-probabilities; k: each output_text token's, with k alternatives
    logprobs: int | None = None

    @property
    def input_messages(self) -> tuple[dict, ...]:
        return self.messages[1:] if self.instructions is not None else self.messages

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template renders them (chat-completions shape)."""
        if not self.tools:
            return None
        return [{"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters") if k in t}}
            for t in self.tools]

    @property
    def tool_choice_name(self) -> str | None:
        tc = self.tool_choice
        return tc["name"] if isinstance(tc, dict) else None


def _reasoning(body: dict) -> Reasoning:
    r = body.get("reasoning")
    if r is None:
        return Reasoning()
    if not isinstance(r, dict):
        raise invalid("'reasoning' must be an object", param="reasoning")
    effort, summary = r.get("effort"), r.get("summary", r.get("generate_summary"))
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"'reasoning.effort' must be one of {list(EFFORTS)}",
                      param="reasoning.effort")
    if summary not in _SUMMARIES:
        raise invalid("'reasoning.summary' must be 'auto', 'concise' or 'detailed'",
                      param="reasoning.summary")
    return Reasoning(effort=effort or ("medium" if summary else None), summary=summary)


def _logprobs(body: dict, include: list) -> int | None:
    """How many alternatives each token's log-probability lists, or None when the request
    asked for none: `include: ["message.output_text.logprobs"]` or a `top_logprobs` of at
    least 1 asks for them."""
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                            or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise invalid(f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}",
                      param="top_logprobs")
    if "message.output_text.logprobs" in include or (top or 0) > 0:
        return top or 0
    return None


def _refuse_unsupported(body: dict) -> None:
    """Parameters whose other values this server cannot honour: refused, not ignored.

    `truncation: "auto"` would drop items from the start of the conversation to fit the
    context; a client that compacts its own history (OMP does, on `context_length_exceeded`)
    never sends it, and a silently shortened conversation would hide the overflow it reacts
    to. `background: true` would return at once and run the response later."""
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise invalid("'truncation' may only be 'disabled': this server does not drop input "
                      "items; a request over the context gets context_length_exceeded",
                      param="truncation", code="unsupported_value")
    background = body.get("background")
    if background not in (None, False):
        raise invalid("'background' may only be false: this server answers each response "
                      "on its request", param="background", code="unsupported_value")


def parse_response_request(body) -> ResponseRequest:
    model, stream = common_fields(body, _KNOWN)
    _refuse_unsupported(body)
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
    if prev is not None and len(prev) > MAX_ID_CHARS:
        raise invalid(f"'previous_response_id' is longer than {MAX_ID_CHARS} characters",
                      param="previous_response_id")
    pck = body.get("prompt_cache_key")
    if pck is not None and not isinstance(pck, str):
        raise invalid("'prompt_cache_key' must be a string", param="prompt_cache_key")
    if pck is not None and len(pck.encode("utf-8", "surrogatepass")) > MAX_SESSION_KEY_BYTES:
        raise invalid(f"'prompt_cache_key' is longer than {MAX_SESSION_KEY_BYTES} bytes of UTF-8",
                      param="prompt_cache_key")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise invalid("'metadata' must be an object", param="metadata")
    seed = parse_seed(body)
    include = body.get("include") or []
    if not isinstance(include, list) or any(x not in _INCLUDES for x in include):
        raise invalid(f"'include' may list only {sorted(_INCLUDES)}", param="include")
    logprobs = _logprobs(body, include)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("'instructions' must be a string", param="instructions")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("'input' must be a non-empty string or array of input items",
                      param="input")
    if len(items) > MAX_ITEMS:
        raise invalid(f"'input' has {len(items)} items; at most {MAX_ITEMS} are allowed",
                      param="input")
    messages = ([{"role": "system", "content": instructions}] if instructions is not None
                else []) + items_to_messages(items)
    tools = parse_tools(body)
    return ResponseRequest(
        model=model, messages=tuple(messages), stream=stream, max_output_tokens=mot,
        instructions=instructions, input_items=tuple(items),
        temperature=parse_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=parse_number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        store=store, previous_response_id=prev, prompt_cache_key=pck, metadata=metadata,
        tools=tools, tool_choice=parse_tool_choice(body, tools),
        text_format=parse_text_format(body), reasoning=_reasoning(body), include=tuple(include),
        seed=seed, logprobs=logprobs,
        parallel_tool_calls=parallel_calls(body))
