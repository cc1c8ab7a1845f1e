"""Prompts for chained responses, and stored responses back to API objects.

A response continued with `previous_response_id` gets, when its instructions are the parent's,
the parent's exact token sequence (its prompt and every token it produced), the end-of-turn
token, and only the new input rendered by the chat template. That sequence is what the engine's
stored state follows, so the continuation computes only the new tokens; and it is what the model
actually saw, not a re-rendering that could tokenize differently. When the instructions changed
(or token ids are missing), the conversation is rendered whole from the stored items.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.chat import render_chat
from engine.loader import LoadedModel
from server.errors import invalid
from server.request_model import ResponseRequest, content_text
from server.response_objects import ResponseState
from server.store import ResponseRecord, ResponseStore, item_content_hash

END_OF_TURN = "<|im_end|>\n"


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    boundary: int = 0       # end of the system turn (0: none worth a snapshot)
    parent_len: int = 0     # tokens shared with the parent's sequence (extends_parent when > 0)
    parent_id: str | None = None  # the response whose sequence this prompt extends


def not_found(prev: str):
    return invalid(f"Previous response with id '{prev}' not found.",
                   param="previous_response_id", code="previous_response_not_found")


def _msgs(messages) -> list[dict]:
    return [{"role": x.role, "content": x.content} for x in messages]


def render_full(m: LoadedModel, messages: list[dict]) -> Prompt:
    """Render and tokenize a whole conversation; find where its system turn ends."""
    ids = m.tokenizer.encode(render_chat(m.chat_template, messages, add_generation_prompt=True))
    boundary = 0
    if messages and messages[0]["role"] == "system" and len(messages) > 1:
        head = m.tokenizer.encode(render_chat(m.chat_template, messages[:1],
                                              add_generation_prompt=False))
        if len(head) < len(ids) and ids[:len(head)] == head:
            boundary = len(head)
    return Prompt(ids, boundary)


def _history_messages(entries) -> list[dict]:
    out = []
    for e in entries:
        item = e.item
        if item.get("type", "message") != "message" or item.get("role") not in (
                "user", "assistant", "system", "developer"):
            continue  # tool items join with the tools work
        role = "system" if item["role"] == "developer" else item["role"]
        if role == "system":
            continue  # instructions are never carried over; earlier system items neither
        out.append({"role": role, "content": content_text(item.get("content"))})
    return out


def _find_replayed(store: ResponseStore, req: ResponseRequest, principal: str):
    """A full transcript resent without `previous_response_id` (a client resuming a session):
    if its items up to the last assistant message are exactly the stored history of one of the
    principal's responses, with the same instructions, return (that response, the new items)."""
    items = list(req.input_items)
    last = next((j for j in range(len(items) - 1, -1, -1)
                 if items[j].get("type", "message") == "message"
                 and items[j].get("role") == "assistant"), None)
    if last is None or last == len(items) - 1:
        return None
    sent = [item_content_hash(x) for x in items[:last + 1]]
    for rid in store.responses_with_output(principal, items[last]):
        entries = store.history_entries(principal, rid)
        rec = store.get(principal, rid)
        if (entries is not None and rec is not None and rec.instructions == req.instructions
                and req.prompt_cache_key in (None, rec.prompt_cache_key)
                and [item_content_hash(e.item) for e in entries] == sent):
            return rec, items[last + 1:]
    return None


async def _extend(store, m: LoadedModel, principal: str, parent_id: str, new_messages):
    seq = await asyncio.to_thread(store.token_sequence, principal, parent_id)
    if seq is None:
        return None
    new = render_chat(m.chat_template, new_messages, add_generation_prompt=True)
    return Prompt(seq + m.tokenizer.encode(END_OF_TURN + new), 0, len(seq), parent_id)


async def build_prompt(store: ResponseStore, m: LoadedModel, req: ResponseRequest,
                       principal: str) -> Prompt:
    prev = req.previous_response_id
    if prev is None:
        found = await asyncio.to_thread(_find_replayed, store, req, principal)
        if found is not None:
            rec, new_items = found
            new = [{"role": "system" if x["role"] == "developer" else x["role"],
                    "content": content_text(x.get("content"))} for x in new_items
                   if x.get("type", "message") == "message"]
            if len(new) == len(new_items) and all(x["role"] == "user" for x in new):
                prompt = await _extend(store, m, principal, rec.id, new)
                if prompt is not None:
                    return prompt
        return render_full(m, _msgs(req.messages))
    parent = await asyncio.to_thread(store.continuation, principal, prev, req.prompt_cache_key)
    if parent is None:
        raise not_found(prev)
    if parent.instructions == req.instructions:
        prompt = await _extend(store, m, principal, prev, _msgs(req.input_messages))
        if prompt is not None:
            return prompt
    entries = await asyncio.to_thread(store.history_entries, principal, prev)
    if entries is None:
        raise not_found(prev)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return render_full(m, system + _history_messages(entries) + _msgs(req.input_messages))


def record_for(state: ResponseState, req: ResponseRequest, principal: str,
               prompt: Prompt) -> ResponseRecord:
    status = state.status
    return ResponseRecord(
        id=state.id, principal=principal, model=state.model, status=status,
        input_items=[dict(x) for x in req.input_items],
        output_items=[state.message_item("completed" if status == "completed" else
                                         "incomplete")],
        output_token_ids=[list(state.output_ids)], created_at=state.created_at,
        # lineage: the response this prompt extends, named by the client or found by replay
        previous_response_id=prompt.parent_id or req.previous_response_id,
        prompt_cache_key=req.prompt_cache_key,
        instructions=req.instructions,
        params={"temperature": req.temperature, "top_p": req.top_p,
                "max_output_tokens": req.max_output_tokens, "metadata": req.metadata,
                "incomplete_details": ({"reason": state.incomplete_reason}
                                       if state.incomplete_reason else None)},
        usage=state.usage(), prompt_tokens=len(prompt.ids),
        prompt_token_ids=prompt.ids[prompt.parent_len:], extends_parent=prompt.parent_len > 0)


def fed_tokens(rec_status: str, sequence: list[int]) -> list[int]:
    """The tokens a finished response's stored engine state follows: every output token when it
    stopped on its own, all but the last (sampled, never fed) when the budget ran out."""
    return sequence if rec_status == "completed" else sequence[:-1]


def response_from_record(rec: ResponseRecord) -> dict:
    text = "".join(p.get("text", "") for it in rec.output_items if it.get("type") == "message"
                   for p in it.get("content", []))
    return {
        "id": rec.id, "object": "response", "created_at": int(rec.created_at),
        "status": rec.status, "error": None,
        "incomplete_details": rec.params.get("incomplete_details"),
        "instructions": rec.instructions, "model": rec.model, "output": rec.output_items,
        "max_output_tokens": rec.params.get("max_output_tokens"),
        "parallel_tool_calls": True, "previous_response_id": rec.previous_response_id,
        "prompt_cache_key": rec.prompt_cache_key, "reasoning": {"effort": None, "summary": None},
        "store": True, "temperature": rec.params.get("temperature"),
        "top_p": rec.params.get("top_p"), "text": {"format": {"type": "text"}},
        "tool_choice": "auto", "tools": [], "truncation": "disabled",
        "metadata": rec.params.get("metadata") or {}, "usage": rec.usage, "output_text": text,
    }
