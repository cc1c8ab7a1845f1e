"""Routes beside the core Responses ones: runtime identity, input token counts, session purge."""
from __future__ import annotations

import asyncio

from sanic import Request, Sanic, response

from server import chains
from server.checkpoints import http as ckpt_http
from server.errors import APIError, not_found
from server.request_model import json_body, parse_response_request

ENGINE_VERSION = "0.1.0"


def _plan_report(plan) -> dict:
    """The engine's effective kernel plan: its preset (or null for a variant), digest and
    fields, and the CUDA ops' library where the plan runs them."""
    out = plan.describe()
    if plan.uses_cuda:
        from engine.kernels.cuda_ops import library_digest

        out["cuda_library"] = library_digest(plan)
    return out


def register(app: Sanic, rt) -> None:
    ckpt_http.register(app, rt)

    @app.get("/v1/ninfer/status")
    async def status(request: Request):
        m, profile = rt.model, rt.profile
        if m is None or rt.engine is None:
            raise APIError(503, "the model is still loading; retry shortly", type="server_error",
                           code="model_loading", headers={"Retry-After": "2"})
        body = {
            "object": "ninfer.status", "engine_version": ENGINE_VERSION,
            "model": {"id": m.model_id, "artifact_sha256": m.sha256,
                      "config_hash": m.cfg.canonical_hash()},
            "lane": None if profile is None else {
                "name": profile.name, "profile_sha256": profile.canonical_hash(),
                "kv_dtype": profile.kv_dtype, "kv_capacity_tokens": profile.kv_capacity_tokens,
                "context_tokens": profile.context_tokens,
                "max_concurrency": profile.max_concurrency,
                "prefill_chunk": profile.prefill_chunk},
            "plan": _plan_report(rt.engine.plan),
            "memory": rt.engine.mem.stats(),
        }
        return response.json(body)

    @app.post("/v1/responses/input_tokens")
    async def input_tokens(request: Request):
        body = json_body(request.body)
        if isinstance(body, dict):
            body = {"stream": False, **body}
        req = parse_response_request(body)
        m = rt.model
        if m is None:
            raise APIError(503, "the model is still loading; retry shortly", type="server_error",
                           code="model_loading", headers={"Retry-After": "2"})
        prompt = await chains.build_prompt(rt.response_store, m, req, request.ctx.principal)
        return response.json({"object": "response.input_tokens",
                              "input_tokens": len(prompt.ids)})

    @app.delete("/v1/ninfer/sessions/<key:str>")
    async def purge_session(request: Request, key: str):
        principal = request.ctx.principal
        n = await asyncio.to_thread(rt.response_store.purge_session, principal, key)
        if rt.engine is not None:
            rt.engine.forget_session(principal, key)
        await ckpt_http.session_purged(rt, principal, key)
        if n == 0:
            raise not_found(f"No session '{key}'.")
        return response.json({"object": "ninfer.session", "deleted": True, "responses": n})
