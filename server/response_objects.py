"""A response's output as the API shows it: the model's text split into output items as it
streams, the response object, and the SSE event sequence of the Responses API.

Items: with thinking on, generation starts inside `<think>` (the chat template's generation
prompt ends with it): everything up to `</think>` is a `reasoning` item. The rest goes through
the tool-call parser (engine/text/toolcall.py): its text is a `message` item, each complete call
a `function_call` item (only when the request offered tools: without, the markup is the
message's text). A message item opens at its first character and closes when a call follows it
or the output ends. `OutputAssembler.push(text)` / `.finish(status)` return `Op`s, which the
SSE layer turns into events and the non-streaming path applies; the finished `items` are what
the response object shows and the store keeps.

Events, in order: response.created, response.in_progress, then for each output item
output_item.added, its content events and output_item.done (a message: content_part.added,
output_text.delta*, output_text.done, content_part.done; a reasoning item: the same with
reasoning_text, then its summary parts when a summary was asked for; a function call:
function_call_arguments.delta and .done), and one terminal event: response.completed or
response.incomplete (or response.failed). Every event carries a strictly increasing
sequence_number.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from engine.text.toolcall import StreamingToolParser, TextDelta, ToolCallEnd


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


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


@dataclass
class ResponseState:
    """The mutable record of one response while it is generated."""
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    message_id: str = field(default_factory=lambda: new_id("msg"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    incomplete_reason: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    previous_response_id: str | None = None
    instructions: str | None = None
    metadata: dict = field(default_factory=dict)
    store: bool = True
    prompt_cache_key: str | None = None
    tools: list = field(default_factory=list)
    tool_choice: object = "auto"
    text_format: dict = field(default_factory=lambda: {"type": "text"})
    reasoning: dict = field(default_factory=lambda: {"effort": None, "summary": None})
    parallel_tool_calls: bool = True
    items: list = field(default_factory=list)       # output items (the assembler's list)
    output_ids: list[int] = field(default_factory=list)  # the model's tokens, for the store

    @property
    def text(self) -> str:
        return "".join(p.get("text", "") for it in self.items if it.get("type") == "message"
                       for p in it.get("content", []))

    def usage(self) -> dict:
        return {"input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.input_tokens + self.output_tokens}

    def to_dict(self) -> dict:
        done = self.status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "error": None,
            "incomplete_details": ({"reason": self.incomplete_reason}
                                   if self.incomplete_reason else None),
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "model": self.model,
            "output": [dict(it) for it in self.items] if done else [],
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "prompt_cache_key": self.prompt_cache_key,
            "reasoning": self.reasoning, "store": self.store,
            "temperature": self.temperature, "top_p": self.top_p,
            "text": {"format": self.text_format}, "tool_choice": self.tool_choice,
            "tools": self.tools, "truncation": "disabled", "metadata": self.metadata,
            "usage": self.usage() if done else None,
            "output_text": self.text,
        }


class EventStream:
    """Builds SSE frames with increasing sequence numbers from the assembler's operations."""

    def __init__(self, state: ResponseState):
        self.state = state
        self.seq = 0

    def frame(self, type_: str, **payload) -> str:
        event = {"type": type_, "sequence_number": self.seq, **payload}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def opening(self) -> list[str]:
        s = self.state
        return [self.frame("response.created", response=s.to_dict()),
                self.frame("response.in_progress", response=s.to_dict())]

    def ops(self, ops) -> list[str]:
        """Frames for a list of server.response_objects.Op."""
        frames = []
        for op in ops:
            item = self.state.items[op.index]
            kind = item["type"]
            if op.kind == "added":
                added = dict(item, status="in_progress")
                if kind == "message":
                    added["content"] = []
                elif kind == "reasoning":
                    added["content"], added["summary"] = [], []
                frames.append(self.frame("response.output_item.added", output_index=op.index,
                                         item=added))
                if kind == "message":
                    frames.append(self.frame("response.content_part.added", item_id=item["id"],
                                             output_index=op.index, content_index=0,
                                             part=_text_part("")))
                elif kind == "reasoning":
                    frames.append(self.frame("response.content_part.added", item_id=item["id"],
                                             output_index=op.index, content_index=0,
                                             part={"type": "reasoning_text", "text": ""}))
            elif op.kind == "text_delta" and op.text:
                frames.append(self.frame("response.output_text.delta", item_id=item["id"],
                                         output_index=op.index, content_index=0,
                                         delta=op.text, logprobs=op.logprobs))
            elif op.kind == "reasoning_delta" and op.text:
                frames.append(self.frame("response.reasoning_text.delta", item_id=item["id"],
                                         output_index=op.index, content_index=0,
                                         delta=op.text))
            elif op.kind == "done":
                frames += self._item_done(op.index, item)
        return frames

    def _item_done(self, index: int, item: dict) -> list[str]:
        kind, iid, frames = item["type"], item["id"], []
        if kind == "message":
            text = item["content"][0]["text"]
            frames.append(self.frame("response.output_text.done", item_id=iid,
                                     output_index=index, content_index=0, text=text,
                                     logprobs=item["content"][0].get("logprobs") or []))
            frames.append(self.frame("response.content_part.done", item_id=iid,
                                     output_index=index, content_index=0,
                                     part=dict(item["content"][0])))
        elif kind == "reasoning":
            text = item["content"][0]["text"] if item["content"] else ""
            frames.append(self.frame("response.reasoning_text.done", item_id=iid,
                                     output_index=index, content_index=0, text=text))
            frames.append(self.frame("response.content_part.done", item_id=iid,
                                     output_index=index, content_index=0,
                                     part={"type": "reasoning_text", "text": text}))
            for j, part in enumerate(item.get("summary") or []):
                frames.append(self.frame("response.reasoning_summary_part.added", item_id=iid,
                                         output_index=index, summary_index=j,
                                         part={"type": "summary_text", "text": ""}))
                frames.append(self.frame("response.reasoning_summary_text.delta", item_id=iid,
                                         output_index=index, summary_index=j,
                                         delta=part["text"]))
                frames.append(self.frame("response.reasoning_summary_text.done", item_id=iid,
                                         output_index=index, summary_index=j,
                                         text=part["text"]))
                frames.append(self.frame("response.reasoning_summary_part.done", item_id=iid,
                                         output_index=index, summary_index=j, part=part))
        elif kind == "function_call":
            frames.append(self.frame("response.function_call_arguments.delta", item_id=iid,
                                     output_index=index, delta=item["arguments"]))
            frames.append(self.frame("response.function_call_arguments.done", item_id=iid,
                                     output_index=index, name=item["name"],
                                     arguments=item["arguments"]))
        frames.append(self.frame("response.output_item.done", output_index=index,
                                 item=dict(item)))
        return frames

    def terminal(self) -> str:
        s = self.state
        # A cancelled response ends like an incomplete one (the API has no cancelled event);
        # its status says cancelled.
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(
            s.status, "response.incomplete")
        return self.frame(kind, response=s.to_dict())

    def failed(self, message: str, code: str = "server_error") -> str:
        s = self.state
        s.status = "failed"
        body = s.to_dict()
        body["error"] = {"code": code, "message": message}
        return self.frame("response.failed", response=body)


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
