"""One request on the engine: its budget and token constraint, its submission, and the events
that come back, assembled into the response's state and output items.

The engine runs on its own thread; `Run.begin` hands it a GenerationRequest and receives its
token events back on this event loop through a queue. The routes (server/routes/) only decide
what to do with a run: complete it, or stream its item operations.
"""
from __future__ import annotations

import asyncio
import functools
import secrets
from dataclasses import dataclass, field

from engine.engine import (DoneEvent, Engine, GenerationRequest, PromptTooLong, QueueFull,
                           TokenEvent)
from engine.io.loader import LoadedModel
from engine.runtime.sampling import SamplingParams
from server.errors import APIError, invalid, model_loading, not_found
from server.observability import Observability, RequestTrace
from server.request_model import ResponseRequest
from server.response_objects import OutputAssembler, ResponseState
from server.runtime import Runtime
from server.token_logprobs import TokenLogprobs

# Thinking budget per reasoning effort, in tokens (capped to leave room for the answer).
THINKING_BUDGET = {"low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}
_compiler_lock = asyncio.Lock()


@dataclass
class InFlight:
    """A response still being generated, as `POST /v1/responses/{id}/cancel` finds it."""
    principal: str
    gen: GenerationRequest
    state: ResponseState
    ended: asyncio.Event = field(default_factory=asyncio.Event)


def require_model(rt: Runtime, asked: str | None = None) -> LoadedModel:
    """The served model: a 503 while it loads, a 404 when `asked` names another one."""
    if rt.engine is None or rt.model is None:
        raise model_loading()
    m = rt.model
    if asked is not None and asked != m.model_id:
        raise not_found(f"The model '{asked}' does not exist; this server serves "
                        f"'{m.model_id}'.", code="model_not_found")
    return m


async def _constraint(rt: Runtime, m: LoadedModel, req: ResponseRequest, max_tokens: int):
    """The request's token constraint (engine/constrain), or None when it needs none: no tool
    call under tool_choice none, a call (valid for its schema) under required or a named
    function, schema-valid JSON for text.format, and `</think>` forced at the thinking budget."""
    thinking = req.reasoning.thinking
    needs = (thinking or req.tool_choice != "auto" or req.text_format.get("type") != "text"
             or (not req.parallel_tool_calls and req.tools))
    if not needs and not req.tools:
        return None
    if rt.constraints is None:  # a runtime built without the loader (tests): build it once
        async with _compiler_lock:
            if rt.constraints is None:
                from engine.constrain.compiler import ConstraintCompiler

                rt.constraints = await asyncio.to_thread(ConstraintCompiler, m.tokenizer)
    from engine.constrain.compiler import ConstraintError

    if req.tools:  # every tool's schema is checked at admission, called or not
        try:
            await asyncio.to_thread(rt.constraints.check_tools, list(req.tools))
        except ConstraintError as e:
            raise invalid(f"a tool's parameters cannot be used: {e}", param="tools") from None
    if not needs:
        return None

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
                            logprobs=req.logprobs, emit=functools.partial(_emit, loop, events))
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


async def _next_text(events: _Events, decoder, state: ResponseState, lp=None):
    """The next piece of text, or a DoneEvent when generation ended; `lp` (a TokenLogprobs,
    or None) records each token's log-probabilities."""
    while True:
        ev = await events.get()
        if isinstance(ev, TokenEvent):
            state.output_tokens += 1
            state.output_ids.append(ev.token_id)
            if lp is not None:
                lp.record(ev)
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
                    send, logprobs: bool = False) -> None:
    """Run the response to its end; `send(ops)` (streaming only) gets each batch of item
    operations; `logprobs`: give the output_text its tokens' log-probabilities (the events
    carry them). Raises APIError when generation failed."""
    decoder = m.tokenizer.stream_decoder()
    thinking = asm.thinking
    lp = TokenLogprobs(m.tokenizer) if logprobs else None
    while True:
        item = await _next_text(events, decoder, state, lp)
        was_reasoning = asm.in_reasoning
        if isinstance(item, DoneEvent):
            ops = asm.push(decoder.flush())
            _finish(state, item, m, thinking)
            ops += asm.finish("completed" if state.status == "completed" else "incomplete")
            if lp is not None:
                lp.assign(ops, asm.items, was_reasoning)
            if send is not None:
                await send(ops)
            return
        ops = asm.push(item)
        if lp is not None:
            lp.assign(ops, asm.items, was_reasoning)
        if send is not None and ops:
            await send(ops)


def context_exceeded(context_tokens: int, n: int) -> APIError:
    """The error a client's compaction reacts to (OMP matches the code's name and both
    phrases), raised before anything is generated."""
    return invalid(f"Your input exceeds the context window of this model: its maximum context "
                   f"length is {context_tokens} tokens and the input is {n} tokens "
                   f"(context_length_exceeded). Shorten or compact the conversation.",
                   param="input", code="context_length_exceeded")


class Run:
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
        self.flight = rt.inflight[state.id] = InFlight(principal, self.gen, state)
        self.source = None

    @classmethod
    async def begin(cls, rt: Runtime, m: LoadedModel, req: ResponseRequest, trace, principal,
                    prompt) -> "Run":
        """Check the context budget, submit, and wait for the first event: a request rejected
        before its first token gets a plain HTTP error."""
        if rt.draining:  # `ninfer ctl drain` or a graceful stop under way
            raise APIError(503, "The server is draining for a stop or restart; retry shortly.",
                           type="server_error", code="server_draining",
                           headers={"Retry-After": "5"})
        budget = rt.context_tokens - len(prompt.ids)
        if budget < 1:
            raise context_exceeded(rt.context_tokens, len(prompt.ids))
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
        await _generate(self.state, self.source, self.m, self.asm, send,
                        logprobs=self.req.logprobs is not None)

    def close(self) -> None:
        self.gen.cancelled.set()  # a no-op when finished; frees the engine if the client left
        self.rt.inflight.pop(self.state.id, None)
        self.flight.ended.set()
        if not self.trace.finished:  # the client left before the DoneEvent was read
            self.rt.obs.on_request_abandoned(self.trace, output_tokens=self.state.output_tokens)
