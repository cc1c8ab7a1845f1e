"""Validation of `POST /v1/responses` bodies into a typed request.

Every rejection is an APIError with the offending parameter named, raised before any work starts.

Input items become chat-template messages (`items_to_messages`):
- `message` (user, system, developer, assistant) -> a turn of that role (developer = system);
- `reasoning` -> the thinking of the assistant turn it precedes;
- `function_call` -> a tool call of the current assistant turn (consecutive reasoning, assistant
  messages and function calls form one assistant turn, as the model wrote them);
- `function_call_output` (string or content-array output) -> a `tool` turn.
`input_image` / `input_file` parts get a 400 `unsupported_content`: the model reads text only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from server.errors import invalid

_ROLES = {"user", "system", "developer", "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_SUMMARIES = (None, "auto", "concise", "detailed")
# Accepted and ignored: they change nothing in a local, single-model deployment.
_IGNORED = {"metadata", "user", "service_tier", "truncation",
            "prompt_cache_retention", "safety_identifier", "background",
            "top_logprobs", "stream_options", "prompt_cache_key", "store"}
_KNOWN = _IGNORED | {"model", "input", "instructions", "stream", "max_output_tokens",
                     "temperature", "top_p", "previous_response_id", "tools", "tool_choice",
                     "text", "reasoning", "include", "seed", "parallel_tool_calls"}
_INCLUDES = {"reasoning.encrypted_content", "message.output_text.logprobs"}

# Size limits (the body as a whole is capped by the HTTP layer at MAX_BODY_BYTES).
MAX_ITEMS = 10_000
MAX_ITEM_CHARS = 4 * 1024 * 1024
MAX_TOOLS = 256
MAX_NAME = 128


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


def _tools(body: dict) -> tuple:
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


def _tool_choice(body: dict, tools: tuple):
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


def _text_format(body: dict) -> dict:
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


def _reasoning(body: dict) -> Reasoning:
    r = body.get("reasoning")
    if r is None:
        return Reasoning()
    if not isinstance(r, dict):
        raise invalid("'reasoning' must be an object", param="reasoning")
    effort, summary = r.get("effort"), r.get("summary", r.get("generate_summary"))
    if effort is not None and effort not in _EFFORTS:
        raise invalid(f"'reasoning.effort' must be one of {list(_EFFORTS)}",
                      param="reasoning.effort")
    if summary not in _SUMMARIES:
        raise invalid("'reasoning.summary' must be 'auto', 'concise' or 'detailed'",
                      param="reasoning.summary")
    return Reasoning(effort=effort or ("medium" if summary else None), summary=summary)


def json_body(raw: bytes | None):
    """The request body as JSON; a 400 in the API's format when it is not."""
    try:
        return json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError):
        raise invalid("the request body is not valid JSON") from None


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


def parallel_calls(body: dict) -> bool:
    v = body.get("parallel_tool_calls", True)
    if v is None:
        return True
    if not isinstance(v, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    return v


def parse_response_request(body) -> ResponseRequest:
    model, stream = common_fields(body, _KNOWN)
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
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid("'seed' must be an integer", param="seed")
    include = body.get("include") or []
    if not isinstance(include, list) or any(x not in _INCLUDES for x in include):
        raise invalid(f"'include' may list only {sorted(_INCLUDES)}", param="include")
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
    tools = _tools(body)
    return ResponseRequest(
        model=model, messages=tuple(messages), stream=stream, max_output_tokens=mot,
        instructions=instructions, input_items=tuple(items),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        store=store, previous_response_id=prev, prompt_cache_key=pck, metadata=metadata,
        tools=tools, tool_choice=_tool_choice(body, tools), text_format=_text_format(body),
        reasoning=_reasoning(body), include=tuple(include), seed=seed,
        parallel_tool_calls=parallel_calls(body))
