"""The HTTP surface: a Sanic app speaking the OpenAI Responses API over loopback.

Everything but `GET /health` requires a bearer key. The engine runs on its own thread; a request
hands it a GenerationRequest and receives token events back on this event loop through a queue.
"""
from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass, field

from sanic import Request, Sanic, response

from engine.engine import DoneEvent, Engine, GenerationRequest, QueueFull, TokenEvent
from engine.loader import LoadedModel
from engine.sampling import SamplingParams
from server import chains, routes_extra
from server.auth import KeyRing
from server.store import InvalidCursor, ResponseStore
from server.errors import APIError, invalid, not_found, unauthorized
from server.observability import Metrics, Observability, RequestTrace
from server.request_model import ResponseRequest, parse_response_request
from server.response_objects import EventStream, ResponseState, new_id

MAX_BODY_BYTES = 32 * 1024 * 1024
PUBLIC_ROUTES = {"/health"}


@dataclass
class Runtime:
    """What the routes need; `engine` and `model` stay None while the model loads."""
    keys: KeyRing
    max_output_tokens: int
    context_tokens: int
    store: ResponseStore | None = None
    engine: Engine | None = None
    model: LoadedModel | None = None
    load_error: str | None = None
    extra: dict = field(default_factory=dict)
    obs: Observability = field(default_factory=lambda: Observability(Metrics()))


def create_app(rt: Runtime, name: str = "ninfer") -> Sanic:
    app = Sanic(name)
    app.config.REQUEST_MAX_SIZE = MAX_BODY_BYTES
    app.config.KEEP_ALIVE_TIMEOUT = 75
    app.config.FALLBACK_ERROR_FORMAT = "json"
    app.ctx.rt = rt

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

    @app.get("/health")
    async def health(request):
        if rt.engine is None:
            return response.json({"status": "loading"}, status=503)
        return response.json({"status": "ok"})

    routes_extra.register(app, rt)

    @app.get("/metrics")
    async def metrics(request):
        body, ctype = rt.obs.metrics.render()
        return response.raw(body, content_type=ctype)

    @app.get("/v1/models")
    async def models(request):
        m = _require_model(rt)
        return response.json({"object": "list", "data": [
            {"id": m.model_id, "object": "model", "created": 0, "owned_by": "ninfer"}]})

    @app.post("/v1/responses")
    async def create_response(request: Request):
        trace = request.ctx.trace = rt.obs.new_request(request.ctx.principal, new_id("resp"))
        try:
            body = json.loads(request.body or b"null")
        except (ValueError, UnicodeDecodeError):
            raise invalid("the request body is not valid JSON")
        req = parse_response_request(body)
        m = _require_model(rt)
        if req.model != m.model_id:
            raise not_found(f"The model '{req.model}' does not exist; this server serves "
                            f"'{m.model_id}'.", code="model_not_found")
        principal = request.ctx.principal
        prompt = await chains.build_prompt(rt.store, m, req, principal)
        prompt_ids, boundary = prompt.ids, prompt.boundary
        budget = rt.context_tokens - len(prompt_ids)
        if budget < 1:
            raise invalid(f"This model's maximum context length is {rt.context_tokens} tokens; "
                          f"the input is {len(prompt_ids)} tokens (context_length_exceeded).",
                          param="input", code="context_length_exceeded")
        max_tokens = min(req.max_output_tokens or rt.max_output_tokens, budget)
        state = ResponseState(id=trace.request_id, model=m.model_id, max_output_tokens=req.max_output_tokens,
                              temperature=req.temperature, top_p=req.top_p,
                              instructions=req.instructions, metadata=req.metadata,
                              previous_response_id=req.previous_response_id,
                              store=req.store, prompt_cache_key=req.prompt_cache_key,
                              input_tokens=len(prompt_ids))
        rt.obs.on_request_start(trace, session=req.prompt_cache_key, stream=req.stream,
                                prompt_tokens=len(prompt_ids), max_output_tokens=max_tokens,
                                store=req.store)
        gen, events = _submit(rt.engine, m, req, prompt_ids, max_tokens,
                              principal=principal, boundary=boundary)

        async def persist():  # before the terminal event: a client may chain on it at once
            if req.store and state.status in ("completed", "incomplete"):
                rec = chains.record_for(state, req, principal, prompt)
                await asyncio.to_thread(rt.store.put_response, rec)

        try:
            first = await events.get()  # errors before the first token get a plain HTTP error
            if isinstance(first, DoneEvent) and first.finish_reason == "queue_timeout":
                rt.obs.on_request_done(trace, first)
            _raise_if_rejected(first)
            source = _Events(events, first, trace, rt.obs)
            if req.stream:
                return await _stream(request, state, gen, source, m, persist)
            await _collect(state, source, m)
            await persist()
        finally:
            gen.cancelled.set()  # a no-op when finished; frees the engine if the client left
            if not trace.finished:  # the client left before the DoneEvent was read
                rt.obs.on_request_abandoned(trace, output_tokens=state.output_tokens)
        return response.json(state.to_dict())

    @app.get("/v1/responses/<response_id:str>")
    async def get_response(request: Request, response_id: str):
        rec = await asyncio.to_thread(rt.store.get, request.ctx.principal, response_id)
        if rec is None:
            raise not_found(f"No response found with id '{response_id}'.")
        return response.json(chains.response_from_record(rec))

    @app.delete("/v1/responses/<response_id:str>")
    async def delete_response(request: Request, response_id: str):
        principal = request.ctx.principal
        rec = await asyncio.to_thread(rt.store.get, principal, response_id)
        seq = await asyncio.to_thread(rt.store.token_sequence, principal, response_id)
        if rec is None or not await asyncio.to_thread(rt.store.delete, principal, response_id):
            raise not_found(f"No response found with id '{response_id}'.")
        if seq is not None and rt.engine is not None:  # its model state goes too
            rt.engine.forget(principal, chains.fed_tokens(rec.status, seq))
        return response.json({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/responses/<response_id:str>/input_items")
    async def input_items(request: Request, response_id: str):
        args = request.args
        try:
            limit = int(args.get("limit", "20"))
        except ValueError:
            raise invalid("'limit' must be an integer between 1 and 100", param="limit")
        try:
            page = await asyncio.to_thread(
                rt.store.list_input_items, request.ctx.principal, response_id,
                args.get("after"), limit, args.get("order", "desc"))
        except InvalidCursor:
            raise invalid(f"No input item with id '{args.get('after')}'.", param="after")
        except ValueError as e:
            raise invalid(str(e), param="limit" if "limit" in str(e) else "order")
        if page is None:
            raise not_found(f"No response found with id '{response_id}'.")
        return response.json(page)

    return app


def _trace(request: Request, obs: Observability) -> RequestTrace:
    trace = getattr(request.ctx, "trace", None)
    return trace or obs.new_request(getattr(request.ctx, "principal", None))


def _require_model(rt: Runtime) -> LoadedModel:
    if rt.engine is None or rt.model is None:
        raise APIError(503, "the model is still loading; retry shortly", type="server_error",
                       code="model_loading", headers={"Retry-After": "2"})
    return rt.model


def _submit(engine: Engine, m: LoadedModel, req: ResponseRequest, prompt_ids, max_tokens, *,
            principal: str, boundary: int):
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    sampling = SamplingParams(temperature=req.temperature, top_p=max(req.top_p, 1e-6),
                              top_k=0, seed=secrets.randbits(31))
    gen = GenerationRequest(prompt_ids=prompt_ids, sampling=sampling, max_tokens=max_tokens,
                            stop_ids=frozenset(m.tokenizer.eos_ids), principal=principal,
                            session=req.prompt_cache_key,
                            prefix_boundary=boundary,
                            emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    try:
        engine.submit(gen)
    except QueueFull:
        raise APIError(429, "The server is overloaded: too many requests are waiting. Retry "
                       "shortly.", type="server_error", code="server_overloaded",
                       headers={"Retry-After": "2"}) from None
    return gen, events


def _raise_if_rejected(ev) -> None:
    if isinstance(ev, DoneEvent) and ev.finish_reason == "queue_timeout":
        raise APIError(503, f"The request waited {ev.queue_s:.0f}s in the queue without being "
                       "scheduled.", type="server_error", code="request_queue_timeout",
                       headers={"Retry-After": "5"})


class _Events:
    """The engine's events for one request, with the already-received first one in front."""

    def __init__(self, queue: asyncio.Queue, first, trace: RequestTrace, obs: Observability):
        self.queue, self.first, self.trace, self.obs = queue, first, trace, obs

    async def get(self):
        if self.first is not None:
            ev, self.first = self.first, None
        else:
            ev = await self.queue.get()
        if isinstance(ev, TokenEvent):
            self.trace.mark_first_token()
        elif isinstance(ev, DoneEvent):
            self.obs.on_request_done(self.trace, ev)
        return ev


async def _next_text(events: _Events, decoder, state: ResponseState):
    """The next piece of text, or a DoneEvent when generation ended."""
    while True:
        ev = await events.get()
        if isinstance(ev, TokenEvent):
            state.output_tokens += 1
            state.output_ids.append(ev.token_id)
            piece = decoder.push(ev.token_id)
            if piece:
                return piece
            continue
        return ev


def _finish(state: ResponseState, done: DoneEvent) -> None:
    state.cached_tokens = done.cached_tokens
    if done.finish_reason == "error":
        raise APIError(500, "generation failed", type="server_error", code="server_error")
    if done.finish_reason == "stop":
        state.status = "completed"
    else:
        state.status = "incomplete"
        state.incomplete_reason = "max_output_tokens"


async def _collect(state: ResponseState, events, m: LoadedModel) -> None:
    decoder = m.tokenizer.stream_decoder()
    while True:
        item = await _next_text(events, decoder, state)
        if isinstance(item, DoneEvent):
            state.text += decoder.flush()
            _finish(state, item)
            return
        state.text += item


async def _stream(request: Request, state: ResponseState, gen, events, m: LoadedModel,
                  persist):
    resp = await request.respond(content_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    es = EventStream(state)
    decoder = m.tokenizer.stream_decoder()
    try:
        for frame in es.opening():
            await resp.send(frame)
        while True:
            item = await _next_text(events, decoder, state)
            if isinstance(item, DoneEvent):
                tail = decoder.flush()
                if tail:
                    state.text += tail
                    await resp.send(es.delta(tail))
                try:
                    _finish(state, item)
                except APIError as e:
                    await resp.send(es.failed(e.message))
                    break
                await persist()
                for frame in es.closing():
                    await resp.send(frame)
                break
            state.text += item
            await resp.send(es.delta(item))
    finally:
        gen.cancelled.set()
    await resp.eof()
    return resp
