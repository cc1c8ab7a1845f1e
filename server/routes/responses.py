"""The Responses API: `POST /v1/responses` (streamed or not), `POST /v1/responses/input_tokens`,
and, on stored responses, `GET` and `DELETE /v1/responses/{id}`, `POST .../cancel` and
`GET .../input_items`. Also the stored responses' retention, applied at start and hourly."""
from __future__ import annotations

import asyncio
import sys

from sanic import Request, Sanic, response

from server import chains
from server.errors import APIError, invalid, model_loading, not_found
from server.generation import Run, require_model
from server.request_model import json_body, parse_response_request
from server.response_objects import EventStream, new_id
from server.response_store import InvalidCursor
from server.runtime import Runtime
from server.storage_faults import storage_error

RETENTION_INTERVAL_S = 3600.0


def _parse(raw: bytes | None, count_only: bool = False, defaults: dict | None = None):
    """The body as a ResponseRequest; `defaults`: the served model's sampling defaults, for
    a request that names no temperature or top_p."""
    body = json_body(raw)
    if count_only and isinstance(body, dict):
        body = {"stream": False, **body}
    return parse_response_request(body, defaults)


async def _retention_loop(rt: Runtime) -> None:
    """The store's retention limits, applied at start and then every hour (off the loop)."""
    max_responses, max_age_s = rt.retention
    while True:
        n = await asyncio.to_thread(rt.response_store.prune, max_responses, max_age_s)
        if n:
            print(f"ninfer: retention removed {n} stored responses", file=sys.stderr,
                  flush=True)
        await asyncio.sleep(RETENTION_INTERVAL_S)


async def _stream(request: Request, run: Run, persist) -> None:
    """Send the response as server-sent events; the route then returns nothing (Sanic
    logs an error for a route that streamed and also returns its response)."""
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
        await persist()
    except APIError as e:  # generation failed, or the response could not be stored
        await resp.send(es.failed(e.message, e.code or "server_error"))
    except Exception as e:  # noqa: BLE001 (a stream always ends with its terminal event)
        print(f"ninfer: stream {run.state.id} failed: {type(e).__name__}", file=sys.stderr,
              flush=True)
        await resp.send(es.failed("internal server error"))
    else:
        await resp.send(es.terminal())
    await resp.eof()


def register(app: Sanic, rt: Runtime) -> None:
    @app.before_server_start
    async def start_retention(app_):
        if rt.response_store is not None and any(rt.retention):
            app_.add_task(_retention_loop(rt), name="ninfer-retention")

    @app.post("/v1/responses")
    async def create_response(request: Request):
        trace = request.ctx.trace = rt.obs.new_request(request.ctx.principal, new_id("resp"))
        principal = request.ctx.principal
        async with chains.work_slot(principal):  # parsing, rendering, tokenizing: off the loop
            req = await chains.off_loop(_parse, request.body, False, rt.sampling_defaults,
                                        size=len(request.body or b""))
            m = require_model(rt, req.model)
            req = chains.unseal_reasoning(req, rt.seal, principal, m.tokenizer)
            prompt = await chains.build_prompt(rt.response_store, m, req, principal,
                                               rt.context_tokens)
        trace.checkpoint = await chains.checkpoint_restore(rt, principal, req.prompt_cache_key,
                                                          prompt)
        run = await Run.begin(rt, m, req, trace, principal, prompt)
        state = run.state

        async def persist():  # before the terminal event: a client may chain on it at once
            if req.store and state.status in ("completed", "incomplete", "cancelled"):
                rec = chains.record_for(state, req, principal, prompt, m.tokenizer)
                try:
                    await asyncio.to_thread(rt.response_store.put_response, rec)
                except Exception as e:  # one transaction: nothing of it was stored
                    fault = storage_error(
                        rt.obs, "responses", e, "storing the response",
                        f"The response {rec.id} was generated but not stored; nothing of it "
                        "was kept. Retry the request once the store is fixed.")
                    if fault is None:
                        raise
                    raise fault from None
                await chains.checkpoint_response_stored(rt, principal, rec)

        try:
            if req.stream:
                await _stream(request, run, persist)
                return None
            await run.complete(None)
            await persist()
        finally:
            run.close()
        return response.json(state.to_dict())

    @app.post("/v1/responses/input_tokens")
    async def input_tokens(request: Request):
        async with chains.work_slot(request.ctx.principal):
            req = await chains.off_loop(_parse, request.body, True, size=len(request.body or b""))
            m = rt.model
            if m is None:
                raise model_loading()
            prompt = await chains.build_prompt(rt.response_store, m, req,
                                               request.ctx.principal)
        return response.json({"object": "response.input_tokens",
                              "input_tokens": len(prompt.ids)})

    @app.get("/v1/responses/<response_id:str>")
    async def get_response(request: Request, response_id: str):
        rec = await asyncio.to_thread(rt.response_store.get, request.ctx.principal, response_id)
        if rec is None:
            raise not_found(f"No response found with id '{response_id}'.")
        return response.json(chains.response_from_record(rec))

    @app.delete("/v1/responses/<response_id:str>")
    async def delete_response(request: Request, response_id: str):
        principal, store = request.ctx.principal, rt.response_store
        rec = await asyncio.to_thread(store.get, principal, response_id)
        seq = await asyncio.to_thread(store.token_sequence, principal, response_id)
        if rec is None or not await asyncio.to_thread(store.delete, principal, response_id):
            raise not_found(f"No response found with id '{response_id}'.")
        if seq is not None and rt.engine is not None:  # its model state goes too
            rt.engine.forget(principal, chains.fed_tokens(rec.status, seq))
        await chains.checkpoint_response_deleted(rt, principal, rec)
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
