"""The server itself: `GET /health` (no key), `/metrics`, `/v1/models` and
`/v1/ninfer/status` (the runtime's identity: model, lane, kernel plan, memory).

Per-principal views: another principal's activity is nobody else's business (its request
counts, tokens and timings, and through the shared pools when it runs). `/metrics` shows a
principal its own request figures and `/v1/ninfer/status` its own requests in flight; the
whole server's figures (every principal's, the engine's memory and pools, checkpoints, storage
faults) only to a principal the key file marks `admin` (server/auth.py)."""
from __future__ import annotations

import functools

from sanic import Request, Sanic, response

from server.generation import require_model
from server.observability import principal_digest
from server.runtime import Runtime

ENGINE_VERSION = "0.1.0"


def _plan_report(plan) -> dict:
    """The engine's effective kernel plan: its preset (or null for a variant), digest and
    fields, and the CUDA ops' library where the plan runs them."""
    out = plan.describe()
    if plan.uses_cuda:
        from engine.kernels.cuda_ops import library_digest

        out["cuda_library"] = library_digest(plan)
    return out


def register(app: Sanic, rt: Runtime) -> None:
    @app.get("/health")
    async def health(request):
        if rt.engine is None:
            return response.json({"status": "loading"}, status=503)
        return response.json({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request):
        principal = request.ctx.principal
        own = None if rt.keys.sees_all(principal) else principal_digest(principal)
        body, ctype = rt.obs.metrics.render(own)
        return response.raw(body, content_type=ctype)

    @app.get("/v1/models")
    async def models(request):
        m = require_model(rt)
        return response.json({"object": "list", "data": [
            {"id": m.model_id, "object": "model", "created": 0, "owned_by": "ninfer"}]})

    @app.get("/v1/ninfer/status")
    async def status(request: Request):
        m, profile = require_model(rt), rt.profile
        body = {
            "object": "ninfer.status", "engine_version": ENGINE_VERSION,
            "model": {"id": m.model_id, "artifact_sha256": m.sha256,
                      "config_hash": m.cfg.canonical_hash(),
                      "synthetic_weights": rt.synthetic_weights},
            "lane": None if profile is None else {
                "name": profile.name, "profile_sha256": profile.canonical_hash(),
                "kv_dtype": profile.kv_dtype, "kv_capacity_tokens": profile.kv_capacity_tokens,
                "context_tokens": profile.context_tokens,
                "max_concurrency": profile.max_concurrency,
                "prefill_chunk": profile.prefill_chunk},
            "plan": _plan_report(rt.engine.plan),
            "principal": _principal_view(rt, request.ctx.principal),
        }
        if body["principal"]["sees_all"]:
            body["memory"] = rt.engine.memory_stats()
            body["device_memory"] = _device_memory(profile)
        return response.json(body)


def _principal_view(rt: Runtime, principal: str) -> dict:
    """What the status shows of the caller itself: its responses being generated and its
    request counts by outcome (the whole server's only with `sees_all`)."""
    sees_all = rt.keys.sees_all(principal)
    mine = rt.obs.metrics.all if sees_all else rt.obs.metrics.view(principal_digest(principal))
    counts = {s.labels["outcome"]: int(s.value) for f in mine.requests.collect()
              for s in f.samples if s.name.endswith("_total")}
    return {"name": principal, "sees_all": sees_all,
            "in_flight": sum(1 for f in rt.inflight.values()
                             if sees_all or f.principal == principal),
            "requests": counts}


def _device_memory(profile) -> dict | None:
    """The planner's device figure beside what the device reports (a GPU lane), or None."""
    if profile is None or not profile.gpu:
        return None
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    planned, budget = _planned(profile)
    return {"planned_bytes": planned, "budget_bytes": budget,
            "bytes_in_use": stats.get("bytes_in_use"),
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "bytes_limit": stats.get("bytes_limit")}


@functools.cache
def _planned(profile) -> tuple[int, int | None]:
    """(device bytes, device budget) of the lane's memory plan: computed once per profile."""
    from lanes.planner import plan_lane

    plan = plan_lane(profile)
    return plan.total("device"), plan.device_budget
