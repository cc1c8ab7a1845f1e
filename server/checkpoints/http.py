"""The HTTP side of checkpoints: `POST /v1/ninfer/checkpoints`, the drain gate, and the small
hooks the Responses routes call (restore before submit, save after persist, deletions).

Every hook is a no-op when the server runs without a checkpointer (`Runtime.checkpointer`).
"""
from __future__ import annotations

import asyncio
import json

from sanic import Request, Sanic, response

from server import chains
from server.errors import APIError, invalid


def register(app: Sanic, rt) -> None:
    @app.on_request
    async def refuse_while_draining(request: Request):
        if rt.draining and request.method == "POST" and request.path == "/v1/responses":
            raise APIError(503, "the server is draining for a stop; retry after it restarts",
                           type="server_error", code="server_draining",
                           headers={"Retry-After": "5"})

    @app.post("/v1/ninfer/checkpoints")
    async def save_checkpoints(request: Request):
        ck = rt.checkpointer
        if ck is None or ck.engine is None:
            raise APIError(503, "checkpoints are not available", type="server_error",
                           code="checkpoints_unavailable")
        try:
            body = json.loads(request.body or b"{}")
        except (ValueError, UnicodeDecodeError):
            raise invalid("the request body is not valid JSON")
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        session = body.get("prompt_cache_key")
        if session is not None and not isinstance(session, str):
            raise invalid("'prompt_cache_key' must be a string", param="prompt_cache_key")
        results = await asyncio.to_thread(ck.save, request.ctx.principal, session)
        return response.json({"object": "ninfer.checkpoints", "data": results})


async def restore(rt, principal: str, session: str | None, prompt) -> str | None:
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


async def response_stored(rt, principal: str, rec) -> None:
    """After a response was stored: its state is the session head; queue a save."""
    ck = rt.checkpointer
    if ck is None or rec.prompt_cache_key is None:
        return
    seq = await asyncio.to_thread(rt.response_store.token_sequence, principal, rec.id)
    if seq is not None:
        ck.after_response(principal, rec.prompt_cache_key, rec.id,
                          chains.fed_tokens(rec.status, seq))


async def response_deleted(rt, principal: str, rec) -> None:
    ck = rt.checkpointer
    if ck is not None and rec is not None:
        await asyncio.to_thread(ck.response_deleted, principal, rec.prompt_cache_key, rec.id)


async def session_purged(rt, principal: str, session: str) -> None:
    ck = rt.checkpointer
    if ck is not None:
        await asyncio.to_thread(ck.purge, principal, session)
