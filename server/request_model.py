"""A request body, validated: the JSON body and the fields the Responses and chat-completions
APIs share (numbers in a range, function tools, tool_choice, the output format,
parallel_tool_calls), then a `POST /v1/responses` body into a typed `ResponseRequest`.

Every rejection is an APIError with the offending parameter named, raised before any work starts.
The input items become chat-template messages (server/input_items.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from server.errors import invalid
from server.input_items import items_to_messages


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_TOOLS = 256
MAX_NAME = 128


def parse_sampling(body: dict, defaults: dict | None) -> dict:
    """temperature and top_p of a request (both APIs); a field the body does not name takes
    the served model's default (`defaults`, its artifact's extra.generation), else 1.0."""
    d = defaults or {}
    return {"temperature": parse_number(body, "temperature", d.get("temperature", 1.0), 0.0, 2.0),
            "top_p": parse_number(body, "top_p", d.get("top_p", 1.0), 0.0, 1.0) or 1.0}


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
MAX_TOP_LOGPROBS = 20  # as the API documents (engine.runtime.runner's cap)


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


def parse_response_request(body, defaults: dict | None = None) -> ResponseRequest:
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
        **parse_sampling(body, defaults), store=store, previous_response_id=prev,
        prompt_cache_key=pck, metadata=metadata,
        tools=tools, tool_choice=parse_tool_choice(body, tools),
        text_format=parse_text_format(body), reasoning=_reasoning(body), include=tuple(include),
        seed=seed, logprobs=logprobs,
        parallel_tool_calls=parallel_calls(body))
