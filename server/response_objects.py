"""Response objects and the SSE event sequence of the Responses API.

A streamed response emits, in order: response.created, response.in_progress, for each output item
output_item.added, content_part.added, output_text.delta*, output_text.done, content_part.done,
output_item.done, and one terminal event: response.completed or response.incomplete (or
response.failed). Every event carries a strictly increasing sequence_number.
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
    text: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
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
    output_ids: list[int] = field(default_factory=list)  # the model's tokens, for the store

    def message_item(self, status: str) -> dict:
        content = [] if status == "in_progress" and not self.text else [self.text_part()]
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": content}

    def text_part(self, text: str | None = None) -> dict:
        return {"type": "output_text", "text": self.text if text is None else text,
                "annotations": [], "logprobs": []}

    def usage(self) -> dict:
        return {"input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
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
            "output": [self.message_item("completed" if self.status == "completed"
                                         else "incomplete")] if done else [],
            "parallel_tool_calls": True, "previous_response_id": self.previous_response_id,
            "prompt_cache_key": self.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None}, "store": self.store,
            "temperature": self.temperature, "top_p": self.top_p,
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
            "truncation": "disabled", "metadata": self.metadata,
            "usage": self.usage() if done else None,
            "output_text": self.text,
        }


class EventStream:
    """Builds SSE frames with increasing sequence numbers."""

    def __init__(self, state: ResponseState):
        self.state = state
        self.seq = 0

    def frame(self, type_: str, **payload) -> str:
        event = {"type": type_, "sequence_number": self.seq, **payload}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def opening(self) -> list[str]:
        s = self.state
        return [
            self.frame("response.created", response=s.to_dict()),
            self.frame("response.in_progress", response=s.to_dict()),
            self.frame("response.output_item.added", output_index=0,
                       item=s.message_item("in_progress")),
            self.frame("response.content_part.added", item_id=s.message_id, output_index=0,
                       content_index=0, part=s.text_part("")),
        ]

    def delta(self, text: str) -> str:
        return self.frame("response.output_text.delta", item_id=self.state.message_id,
                          output_index=0, content_index=0, delta=text, logprobs=[])

    def closing(self) -> list[str]:
        s = self.state
        item_status = "completed" if s.status == "completed" else "incomplete"
        terminal = "response.completed" if s.status == "completed" else f"response.{s.status}"
        return [
            self.frame("response.output_text.done", item_id=s.message_id, output_index=0,
                       content_index=0, text=s.text, logprobs=[]),
            self.frame("response.content_part.done", item_id=s.message_id, output_index=0,
                       content_index=0, part=s.text_part()),
            self.frame("response.output_item.done", output_index=0,
                       item=s.message_item(item_status)),
            self.frame(terminal, response=s.to_dict()),
        ]

    def failed(self, message: str) -> str:
        s = self.state
        s.status = "failed"
        body = s.to_dict()
        body["error"] = {"code": "server_error", "message": message}
        return self.frame("response.failed", response=body)
