"""A principal's sessions: `DELETE /v1/ninfer/sessions/{key}` (its stored responses, the
engine's states and its checkpoints) and `POST /v1/ninfer/checkpoints` (save now)."""
from __future__ import annotations

import asyncio
from urllib.parse import unquote

from sanic import Request, Sanic, response

from server import chains
from server.errors import APIError, invalid, not_found
from server.request_model import MAX_SESSION_KEY_BYTES, json_body
from server.runtime import Runtime
from server.storage_faults import storage_error


def register(app: Sanic, rt: Runtime) -> None:
    @app.delete("/v1/ninfer/sessions/<key:path>")
    async def purge_session(request: Request, key: str):
        # the key as the client wrote it in the body's prompt_cache_key, percent-encoded in
        # the path: decoded here from the raw path (any byte, '/' included, may be encoded)
        raw = request.raw_url.decode("latin-1").split("?", 1)[0]
        key = raw[len("/v1/ninfer/sessions/"):]
        try:
            key = unquote(key, errors="strict")
        except UnicodeDecodeError:
            raise invalid("the session key is not percent-encoded UTF-8",
                          param="prompt_cache_key") from None
        if not key or len(key.encode()) > MAX_SESSION_KEY_BYTES:
            raise invalid(f"a session key is 1 to {MAX_SESSION_KEY_BYTES} bytes of UTF-8",
                          param="prompt_cache_key")
        principal = request.ctx.principal
        # Ordered so that a retry completes a purge a storage fault interrupted: the model
        # states and the checkpoint files go first, the stored responses (what makes the
        # session exist) last, in one transaction. A failure before that leaves the responses
        # and answers 5xx; the retry finds the session and finishes.
        if rt.engine is not None:
            rt.engine.forget_session(principal, key)
        try:
            gens = await chains.checkpoint_session_purged(rt, principal, key)
        except OSError as e:
            raise storage_error(rt.obs, "checkpoints", e, "purging the session's checkpoints",
                                "Its stored responses were kept; retry the purge.") from None
        n = await asyncio.to_thread(rt.response_store.purge_session, principal, key)
        if n == 0 and not gens:
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
