"""What every request passes: the bearer key check (every path but `PUBLIC_ROUTES`), the drain
gate, and the error handlers that answer any failure in the API's error format."""
from __future__ import annotations

from sanic import Request, Sanic

from server.errors import APIError, unauthorized
from server.observability import Observability, RequestTrace
from server.runtime import Runtime

PUBLIC_ROUTES = {"/health"}


def _trace(request: Request, obs: Observability) -> RequestTrace:
    trace = getattr(request.ctx, "trace", None)
    return trace or obs.new_request(getattr(request.ctx, "principal", None))


def register(app: Sanic, rt: Runtime) -> None:
    @app.on_request
    async def authenticate(request: Request):
        if request.path in PUBLIC_ROUTES:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        principal = rt.keys.principal_for(token.strip()) if scheme.lower() == "bearer" else None
        if principal is None:
            rt.obs.on_request_rejected(rt.obs.new_request(None), 401, "invalid_api_key")
            return unauthorized().to_response()
        request.ctx.principal = principal
        return None

    @app.on_request
    async def refuse_while_draining(request: Request):
        if rt.draining and request.method == "POST" and request.path == "/v1/responses":
            raise APIError(503, "the server is draining for a stop; retry after it restarts",
                           type="server_error", code="server_draining",
                           headers={"Retry-After": "5"})

    @app.exception(APIError)
    async def api_error(request, exc: APIError):
        rt.obs.on_request_rejected(_trace(request, rt.obs), exc.status, exc.code)
        return exc.to_response()

    @app.exception(Exception)
    async def other_error(request, exc: Exception):
        status = getattr(exc, "status_code", 500) or 500
        message = str(exc) if status < 500 else "internal server error"
        kind = "invalid_request_error" if status < 500 else "server_error"
        if status >= 500:
            rt.obs.on_request_error(_trace(request, rt.obs), status=status,
                                    error_type=type(exc).__name__)
        else:
            rt.obs.on_request_rejected(_trace(request, rt.obs), status, None)
        return APIError(status, message, type=kind).to_response()
