"""Chat templates: render a conversation to prompt text exactly as transformers' apply_chat_template does.

Templates come from the model's HF directory (`load_chat_template`) or, for our own artifacts, from
`engine/text/templates/qwen3_5_chat.jinja` (`default_chat_template`). HF templates are untrusted code, so
they run in jinja2's immutable sandbox with the same environment transformers builds: trim_blocks,
lstrip_blocks, loopcontrols, a `tojson` that does not HTML-escape, `raise_exception`,
`strftime_now`, and a `namespace` that refuses underscore names.

Before rendering, messages are normalised like transformers 5.x does it: keys whose value is None
are dropped, and `reasoning` / `thinking` are aliased to `reasoning_content`. We also parse tool-call
`arguments` given as a JSON object string (the OpenAI wire form) into a dict, which our template needs
and transformers leaves as is.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_DIR = Path(__file__).parent / "templates"
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A template that cannot be loaded, or a conversation it refuses (raise_exception)."""


def default_chat_template() -> str:
    """Our Qwen3.5-format template (the one embedded in artifacts we build)."""
    return (TEMPLATE_DIR / "qwen3_5_chat.jinja").read_text(encoding="utf-8")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace()` for templates: no attribute name may start with "_" (no dunder games)."""

    def __init__(*args, **kwargs):  # first positional is self, as in jinja2's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    env.globals["dict"] = dict
    return env.from_string(template)


def _parse_arguments(call: dict) -> dict:
    fn = call.get("function")
    target = fn if isinstance(fn, dict) else call
    args = target.get("arguments")
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError:
        return call  # left as is: the template reports it
    if not isinstance(parsed, dict):
        return call
    target = {**target, "arguments": parsed}
    return {**call, "function": target} if isinstance(fn, dict) else target


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Copies of `messages` as the template sees them (see the module docstring)."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise ChatTemplateError(f"a message must be a dict, got {type(message).__name__}")
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_parse_arguments(c) if isinstance(c, dict) else c for c in m["tool_calls"]]
        out.append(m)
    return out


def render_chat(
    template: str,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """Prompt text for `messages` (and tool JSON schemas); kwargs are template variables such as
    enable_thinking or preserve_thinking. Raises ChatTemplateError when the template refuses."""
    try:
        return _compile(template).render(
            messages=normalize_messages(messages),
            tools=tools,
            documents=kwargs.pop("documents", None),
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(str(e)) from e


def load_chat_template(hf_dir: str | Path, name: str = "default") -> str | None:
    """The chat template an HF model directory ships, or None if it has none.

    Order: `chat_template.jinja`, then `tokenizer_config.json`'s `chat_template`, then
    `chat_template.json`. A list of named templates ([{"name", "template"}]) yields the one called
    `name`; a list without it is an error, not a silent fallback.
    """
    hf_dir = Path(hf_dir)
    jinja_file = hf_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    for filename in ("tokenizer_config.json", "chat_template.json"):
        path = hf_dir / filename
        if not path.is_file():
            continue
        value = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        if value is None:
            continue
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            if name not in named or not isinstance(named[name], str):
                raise ChatTemplateError(f"{path}: no chat template named {name!r} (have {sorted(map(str, named))})")
            return named[name]
        raise ChatTemplateError(f"{path}: chat_template is a {type(value).__name__}, not a string or list")
    return None
