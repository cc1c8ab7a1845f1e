"""What the Responses routes tell the checkpointer: restore before submit, save after a response
was stored, and the deletions (a response, a session).

Every hook is a no-op when the server runs without a checkpointer (`Runtime.checkpointer`).
"""
from __future__ import annotations

import asyncio

from server import chains
from server.runtime import Runtime


async def restore(rt: Runtime, principal: str, session: str | None, prompt) -> str | None:
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


async def response_stored(rt: Runtime, principal: str, rec) -> None:
    """After a response was stored: its state is the session head; queue a save."""
    ck = rt.checkpointer
    if ck is None or rec.prompt_cache_key is None:
        return
    seq = await asyncio.to_thread(rt.response_store.token_sequence, principal, rec.id)
    if seq is not None:
        ck.after_response(principal, rec.prompt_cache_key, rec.id,
                          chains.fed_tokens(rec.status, seq))


async def response_deleted(rt: Runtime, principal: str, rec) -> None:
    ck = rt.checkpointer
    if ck is not None and rec is not None:
        await asyncio.to_thread(ck.response_deleted, principal, rec.prompt_cache_key, rec.id)


async def session_purged(rt: Runtime, principal: str, session: str) -> int:
    """Delete the session's checkpoints; the number of generations removed. Before the model
    is loaded (no checkpointer yet) the store itself is purged. Raises OSError."""
    ck = rt.checkpointer
    if ck is not None:
        return await asyncio.to_thread(ck.purge, principal, session)
    if rt.checkpoint_store is not None:
        return await asyncio.to_thread(rt.checkpoint_store.purge, principal, session)
    return 0
