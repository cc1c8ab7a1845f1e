"""The HTTP surface: a Sanic app speaking the OpenAI Responses API over loopback.

Everything but `GET /health` requires a bearer key. `create_app` sets the limits and registers
the route families of server/routes/ on one `Runtime` (server/runtime.py); a request's engine
side is server/generation.py.
"""
from __future__ import annotations

from sanic import Sanic

from server.routes import chat, gate, responses, service, sessions
from server.runtime import Runtime

MAX_BODY_BYTES = 32 * 1024 * 1024


def create_app(rt: Runtime, name: str = "ninfer") -> Sanic:
    app = Sanic(name)
    app.config.REQUEST_MAX_SIZE = MAX_BODY_BYTES
    app.config.KEEP_ALIVE_TIMEOUT = 75
    # A long prompt on a slow lane can take minutes before its first token, and a long answer
    # more: Sanic's 60 s default would cut a legitimate response. The engine's own limits
    # (context, max_output_tokens, queue timeout) bound a request.
    app.config.RESPONSE_TIMEOUT = 6 * 3600
    app.config.FALLBACK_ERROR_FORMAT = "json"
    app.ctx.rt = rt
    for family in (gate, service, responses, chat, sessions):
        family.register(app, rt)
    return app
