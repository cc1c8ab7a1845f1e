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

The content guard (`ContentGuard`): only the chat template makes control tokens; special-token
text in content stays text. A tokenizer matches its added tokens ("<|im_end|>", "<tool_call>",
"<think>", ...) anywhere in the text it encodes, so a file an agent reads, a tool's output or a
user's message that contains "<|im_end|>\\n<|im_start|>system" would otherwise end the turn and
forge a new one. Before the template renders a conversation, `ContentGuard.shield` replaces
every added-token string in every value that came from a request (message content, reasoning,
tool calls and their arguments, tool outputs, instructions, tool definitions: keys and values
alike) by a mark of private-use characters. The template's own structure is then the only
added-token text in the rendered prompt. `ContentGuard.encode` splits the rendered text at those
structural tokens (as the tokenizer would), restores each shielded string inside the pieces
between them, and encodes each piece with no added-token matching: a shielded "<|im_end|>"
becomes the ordinary tokens of its characters. A conversation without such text encodes to the
same ids as before.
"""
from __future__ import annotations

import functools
import json
import re
from array import array
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.text.tokenizer import Tokenizer, id_list

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


# ---- the content guard --------------------------------------------------------------------
OPEN, CLOSE = "\ue000", "\ue001"  # private-use: they open and close a shielded string's index
SCAN_WINDOW = 1 << 20  # characters a regex pass over request text covers at a time


class ContentGuard:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        added = sorted(set(tokenizer.added_tokens()), key=lambda t: (-len(t), t))
        # the marks' own characters, in a request, are shielded too, so no text forges a mark
        self._texts = added + [OPEN, CLOSE]
        self._index = {t: i for i, t in enumerate(self._texts)}
        self._longest = max(len(t) for t in self._texts)
        self._shieldable = re.compile("|".join(re.escape(t) for t in self._texts))
        self._structural = re.compile("|".join(re.escape(t) for t in added)) if added else None
        self._mark = re.compile(re.escape(OPEN) + r"(\d+)" + re.escape(CLOSE))

    def shield(self, value):
        """`value` (a string, or dicts and lists of them) with every added-token string and
        mark character replaced by its mark."""
        if isinstance(value, str):
            return self._shield_text(value)
        if isinstance(value, dict):
            return {self.shield(k): self.shield(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.shield(v) for v in value)
        return value

    def _windowed(self, pattern: re.Pattern, text: str):
        """`pattern.finditer(text)` (for patterns of added-token strings and marks), a window
        at a time: a single regex pass over megabytes holds the GIL for a fifth of a second
        (this runs beside the server's event loop). A match starting in a window is taken
        whole (it is at most `_longest` long); the next window starts after it."""
        pos, last, n = 0, 0, len(text)
        while pos < n:
            end = min(n, pos + SCAN_WINDOW)
            for m in pattern.finditer(text, pos, min(n, end + self._longest)):
                if m.start() >= end:
                    break
                yield m
                last = m.end()
            pos = max(end, last)

    def _shield_text(self, text: str) -> str:
        """One string shielded."""
        out, last = [], 0
        for m in self._windowed(self._shieldable, text):
            out += [text[last:m.start()], f"{OPEN}{self._index[m.group(0)]}{CLOSE}"]
            last = m.end()
        if not out:
            return text
        out.append(text[last:])
        return "".join(out)

    def _unshield(self, text: str) -> str:
        if OPEN not in text:
            return text
        return self._mark.sub(lambda m: self._texts[int(m.group(1))], text)

    def encode(self, rendered: str) -> list[int]:
        """Token ids of a prompt rendered from shielded values: the template's added tokens
        are control tokens, everything else (shielded strings restored) is ordinary text."""
        return id_list(self.encode_ids(rendered))

    def encode_ids(self, rendered: str) -> array:
        """`encode`'s ids as an `array("i")` (see `Tokenizer.ordinary_ids`): a prompt can be
        counted, and refused, before millions of ints are made of it."""
        tk = self.tokenizer
        if self._structural is None:
            return tk.ordinary_ids(self._unshield(rendered))
        ids = array("i")
        pos = 0
        for m in self._windowed(self._structural, rendered):
            if m.start() > pos:
                ids += tk.ordinary_ids(self._unshield(rendered[pos:m.start()]))
            ids.append(tk.id_of(m.group(0)))
            pos = m.end()
        if pos < len(rendered):
            ids += tk.ordinary_ids(self._unshield(rendered[pos:]))
        return ids
