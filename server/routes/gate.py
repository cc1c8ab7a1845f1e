"""What every request passes: the bearer key check (every path but `PUBLIC_ROUTES`), the drain
gate, and the error handlers that answer any failure in the API's error format."""
from __future__ import annotations

import ipaddress

from sanic import Request, Sanic

from server.errors import APIError, unauthorized
from server.observability import Observability, RequestTrace
from server.runtime import Runtime
from server.storage_faults import storage_error

PUBLIC_ROUTES = {"/health"}
# The longest request target (path and query) served; no route needs more than a session key
# (512 bytes, up to three times that percent-encoded) after its prefix.
MAX_URL_BYTES = 4096


def _trace(request: Request, obs: Observability) -> RequestTrace:
    trace = getattr(request.ctx, "trace", None)
    return trace or obs.new_request(getattr(request.ctx, "principal", None))


def loopback_host(host: str) -> bool:
    """Whether a Host header names this machine's loopback: localhost, 127.0.0.0/8 or ::1,
    with or without a port. Anything else is a name that resolved here from outside (DNS
    rebinding: a web page's script reaching a loopback server) and is refused."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:port
        name = host[1:host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        name = host.split(":", 1)[0]
    else:
        name = host
    if name in ("localhost", "localhost.", "::1"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def register(app: Sanic, rt: Runtime) -> None:
    @app.on_request
    async def url_length(request: Request):
        if len(request.raw_url) > MAX_URL_BYTES:
            rt.obs.on_request_rejected(rt.obs.new_request(None), 414, "uri_too_long")
            return APIError(414, f"the request URL is longer than {MAX_URL_BYTES} bytes",
                            code="uri_too_long").to_response()
        return None

    @app.on_request
    async def loopback_names_only(request: Request):
        if not loopback_host(request.headers.get("host", "")):
            rt.obs.on_request_rejected(rt.obs.new_request(None), 400, "host_not_allowed")
            return APIError(400, "the Host header must name this machine's loopback "
                                 "(localhost, 127.0.0.1 or [::1]); this server is not reachable "
                                 "by other names", code="host_not_allowed").to_response()
        return None

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
        fault = storage_error(rt.obs, "responses", exc, "reading or writing the response store")
        if fault is not None:  # named, on stderr and in the metrics: not an opaque 500
            rt.obs.on_request_error(_trace(request, rt.obs), status=fault.status,
                                    code=fault.code, error_type=type(exc).__name__)
            return fault.to_response()
        status = getattr(exc, "status_code", 500) or 500
        message = str(exc) if status < 500 else "internal server error"
        kind = "invalid_request_error" if status < 500 else "server_error"
        if status >= 500:
            rt.obs.on_request_error(_trace(request, rt.obs), status=status,
                                    error_type=type(exc).__name__)
        else:
            rt.obs.on_request_rejected(_trace(request, rt.obs), status, None)
        return APIError(status, message, type=kind).to_response()
