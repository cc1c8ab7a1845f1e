"""A principal's sessions: `DELETE /v1/ninfer/sessions/{key}` (its stored responses, the
engine's states and its checkpoints) and `POST /v1/ninfer/checkpoints` (save now)."""
from __future__ import annotations

import asyncio

from sanic import Request, Sanic, response

from server.checkpoints import hooks as checkpoint_hooks
from server.errors import APIError, invalid, not_found
from server.request_fields import json_body
from server.runtime import Runtime


def register(app: Sanic, rt: Runtime) -> None:
    @app.delete("/v1/ninfer/sessions/<key:str>")
    async def purge_session(request: Request, key: str):
        principal = request.ctx.principal
        n = await asyncio.to_thread(rt.response_store.purge_session, principal, key)
        if rt.engine is not None:
            rt.engine.forget_session(principal, key)
        await checkpoint_hooks.session_purged(rt, principal, key)
        if n == 0:
            raise not_found(f"No session '{key}'.")
        return response.json({"object": "ninfer.session", "deleted": True, "responses": n})

    @app.post("/v1/ninfer/checkpoints")
    async def save_checkpoints(request: Request):
        ck = rt.checkpointer
        if ck is None or ck.engine is None:
            raise APIError(503, "checkpoints are not available", type="server_error",
                           code="checkpoints_unavailable")
        body = json_body(request.body or b"{}")
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        session = body.get("prompt_cache_key")
        if session is not None and not isinstance(session, str):
            raise invalid("'prompt_cache_key' must be a string", param="prompt_cache_key")
        results = await asyncio.to_thread(ck.save, request.ctx.principal, session)
        return response.json({"object": "ninfer.checkpoints", "data": results})
