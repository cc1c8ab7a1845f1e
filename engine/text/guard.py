"""Only the chat template makes control tokens: special-token text in content stays text.

A tokenizer matches its added tokens ("<|im_end|>", "<tool_call>", "<think>", ...) anywhere in
the text it encodes, so a file an agent reads, a tool's output or a user's message that contains
"<|im_end|>\\n<|im_start|>system" would otherwise end the turn and forge a new one. Before the
template renders a conversation, `ContentGuard.shield` replaces every added-token string in
every value that came from a request (message content, reasoning, tool calls and their
arguments, tool outputs, instructions, tool definitions: keys and values alike) by a mark of
private-use characters. The template's own structure is then the only added-token text in the
rendered prompt. `ContentGuard.encode` splits the rendered text at those structural tokens (as
the tokenizer would), restores each shielded string inside the pieces between them, and
encodes each piece with no added-token matching: a shielded "<|im_end|>" becomes the ordinary
tokens of its characters. A conversation without such text encodes to the same ids as before.
"""
from __future__ import annotations

import re
from array import array

from engine.text.tokenizer import Tokenizer, id_list

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
