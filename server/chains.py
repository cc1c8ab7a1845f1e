"""Prompts for chained responses, and stored responses back to API objects.

A response continued with `previous_response_id` gets, when its instructions are the parent's,
the parent's exact token sequence (its prompt and every token it produced), the end-of-turn
token, and only the new input rendered by the chat template. That sequence is what the engine's
stored state follows, so the continuation computes only the new tokens; and it is what the model
actually saw, not a re-rendering that could tokenize differently. When the instructions changed
(or token ids are missing), the conversation is rendered whole from the stored items.

The work is CPU-heavy in proportion to the request (a 31 MB chat message: ~30 s of
tokenization), and on the event loop it would stop every other request, `/health` included.
So parsing, rendering and tokenizing run on worker threads (`off_loop`: the tokenizer and the
JSON parser release little of the GIL, but the loop still gets its turns), and each principal
has PER_PRINCIPAL such tasks at a time (`work_slot`): one client's large requests queue behind
each other instead of taking every worker thread.
"""
from __future__ import annotations

import asyncio
import dataclasses
import weakref
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.io.loader import LoadedModel
from engine.text.chat import ChatTemplateError, ContentGuard, render_chat
from engine.text.tokenizer import id_list
from server.errors import invalid
from server.generation import context_exceeded
from server.input_items import items_to_messages, reasoning_text
from server.request_model import ResponseRequest
from server.response_objects import ResponseState, split_token_ids
from server.response_store import ResponseRecord, ResponseStore, item_content_hash

if TYPE_CHECKING:
    from server.runtime import Runtime


END_OF_TURN = "<|im_end|>\n"


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    boundary: int = 0       # end of the system turn (0: none worth a snapshot)
    parent_len: int = 0     # tokens shared with the parent's sequence (extends_parent when > 0)
    parent_id: str | None = None  # the response whose sequence this prompt extends
    new_items_from: int = 0  # input items before this index were matched to the parent's history


def not_found(prev: str):
    return invalid(f"Previous response with id '{prev}' not found.",
                   param="previous_response_id", code="previous_response_not_found")


_guards: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def guard(m: LoadedModel) -> ContentGuard:
    """The model's content guard (engine/text/chat.py): special-token text in a request stays
    text; only the template's structure makes control tokens."""
    g = _guards.get(m.tokenizer)
    if g is None:
        g = _guards[m.tokenizer] = ContentGuard(m.tokenizer)
    return g


def encode(m: LoadedModel, rendered: str) -> list[int]:
    return guard(m).encode(rendered)


def _render(m: LoadedModel, messages: list[dict], req: ResponseRequest, *,
            tools: bool = True, generation: bool = True) -> str:
    """The conversation rendered from shielded values: encode it with `encode`."""
    # preserve_thinking: every assistant turn renders its think block, as it was generated, so
    # a re-rendered history is the token sequence the model saw.
    g = guard(m)
    try:
        return render_chat(m.chat_template, g.shield(list(messages)),
                           tools=g.shield(req.template_tools) if tools else None,
                           add_generation_prompt=generation,
                           enable_thinking=req.reasoning.thinking, preserve_thinking=True)
    except ChatTemplateError as e:
        raise invalid(f"the conversation cannot be rendered: {e}", param="input") from None


def render_full(m: LoadedModel, messages: list[dict], req: ResponseRequest,
                limit: int | None = None) -> Prompt:
    """Render and tokenize a whole conversation; find where its system turn ends. A prompt
    of `limit` tokens or more is refused as soon as it is counted."""
    arr = guard(m).encode_ids(_render(m, messages, req))
    if limit is not None and len(arr) >= limit:
        raise context_exceeded(limit, len(arr))
    ids = id_list(arr)
    del arr
    boundary = 0
    if messages and messages[0]["role"] == "system" and len(messages) > 1:
        head_msgs = messages[:1]
    elif req.tools and messages:
        head_msgs = [{"role": "system", "content": ""}]  # the tools alone make a system turn
    else:
        head_msgs = None
    if head_msgs is not None:
        head = encode(m, _render(m, head_msgs, req, generation=False))
        if len(head) < len(ids) and ids[:len(head)] == head:
            boundary = len(head)
    return Prompt(ids, boundary)


def _history_messages(entries) -> list[dict]:
    """The stored conversation as template messages; earlier system and developer messages
    are left out (instructions are never carried over)."""
    items = [e.item for e in entries
             if not (e.item.get("type", "message") == "message"
                     and e.item.get("role") in ("system", "developer"))]
    return items_to_messages(items, where="history")


def _same_setup(rec: ResponseRecord, req: ResponseRequest) -> bool:
    """The parent's system turn is this request's: same instructions, same tools."""
    return (rec.instructions == req.instructions
            and (rec.params.get("tools") or []) == [dict(t) for t in req.tools])


def _is_output_item(item: dict) -> bool:
    kind = item.get("type", "message")
    return kind in ("reasoning", "function_call") or (
        kind == "message" and item.get("role") == "assistant")


def _find_replayed(store: ResponseStore, req: ResponseRequest, principal: str):
    """A full transcript resent without `previous_response_id` (a client resuming a session,
    or one answered `previous_response_not_found`): if its items up to the last output item
    (an assistant message, a reasoning item or a function call) are exactly the stored history
    of one of the principal's responses, with the same instructions and tools, return (that
    response, the index of the first new item)."""
    items = list(req.input_items)
    last = next((j for j in range(len(items) - 1, -1, -1) if _is_output_item(items[j])), None)
    if last is None or last == len(items) - 1:
        return None
    new = items[last + 1:]
    if any(_is_output_item(x) for x in new):
        return None
    sent = [item_content_hash(x) for x in items[:last + 1]]
    for rid in store.responses_with_output(principal, items[last]):
        entries = store.history_entries(principal, rid)
        rec = store.get(principal, rid)
        if (entries is not None and rec is not None and _same_setup(rec, req)
                and req.prompt_cache_key in (None, rec.prompt_cache_key)
                and [item_content_hash(e.item) for e in entries] == sent):
            return rec, last + 1
    return None


async def _extend(store, m: LoadedModel, principal: str, parent_id: str, new_messages,
                  req: ResponseRequest, new_items_from: int = 0, limit: int | None = None):
    seq = await asyncio.to_thread(store.token_sequence, principal, parent_id)
    if seq is None:
        return None

    def extended():  # on a worker thread: rendering, tokenizing, the context check
        new = guard(m).encode_ids(END_OF_TURN + _render(m, list(new_messages), req, tools=False))
        n = len(seq) + len(new)
        if limit is not None and n >= limit:
            raise context_exceeded(limit, n)  # counted as an array: no list of ids was made
        return Prompt(seq + id_list(new), 0, len(seq), parent_id, new_items_from)
    return await asyncio.to_thread(extended)


async def build_prompt(store: ResponseStore, m: LoadedModel, req: ResponseRequest,
                       principal: str, limit: int | None = None) -> Prompt:
    prev = req.previous_response_id
    if prev is None:
        found = await asyncio.to_thread(_find_replayed, store, req, principal)
        if found is not None:
            rec, start = found
            new = items_to_messages(list(req.input_items[start:]))
            prompt = await _extend(store, m, principal, rec.id, new, req, start, limit)
            if prompt is not None:
                return prompt
        return await asyncio.to_thread(render_full, m, list(req.messages), req, limit)
    parent = await asyncio.to_thread(store.continuation, principal, prev, req.prompt_cache_key)
    if parent is None:
        raise not_found(prev)
    if _same_setup(parent, req):
        prompt = await _extend(store, m, principal, prev, req.input_messages, req, limit=limit)
        if prompt is not None:
            return prompt
    entries = await asyncio.to_thread(store.history_entries, principal, prev)
    if entries is None:
        raise not_found(prev)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return await asyncio.to_thread(
        render_full, m, system + _history_messages(entries) + list(req.input_messages), req,
        limit)


def unseal_reasoning(req: ResponseRequest, seal, principal: str, tokenizer) -> ResponseRequest:
    """Reasoning items echoed with only their `encrypted_content`: their text comes back from
    the sealed token ids (a blob that does not open is left as it is: empty thinking)."""
    if seal is None or not any(isinstance(x, dict) and x.get("type") == "reasoning"
                               and x.get("encrypted_content") and not reasoning_text(x)
                               for x in req.input_items):
        return req
    items = []
    for x in req.input_items:
        if x.get("type") == "reasoning" and x.get("encrypted_content") and not reasoning_text(x):
            ids = seal.open(principal, x["encrypted_content"])
            if ids is not None:
                end = tokenizer.think_end_id
                ids = ids[:ids.index(end)] if end in ids else ids
                x = dict(x, content=[{"type": "reasoning_text",
                                      "text": tokenizer.decode(ids).strip()}])
        items.append(x)
    system = [{"role": "system", "content": req.instructions}] \
        if req.instructions is not None else []
    return dataclasses.replace(req, input_items=tuple(items),
                               messages=tuple(system + items_to_messages(items)))


def record_for(state: ResponseState, req: ResponseRequest, principal: str,
               prompt: Prompt, tokenizer) -> ResponseRecord:
    items = [dict(it) for it in state.items]
    return ResponseRecord(
        id=state.id, principal=principal, model=state.model, status=state.status,
        input_items=[dict(x) for x in req.input_items[prompt.new_items_from:]],
        output_items=items,
        output_token_ids=split_token_ids(items, list(state.output_ids),
                                         think_end_id=tokenizer.think_end_id,
                                         tool_call_id=tokenizer.tool_call_id),
        created_at=state.created_at,
        # lineage: the response this prompt extends, named by the client or found by replay
        previous_response_id=prompt.parent_id or req.previous_response_id,
        prompt_cache_key=req.prompt_cache_key,
        instructions=req.instructions,
        params={"temperature": req.temperature, "top_p": req.top_p,
                "max_output_tokens": req.max_output_tokens, "metadata": req.metadata,
                "tools": [dict(t) for t in req.tools], "tool_choice": req.tool_choice,
                "parallel_tool_calls": req.parallel_tool_calls,
                "text": {"format": req.text_format},
                "reasoning": {"effort": req.reasoning.effort,
                              "summary": req.reasoning.summary},
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
    p = rec.params
    return {
        "id": rec.id, "object": "response", "created_at": int(rec.created_at),
        "status": rec.status, "error": None,
        "incomplete_details": rec.params.get("incomplete_details"),
        "instructions": rec.instructions, "model": rec.model, "output": rec.output_items,
        "max_output_tokens": rec.params.get("max_output_tokens"),
        "parallel_tool_calls": p.get("parallel_tool_calls", True),
        "previous_response_id": rec.previous_response_id,
        "prompt_cache_key": rec.prompt_cache_key,
        "reasoning": p.get("reasoning") or {"effort": None, "summary": None},
        "store": True, "temperature": p.get("temperature"),
        "top_p": p.get("top_p"), "text": p.get("text") or {"format": {"type": "text"}},
        "tool_choice": p.get("tool_choice", "auto"), "tools": p.get("tools") or [],
        "truncation": "disabled",
        "metadata": rec.params.get("metadata") or {}, "usage": rec.usage, "output_text": text,
    }

# What the Responses routes tell the checkpointer: restore before submit, save after a response
# was stored, and the deletions (a response, a session). Each is a no-op when the server runs
# without a checkpointer (`Runtime.checkpointer`).


async def checkpoint_restore(rt: Runtime, principal: str, session: str | None,
                             prompt) -> str | None:
    """Before submitting: restore the session's checkpoint if its state is not resident.
    A request without a prompt_cache_key is in its parent's session."""
    ck = rt.checkpointer
    if ck is None:
        return None
    if session is None and prompt.parent_id is not None:
        rec = await asyncio.to_thread(rt.response_store.get, principal, prompt.parent_id)
        session = rec.prompt_cache_key if rec is not None else None
    if session is None:
        return None
    try:
        return await asyncio.to_thread(ck.restore_for, principal, session, prompt.ids)
    except Exception as e:  # a restore problem is a miss: the request recomputes
        return f"restore_error:{type(e).__name__}"


async def checkpoint_response_stored(rt: Runtime, principal: str, rec) -> None:
    """After a response was stored: its state is the session head; queue a save."""
    ck = rt.checkpointer
    if ck is None or rec.prompt_cache_key is None:
        return
    seq = await asyncio.to_thread(rt.response_store.token_sequence, principal, rec.id)
    if seq is not None:
        ck.after_response(principal, rec.prompt_cache_key, rec.id,
                          fed_tokens(rec.status, seq))


async def checkpoint_response_deleted(rt: Runtime, principal: str, rec) -> None:
    ck = rt.checkpointer
    if ck is not None and rec is not None:
        await asyncio.to_thread(ck.response_deleted, principal, rec.prompt_cache_key, rec.id)


async def checkpoint_session_purged(rt: Runtime, principal: str, session: str) -> int:
    """Delete the session's checkpoints; the number of generations removed. Before the model
    is loaded (no checkpointer yet) the store itself is purged. Raises OSError."""
    ck = rt.checkpointer
    if ck is not None:
        return await asyncio.to_thread(ck.purge, principal, session)
    if rt.checkpoint_store is not None:
        return await asyncio.to_thread(rt.checkpoint_store.purge, principal, session)
    return 0


PER_PRINCIPAL = 2
INLINE_BYTES = 64 * 1024  # a body this small is parsed on the loop: a thread costs more

_slots: dict[str, asyncio.Semaphore] = {}


@asynccontextmanager
async def work_slot(principal: str):
    """Hold one of the principal's PER_PRINCIPAL slots for heavy request work."""
    sem = _slots.get(principal)
    if sem is None:
        sem = _slots[principal] = asyncio.Semaphore(PER_PRINCIPAL)
    async with sem:
        yield


async def off_loop(fn, *args, size: int | None = None):
    """fn(*args) on a worker thread, or inline when `size` (the input's bytes) is small."""
    if size is not None and size <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
