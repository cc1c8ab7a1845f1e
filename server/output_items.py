"""The model's output text, split into Responses output items as it streams.

With thinking on, generation starts inside `<think>` (the chat template's generation prompt ends
with it): everything up to `</think>` is a `reasoning` item. The rest goes through the tool-call
parser (engine/text/toolcall.py): its text is a `message` item, each complete call a `function_call`
item (only when the request offered tools: without, the markup is the message's text). A message
item is opened at its first character and closed when a call follows it or the output ends; text
after a call opens a new message item.

`OutputAssembler.push(text)` / `.finish(status)` return a list of `Op`s, which the SSE layer turns
into events and the non-streaming path just applies. The finished `items` list is what the response
object shows and the store keeps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.text.toolcall import StreamingToolParser, TextDelta, ToolCallEnd
from server.response_objects import new_id

THINK_END = "</think>"


@dataclass
class Op:
    kind: str           # "added" | "text_delta" | "reasoning_delta" | "done"
    index: int          # output index of the item
    text: str = ""
    logprobs: list = field(default_factory=list)  # a text_delta's tokens' (when asked for)


def _partial_suffix(buf: str, lit: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of lit."""
    for n in range(min(len(lit) - 1, len(buf)), 0, -1):
        if lit.startswith(buf[-n:]):
            return n
    return 0


class OutputAssembler:
    def __init__(self, *, tools: list[dict] | None, thinking: bool, summary: bool = False,
                 message_id: str | None = None, sealer=None):
        self.items: list[dict] = []
        # no tools offered: call markup the model writes stays in its message, as text
        self._parser = StreamingToolParser(tools, calls=bool(tools))
        self.thinking = thinking  # as asked: the output starts inside <think>
        self._thinking = thinking
        self._summary = summary
        self._think_buf = ""
        self._reasoning: dict | None = None
        self._message: dict | None = None
        self._message_id = message_id
        self._sealer = sealer  # () -> encrypted_content of the reasoning, when asked for
        self.reasoning_chars = 0

    @property
    def in_reasoning(self) -> bool:
        """Whether the text pushed next still goes to the reasoning (before `</think>`)."""
        return self._thinking

    # ---- feeding ----------------------------------------------------------------------------
    def push(self, text: str) -> list[Op]:
        ops: list[Op] = []
        if self._thinking:
            self._think_buf += text
            cut = self._think_buf.find(THINK_END)
            if cut < 0:
                hold = _partial_suffix(self._think_buf, THINK_END)
                emit = self._think_buf[:len(self._think_buf) - hold]
                self._think_buf = self._think_buf[len(emit):]
                if emit:
                    ops += self._reasoning_delta(emit)
                return ops
            head, rest = self._think_buf[:cut], self._think_buf[cut + len(THINK_END):]
            self._think_buf = ""
            if head:
                ops += self._reasoning_delta(head)
            ops += self._close_reasoning("completed")
            self._thinking = False
            text = rest.lstrip("\n")
            if not text:
                return ops
        for ev in self._parser.feed(text):
            ops += self._on_parser_event(ev)
        return ops

    def finish(self, status: str) -> list[Op]:
        """End of output; `status` is the item status for open items ("completed" or
        "incomplete")."""
        ops: list[Op] = []
        if self._thinking:
            if self._think_buf:
                ops += self._reasoning_delta(self._think_buf)
                self._think_buf = ""
            ops += self._close_reasoning("incomplete")
            self._thinking = False
        for ev in self._parser.finish():
            ops += self._on_parser_event(ev)
        if not self.items:  # nothing at all was said: one empty message, as a record of it
            ops += self._on_parser_event(TextDelta(""))
        ops += self._close_message(status)
        return ops

    # ---- items ------------------------------------------------------------------------------
    def _reasoning_delta(self, text: str) -> list[Op]:
        ops = []
        if self._reasoning is None:
            self._reasoning = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                               "content": [{"type": "reasoning_text", "text": ""}],
                               "status": "in_progress"}
            self.items.append(self._reasoning)
            ops.append(Op("added", len(self.items) - 1))
        self._reasoning["content"][0]["text"] += text
        self.reasoning_chars += len(text)
        ops.append(Op("reasoning_delta", self.items.index(self._reasoning), text))
        return ops

    def _close_reasoning(self, status: str) -> list[Op]:
        r = self._reasoning
        if r is None:  # an empty think block still yields an (empty) reasoning item
            r = self._reasoning = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                                   "content": [{"type": "reasoning_text", "text": ""}],
                                   "status": "in_progress"}
            self.items.append(r)
            ops = [Op("added", len(self.items) - 1)]
        else:
            ops = []
        text = r["content"][0]["text"].strip()
        r["content"][0]["text"] = text
        if self._summary and text:
            r["summary"] = [{"type": "summary_text", "text": text}]
        if self._sealer is not None:
            r["encrypted_content"] = self._sealer()
        r["status"] = status
        ops.append(Op("done", self.items.index(r)))
        return ops

    def _on_parser_event(self, ev) -> list[Op]:
        if isinstance(ev, TextDelta):
            ops = []
            if self._message is None:
                mid = self._message_id if self._message_id and not any(
                    i.get("type") == "message" for i in self.items) else new_id("msg")
                self._message = {"id": mid, "type": "message", "role": "assistant",
                                 "status": "in_progress",
                                 "content": [{"type": "output_text", "text": "",
                                              "annotations": [], "logprobs": []}]}
                self.items.append(self._message)
                ops.append(Op("added", len(self.items) - 1))
            self._message["content"][0]["text"] += ev.text
            ops.append(Op("text_delta", self.items.index(self._message), ev.text))
            return ops
        if isinstance(ev, ToolCallEnd):
            ops = self._close_message("completed")
            call = ev.call
            self.items.append({"id": new_id("fc"), "type": "function_call",
                               "status": "completed", "call_id": new_id("call"),
                               "name": call.name, "arguments": call.arguments_json})
            i = len(self.items) - 1
            return ops + [Op("added", i), Op("done", i)]
        return []  # ToolCallStart / ToolCallArgsDelta: the call is announced whole at its end

    def _close_message(self, status: str) -> list[Op]:
        m = self._message
        if m is None:
            return []
        self._message = None
        m["status"] = status
        return [Op("done", self.items.index(m))]

    # ---- results ----------------------------------------------------------------------------
    @property
    def text(self) -> str:
        return "".join(p["text"] for it in self.items if it["type"] == "message"
                       for p in it["content"])


def split_token_ids(items: list[dict], ids: list[int], *, think_end_id: int | None,
                    tool_call_id: int | None) -> list[list[int]]:
    """The model's token ids per output item, concatenating to `ids`.

    Items start at token boundaries the model wrote as special tokens: a reasoning item ends
    with `</think>`, each function call starts at its `<tool_call>`. Text between two
    boundaries belongs to the item that starts there. When the calls cannot be matched to
    `<tool_call>` tokens one to one (a malformed call kept as text), the ids after the reasoning
    all go to the first item after it."""
    out: list[list[int]] = [[] for _ in items]
    if not items:
        return out
    pos, first = 0, 0
    if items[0]["type"] == "reasoning":
        end = ids.index(think_end_id) + 1 if think_end_id in ids else len(ids)
        out[0], pos, first = list(ids[:end]), end, 1
    rest = items[first:]
    if not rest:
        if pos < len(ids):
            out[0] = out[0] + list(ids[pos:])
        return out
    starts = [j for j in range(pos, len(ids)) if ids[j] == tool_call_id]
    calls = [k for k, it in enumerate(rest) if it["type"] == "function_call"]
    messages = [k for k, it in enumerate(rest) if it["type"] == "message"]
    simple = (len(starts) == len(calls) and len(messages) <= 1 and
              (not messages or messages[0] == 0))
    if not simple:
        out[first] = list(ids[pos:])
        return out
    bounds = ([pos] if messages else []) + starts + [len(ids)]
    if not messages and calls:
        bounds[0] = pos  # whitespace before the first call goes with it
    for k in range(len(rest)):
        out[first + k] = list(ids[bounds[k]:bounds[k + 1]])
    return out
