"""`POST /v1/chat/completions`: the stateless chat API. Its wire format (request parsing, the
message, finish reason and usage of a completion) is server/chat_completions.py.

Nothing is stored: the whole conversation is rendered and submitted as it came; a completion
streams as `chat.completion.chunk` events or returns one `chat.completion`.
"""
from __future__ import annotations

import asyncio
import json
import time

from sanic import Request, Sanic, response

from server import chains
from server.chat_completions import (completion_message, completion_usage, finish_reason,
                                     parse_chat_request)
from server.errors import APIError
from server.generation import Run, require_model
from server.request_model import ResponseRequest, json_body
from server.response_objects import new_id
from server.runtime import Runtime


def _parse(raw: bytes | None, defaults: dict | None = None):
    body = json_body(raw)
    return body, parse_chat_request(body, defaults)


async def _begin(rt: Runtime, request: Request, req: ResponseRequest) -> Run:
    """Put a parsed request on the engine: its conversation rendered whole."""
    trace = request.ctx.trace = rt.obs.new_request(request.ctx.principal, new_id("resp"))
    m = require_model(rt, req.model)
    async with chains.work_slot(request.ctx.principal):  # rendering and tokenizing: off the loop
        prompt = await asyncio.to_thread(chains.render_full, m, list(req.messages), req,
                                         rt.context_tokens)
    return await Run.begin(rt, m, req, trace, request.ctx.principal, prompt)


def register(app: Sanic, rt: Runtime) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        async with chains.work_slot(request.ctx.principal):
            body, req = await chains.off_loop(_parse, request.body, rt.sampling_defaults,
                                              size=len(request.body or b""))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        cid, created = new_id("chatcmpl"), int(time.time())

        def chunk(delta: dict, finish=None, usage=None) -> str:
            c = {"id": cid, "object": "chat.completion.chunk", "created": created,
                 "model": req.model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                              "logprobs": None}] if delta is not None else []}
            if usage is not None:
                c["usage"] = usage
            return f"data: {json.dumps(c, ensure_ascii=False)}\n\n"

        run = await _begin(rt, request, req)
        state = run.state
        if not req.stream:
            try:
                await run.complete(None)
            finally:
                run.close()
            return response.json({
                "id": cid, "object": "chat.completion", "created": created,
                "model": req.model, "choices": [{"index": 0,
                                                 "message": completion_message(state),
                                                 "finish_reason": finish_reason(state),
                                                 "logprobs": None}],
                "usage": completion_usage(state)})

        resp = await request.respond(content_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        ncalls = 0

        async def send(ops):
            nonlocal ncalls
            for op in ops:
                item = state.items[op.index]
                if op.kind == "text_delta" and op.text:
                    await resp.send(chunk({"content": op.text}))
                elif op.kind == "reasoning_delta" and op.text:
                    await resp.send(chunk({"reasoning_content": op.text}))
                elif op.kind == "done" and item["type"] == "function_call":
                    await resp.send(chunk({"tool_calls": [{
                        "index": ncalls, "id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}]}))
                    ncalls += 1

        try:
            await resp.send(chunk({"role": "assistant", "content": ""}))
            try:
                await run.complete(send)
            except APIError as e:
                await resp.send(f"data: {json.dumps({'error': e.body()['error']})}\n\n")
            else:
                await resp.send(chunk({}, finish=finish_reason(state)))
                if include_usage:
                    await resp.send(chunk(None, usage=completion_usage(state)))
            await resp.send("data: [DONE]\n\n")
        finally:
            run.close()
        await resp.eof()
        return None  # streamed: nothing more to send
