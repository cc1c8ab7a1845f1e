"""Response objects and the SSE event sequence of the Responses API.

A streamed response emits, in order: response.created, response.in_progress, then for each output
item output_item.added, its content events and output_item.done (a message: content_part.added,
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


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


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
        """Frames for a list of server.output_items.Op."""
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
