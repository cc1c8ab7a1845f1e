"""The HTTP surface: a Sanic app speaking the OpenAI Responses API over loopback.

Everything but `GET /health` requires a bearer key. The engine runs on its own thread; a request
hands it a GenerationRequest and receives token events back on this event loop through a queue.
"""
from __future__ import annotations

import asyncio
import functools
import secrets
import sys
from dataclasses import dataclass, field

from sanic import Request, Sanic, response

from engine.engine import (DoneEvent, Engine, GenerationRequest, PromptTooLong, QueueFull,
                           TokenEvent)
from engine.io.loader import LoadedModel
from engine.runtime.sampling import SamplingParams
from server import chains, chat_completions, routes_extra
from server.checkpoints import http as ckpt_http
from server.response_store import InvalidCursor
from server.errors import APIError, invalid, not_found, unauthorized
from server.observability import Observability, RequestTrace
from server.request_model import ResponseRequest, json_body, parse_response_request
from server.output_items import OutputAssembler
from server.response_objects import EventStream, ResponseState, new_id
from server.runtime import Runtime

MAX_BODY_BYTES = 32 * 1024 * 1024
PUBLIC_ROUTES = {"/health"}


@dataclass
class _InFlight:
    principal: str
    gen: GenerationRequest
    state: ResponseState
    ended: asyncio.Event = field(default_factory=asyncio.Event)


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

    @app.before_server_start
    async def start_retention(app_, _loop):
        if rt.response_store is not None and any(rt.retention):
            app_.add_task(_retention_loop(rt), name="ninfer-retention")

    @app.get("/health")
    async def health(request):
        if rt.engine is None:
            return response.json({"status": "loading"}, status=503)
        return response.json({"status": "ok"})

    routes_extra.register(app, rt)

    async def stateless(request: Request, req: ResponseRequest) -> "_Run":
        trace = request.ctx.trace = rt.obs.new_request(request.ctx.principal, new_id("resp"))
        m = _require_model(rt)
        if req.model != m.model_id:
            raise not_found(f"The model '{req.model}' does not exist; this server serves "
                            f"'{m.model_id}'.", code="model_not_found")
        prompt = chains.render_full(m, list(req.messages), req)
        return await _Run.begin(rt, m, req, trace, request.ctx.principal, prompt)

    chat_completions.register(app, rt, stateless)

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
        body = json_body(request.body)
        req = parse_response_request(body)
        m = _require_model(rt)
        if req.model != m.model_id:
            raise not_found(f"The model '{req.model}' does not exist; this server serves "
                            f"'{m.model_id}'.", code="model_not_found")
        principal = request.ctx.principal
        req = chains.unseal_reasoning(req, rt.seal, principal, m.tokenizer)
        prompt = await chains.build_prompt(rt.response_store, m, req, principal)
        trace.checkpoint = await ckpt_http.restore(rt, principal, req.prompt_cache_key, prompt)
        run = await _Run.begin(rt, m, req, trace, principal, prompt)
        state = run.state

        async def persist():  # before the terminal event: a client may chain on it at once
            if req.store and state.status in ("completed", "incomplete", "cancelled"):
                rec = chains.record_for(state, req, principal, prompt, m.tokenizer)
                await asyncio.to_thread(rt.response_store.put_response, rec)
                await ckpt_http.response_stored(rt, principal, rec)

        try:
            if req.stream:
                return await _stream(request, run, persist)
            await run.complete(None)
            await persist()
        finally:
            run.close()
        return response.json(state.to_dict())

    @app.get("/v1/responses/<response_id:str>")
    async def get_response(request: Request, response_id: str):
        rec = await asyncio.to_thread(rt.response_store.get, request.ctx.principal, response_id)
        if rec is None:
            raise not_found(f"No response found with id '{response_id}'.")
        return response.json(chains.response_from_record(rec))

    @app.delete("/v1/responses/<response_id:str>")
    async def delete_response(request: Request, response_id: str):
        principal = request.ctx.principal
        store = rt.response_store
        rec = await asyncio.to_thread(store.get, principal, response_id)
        seq = await asyncio.to_thread(store.token_sequence, principal, response_id)
        if rec is None or not await asyncio.to_thread(store.delete, principal, response_id):
            raise not_found(f"No response found with id '{response_id}'.")
        if seq is not None and rt.engine is not None:  # its model state goes too
            rt.engine.forget(principal, chains.fed_tokens(rec.status, seq))
        await ckpt_http.response_deleted(rt, principal, rec)
        return response.json({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/<response_id:str>/cancel")
    async def cancel_response(request: Request, response_id: str):
        """Stop a response still being generated: it ends with status `cancelled` (its stream
        with a response.incomplete event) and keeps what it produced. Cancelling a finished
        response changes nothing and returns it as stored."""
        principal = request.ctx.principal
        flight = rt.inflight.get(response_id)
        if flight is not None and flight.principal == principal:
            flight.gen.cancelled.set()
            try:
                await asyncio.wait_for(flight.ended.wait(), timeout=30)
            except asyncio.TimeoutError:
                pass
            return response.json(flight.state.to_dict())
        rec = await asyncio.to_thread(rt.response_store.get, principal, response_id)
        if rec is None:
            raise not_found(f"No response found with id '{response_id}'.")
        return response.json(chains.response_from_record(rec))

    @app.get("/v1/responses/<response_id:str>/input_items")
    async def input_items(request: Request, response_id: str):
        args = request.args
        try:
            limit = int(args.get("limit", "20"))
        except ValueError:
            raise invalid("'limit' must be an integer between 1 and 100", param="limit")
        try:
            page = await asyncio.to_thread(
                rt.response_store.list_input_items, request.ctx.principal, response_id,
                args.get("after"), limit, args.get("order", "desc"))
        except InvalidCursor:
            raise invalid(f"No input item with id '{args.get('after')}'.", param="after")
        except ValueError as e:
            raise invalid(str(e), param="limit" if "limit" in str(e) else "order")
        if page is None:
            raise not_found(f"No response found with id '{response_id}'.")
        return response.json(page)

    return app


RETENTION_INTERVAL_S = 3600.0


async def _retention_loop(rt: Runtime) -> None:
    """The store's retention limits, applied at start and then every hour (off the loop)."""
    max_responses, max_age_s = rt.retention
    while True:
        n = await asyncio.to_thread(rt.response_store.prune, max_responses, max_age_s)
        if n:
            print(f"ninfer: retention removed {n} stored responses", file=sys.stderr,
                  flush=True)
        await asyncio.sleep(RETENTION_INTERVAL_S)


def _trace(request: Request, obs: Observability) -> RequestTrace:
    trace = getattr(request.ctx, "trace", None)
    return trace or obs.new_request(getattr(request.ctx, "principal", None))


def _require_model(rt: Runtime) -> LoadedModel:
    if rt.engine is None or rt.model is None:
        raise APIError(503, "the model is still loading; retry shortly", type="server_error",
                       code="model_loading", headers={"Retry-After": "2"})
    return rt.model


# Thinking budget per reasoning effort, in tokens (capped to leave room for the answer).
THINKING_BUDGET = {"low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}
_compiler_lock = asyncio.Lock()


async def _constraint(rt: Runtime, m: LoadedModel, req: ResponseRequest, max_tokens: int):
    """The request's token constraint (engine/constrain), or None when it needs none: no tool
    call under tool_choice none, a call (valid for its schema) under required or a named
    function, schema-valid JSON for text.format, and `</think>` forced at the thinking budget."""
    thinking = req.reasoning.thinking
    needs = (thinking or req.tool_choice != "auto" or req.text_format.get("type") != "text"
             or (not req.parallel_tool_calls and req.tools))
    if not needs:
        return None
    if rt.constraints is None:  # a runtime built without the loader (tests): build it once
        async with _compiler_lock:
            if rt.constraints is None:
                from engine.constrain.compiler import ConstraintCompiler

                rt.constraints = await asyncio.to_thread(ConstraintCompiler, m.tokenizer)
    from engine.constrain.compiler import ConstraintError

    budget = None
    if thinking:  # leave at least a quarter of the output budget for the answer
        budget = min(THINKING_BUDGET.get(req.reasoning.effort, 4096),
                     max(0, max_tokens - max(16, max_tokens // 4)))
    try:
        return await asyncio.to_thread(
            rt.constraints.compile, tools=list(req.tools), tool_choice=req.tool_choice,
            text_format=req.text_format, thinking=thinking, thinking_budget=budget,
            parallel_tool_calls=req.parallel_tool_calls)
    except ConstraintError as e:
        param = "text.format" if req.text_format.get("type") != "text" else "tool_choice"
        raise invalid(f"this request cannot be constrained: {e}", param=param) from None


def _submit(engine: Engine, m: LoadedModel, req: ResponseRequest, prompt_ids, max_tokens, *,
            principal: str, boundary: int, constraint=None):
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    sampling = SamplingParams(temperature=req.temperature, top_p=max(req.top_p, 1e-6),
                              top_k=0, seed=req.seed if req.seed is not None else
                              secrets.randbits(31))
    gen = GenerationRequest(prompt_ids=prompt_ids, sampling=sampling, max_tokens=max_tokens,
                            stop_ids=frozenset(m.tokenizer.eos_ids), principal=principal,
                            session=req.prompt_cache_key,
                            prefix_boundary=boundary, constraint=constraint,
                            emit=functools.partial(_emit, loop, events))
    try:
        engine.submit(gen)
    except PromptTooLong as exc:  # the budget check above runs first; kept fail-closed
        raise invalid(f"{exc} (context_length_exceeded).", param="input",
                      code="context_length_exceeded") from None
    except QueueFull:
        raise APIError(429, "The server is overloaded: too many requests are waiting. Retry "
                       "shortly.", type="server_error", code="server_overloaded",
                       headers={"Retry-After": "2"}) from None
    return gen, events


def _emit(loop, events: asyncio.Queue, ev) -> None:
    """Called on the engine thread: hand an event to the request's loop (gone at shutdown)."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, ev)
    except RuntimeError:  # the event loop closed: nobody is listening any more
        pass


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


def _finish(state: ResponseState, done: DoneEvent, m: LoadedModel, thinking: bool) -> None:
    state.cached_tokens = done.cached_tokens
    if thinking:  # every token up to and including </think> (all of them if it never came)
        end = m.tokenizer.think_end_id
        ids = state.output_ids
        state.reasoning_tokens = ids.index(end) + 1 if end in ids else len(ids)
    if done.finish_reason == "error":
        raise APIError(500, "generation failed", type="server_error", code="server_error")
    if done.finish_reason == "stop":
        state.status = "completed"
    elif done.finish_reason == "cancelled":
        state.status = "cancelled"
    else:
        state.status = "incomplete"
        state.incomplete_reason = "max_output_tokens"


async def _generate(state: ResponseState, events, m: LoadedModel, asm: OutputAssembler,
                    send) -> None:
    """Run the response to its end; `send(ops)` (streaming only) gets each batch of item
    operations. Raises APIError when generation failed."""
    decoder = m.tokenizer.stream_decoder()
    thinking = asm.thinking
    while True:
        item = await _next_text(events, decoder, state)
        if isinstance(item, DoneEvent):
            ops = asm.push(decoder.flush())
            _finish(state, item, m, thinking)
            ops += asm.finish("completed" if state.status == "completed" else "incomplete")
            if send is not None:
                await send(ops)
            return
        ops = asm.push(item)
        if send is not None and ops:
            await send(ops)


class _Run:
    """One request on the engine: its response state, output assembler and event source."""

    def __init__(self, rt: Runtime, m: LoadedModel, req: ResponseRequest, trace, principal,
                 prompt, max_tokens: int, constraint=None):
        self.rt, self.m, self.req, self.trace = rt, m, req, trace
        self.state = state = ResponseState(
            id=trace.request_id, model=m.model_id, max_output_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p, instructions=req.instructions,
            metadata=req.metadata, previous_response_id=req.previous_response_id,
            store=req.store, prompt_cache_key=req.prompt_cache_key,
            input_tokens=len(prompt.ids), tools=[dict(t) for t in req.tools],
            tool_choice=req.tool_choice, text_format=req.text_format,
            reasoning={"effort": req.reasoning.effort, "summary": req.reasoning.summary},
            parallel_tool_calls=req.parallel_tool_calls)
        end = m.tokenizer.think_end_id

        def seal() -> str:  # the reasoning's tokens: all output ids through </think>
            ids = state.output_ids
            return rt.seal.seal(principal, ids[:ids.index(end) + 1] if end in ids else ids)

        sealer = seal if "reasoning.encrypted_content" in req.include else None
        self.asm = OutputAssembler(tools=list(req.tools), thinking=req.reasoning.thinking,
                                   summary=req.reasoning.summary is not None,
                                   message_id=state.message_id, sealer=sealer)
        state.items = self.asm.items
        rt.obs.on_request_start(trace, session=req.prompt_cache_key, stream=req.stream,
                                prompt_tokens=len(prompt.ids), max_output_tokens=max_tokens,
                                store=req.store)
        self.gen, self.events = _submit(rt.engine, m, req, prompt.ids, max_tokens,
                                        principal=principal, boundary=prompt.boundary,
                                        constraint=constraint)
        self.flight = rt.inflight[state.id] = _InFlight(principal, self.gen, state)
        self.source = None

    @classmethod
    async def begin(cls, rt: Runtime, m: LoadedModel, req: ResponseRequest, trace, principal,
                    prompt) -> "_Run":
        """Check the context budget, submit, and wait for the first event: a request rejected
        before its first token gets a plain HTTP error."""
        if rt.draining:  # `ninfer ctl drain` or a graceful stop under way
            raise APIError(503, "The server is draining for a stop or restart; retry shortly.",
                           type="server_error", code="server_draining",
                           headers={"Retry-After": "5"})
        budget = rt.context_tokens - len(prompt.ids)
        if budget < 1:
            raise invalid(f"This model's maximum context length is {rt.context_tokens} tokens; "
                          f"the input is {len(prompt.ids)} tokens (context_length_exceeded).",
                          param="input", code="context_length_exceeded")
        max_tokens = min(req.max_output_tokens or rt.max_output_tokens, budget)
        constraint = await _constraint(rt, m, req, max_tokens)
        run = cls(rt, m, req, trace, principal, prompt, max_tokens, constraint)
        try:
            first = await run.events.get()
            if isinstance(first, DoneEvent) and first.finish_reason == "queue_timeout":
                rt.obs.on_request_done(trace, first)
            _raise_if_rejected(first)
        except BaseException:
            run.close()
            raise
        run.source = _Events(run.events, first, trace, rt.obs)
        return run

    async def complete(self, send) -> None:
        await _generate(self.state, self.source, self.m, self.asm, send)

    def close(self) -> None:
        self.gen.cancelled.set()  # a no-op when finished; frees the engine if the client left
        self.rt.inflight.pop(self.state.id, None)
        self.flight.ended.set()
        if not self.trace.finished:  # the client left before the DoneEvent was read
            self.rt.obs.on_request_abandoned(self.trace, output_tokens=self.state.output_tokens)


async def _stream(request: Request, run: _Run, persist):
    resp = await request.respond(content_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    es = EventStream(run.state)

    async def send(ops):
        for frame in es.ops(ops):
            await resp.send(frame)

    for frame in es.opening():
        await resp.send(frame)
    try:
        await run.complete(send)
    except APIError as e:
        await resp.send(es.failed(e.message))
    else:
        await persist()
        await resp.send(es.terminal())
    await resp.eof()
    return resp
