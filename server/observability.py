"""Observability: Prometheus metrics and a JSONL request log.

Three pieces, composed by `Observability` (what the app calls):

- `Metrics` (server/metrics.py): counters and histograms on private registries, the whole
  server's and each principal's own, plus pool gauges read at scrape time.
- `RequestLog` (server/request_log.py): JSONL, append-only, 0600, rotated by size; never prompt
  or output text, never a key, identities as digests.
- `RequestTrace`: one request's identity and clock; it finishes exactly once, so a catch-all
  handler can report a rejection without double counting.
"""
from __future__ import annotations

import os
import secrets
import sys
import time
from dataclasses import dataclass, field

from server.checkpoints.status import SessionStatus
from server.metrics import OUTCOMES, PATHS, Metrics
from server.request_log import (EVENTS, RequestLog, principal_digest, session_digest,
                                session_digest_of)

__all__ = ["EVENTS", "OUTCOMES", "PATHS", "Metrics", "Observability", "RequestLog",
           "RequestTrace", "engine_stats", "principal_digest", "session_digest"]

_FINISH_OUTCOME = {"stop": "completed", "length": "incomplete", "cancelled": "cancelled",
                   "queue_timeout": "rejected_queue_timeout", "error": "error"}


def engine_stats(engine) -> dict | None:
    """The stats callback for a live `Engine` (None while loading)."""
    return None if engine is None else engine.stats()


# ---- what the app calls -----------------------------------------------------------------------
@dataclass
class RequestTrace:
    """One request from arrival to its end. `request_id` is server-generated (the response id)."""
    request_id: str
    principal: str | None              # digest
    session: str | None = None         # digest
    stream: bool | None = None
    t0: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    outcome: str | None = None         # set once, by the first on_request_* that ends it
    checkpoint: str | None = None      # why a checkpoint was or was not restored (a reason)

    def mark_first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()

    @property
    def finished(self) -> bool:
        return self.outcome is not None


def _checkpoint_fault(event: str, fields: dict) -> str | None:
    """The storage fault a checkpoint event reports: a corrupt generation found by a restore,
    or a save refused by the disk (not by the quota)."""
    if event == "checkpoint_restore" and fields.get("state") == SessionStatus.CORRUPT:
        return "corrupt"
    if event == "checkpoint_refused" and fields.get("reason") not in ("quota", "page_missing"):
        return "full" if fields.get("reason") in ("enospc", "edquot") else "io"
    return None


def _rejected_outcome(status: int, code: str | None) -> str:
    if status == 401:
        return "unauthorized"
    if status == 429:
        return "rejected_overloaded"
    if status == 503 and code == "request_queue_timeout":
        return "rejected_queue_timeout"
    if status == 503 and code == "model_loading":
        return "rejected_loading"
    return "bad_request" if status < 500 else "error"


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


class Observability:
    """Metrics and the request log, updated together. `log` may be None (metrics only).
    A log I/O error never fails a request: it is counted in `log_write_errors_total`."""

    def __init__(self, metrics: Metrics, log: RequestLog | None = None, model: str | None = None):
        self.metrics, self.log = metrics, log
        self.model = model  # the served model id, never the client's string

    def _write(self, event: str, trace: RequestTrace | None, **fields) -> None:
        if self.log is None:
            return
        ident = {} if trace is None else {"request_id": trace.request_id,
                                          "principal": trace.principal,
                                          "session": trace.session}
        try:
            self.log.write(event, **ident, model=self.model, **fields)
        except OSError:
            self.metrics.log_errors.inc()

    def on_server_start(self, *, lane: str | None = None, host: str | None = None,
                        port: int | None = None, model: str | None = None, **info) -> None:
        """`info`: ids and hashes only (model_sha256, profile_hash, version, ...)."""
        if model is not None:
            self.model = model
        self._write("server_start", None, pid=os.getpid(), lane=lane, host=host, port=port,
                    **info)

    def on_event(self, event: str, **fields) -> None:
        """A server event outside any request (checkpoint saves, restores, the stop report):
        ids, digests, counts and reasons only."""
        if event.startswith("checkpoint_"):
            self.metrics.checkpoint_event(event, fields)
            kind = _checkpoint_fault(event, fields)
            if kind is not None:
                self.on_storage_fault("checkpoints", kind, f"{event}: {fields.get('reason')}")
        self._write(event, None, **fields)

    def on_storage_fault(self, store: str, kind: str, what: str) -> None:
        """A disk error or corruption in a store: on stderr (an operator must see it, not only
        the request log) and in `ninfer_storage_errors_total`. `what`: no prompt text."""
        self.metrics.storage_errors.labels(store, kind).inc()
        print(f"ninfer: storage fault: {store}: {kind}: {what}", file=sys.stderr, flush=True)

    def new_request(self, principal: str | None, request_id: str | None = None) -> RequestTrace:
        """Start the clock; logs nothing (a request rejected before validation never 'starts')."""
        return RequestTrace(request_id or f"req_{secrets.token_hex(12)}",
                            principal_digest(principal))

    def on_request_start(self, trace: RequestTrace, *, session: str | None = None,
                         stream: bool = False, prompt_tokens: int = 0,
                         max_output_tokens: int | None = None,
                         store: bool | None = None) -> None:
        """The request passed validation and goes to the engine. `session` is the
        prompt_cache_key: only its digest, scoped by the principal, is kept."""
        trace.session, trace.stream = session_digest_of(trace.principal, session), stream
        self._write("request_start", trace, stream=stream, prompt_tokens=prompt_tokens,
                    max_output_tokens=max_output_tokens, store=store)

    def on_request_rejected(self, trace: RequestTrace, status: int,
                            code: str | None = None) -> bool:
        """An HTTP error answered instead of generating (401, 400/404/413, 429, 503).
        Returns False (and does nothing) when the trace already finished."""
        outcome = _rejected_outcome(status, code)
        if outcome == "error":
            return self.on_request_error(trace, status=status, code=code)
        if not self._finish(trace, outcome):
            return False
        self._write("request_rejected", trace, outcome=outcome, status=status, code=code,
                    total_s=_r(time.monotonic() - trace.t0))
        return True

    def on_request_done(self, trace: RequestTrace, done, *, ttft_s: float | None = None,
                        total_s: float | None = None) -> bool:
        """The engine's DoneEvent for the request, whatever its finish reason. TTFT and total
        default to the trace's clock (arrival to first token / to now)."""
        outcome = _FINISH_OUTCOME.get(done.finish_reason, "error")
        if not self._finish(trace, outcome):
            return False
        m = self.metrics.views(trace.principal)
        now = time.monotonic()
        total_s = now - trace.t0 if total_s is None else total_s
        if ttft_s is None and trace.first_token_at is not None:
            ttft_s = trace.first_token_at - trace.t0
        # A request that never left the queue (timeout, or cancelled while waiting: the engine
        # reports zero prefill and decode time) computed nothing: no tokens, no path.
        admitted = outcome != "rejected_queue_timeout" and bool(
            done.prefill_s or done.decode_s or done.output_tokens)
        m.queue_wait.observe(done.queue_s)
        m.request_seconds.observe(total_s)
        tps = None
        if admitted:
            m.prompt_tokens.inc(done.prompt_tokens)
            m.cached_tokens.inc(done.cached_tokens)
            m.computed_tokens.inc(done.computed_tokens)
            m.output_tokens.inc(done.output_tokens)
            m.by_path.labels(done.path).inc()
            spec = getattr(done, "speculative", None)
            if spec:
                m.spec_passes.inc(spec["verify_passes"])
                for i, (d, a) in enumerate(zip(spec["drafted"], spec["accepted"])):
                    m.spec_drafted.labels(str(i)).inc(d)
                    m.spec_accepted.labels(str(i)).inc(a)
            m.prefill.observe(done.prefill_s)
            if ttft_s is not None:
                m.ttft.observe(ttft_s)
            # decode_s runs from the first sampled token to the end: one decode step per output
            # token after the first, plus one more when the last sample was a stop token.
            steps = done.output_tokens - (done.finish_reason != "stop")
            if steps > 0 and done.decode_s > 0:
                m.decode_per_token.observe(done.decode_s / steps)
                tps = steps / done.decode_s
        fields = dict(outcome=outcome, finish_reason=done.finish_reason,
                      prompt_tokens=done.prompt_tokens,
                      cached_tokens=done.cached_tokens if admitted else 0,
                      computed_tokens=done.computed_tokens if admitted else 0,
                      output_tokens=done.output_tokens, path=done.path if admitted else None,
                      queue_s=_r(done.queue_s), ttft_s=_r(ttft_s),
                      prefill_s=_r(done.prefill_s), decode_s=_r(done.decode_s),
                      total_s=_r(total_s), decode_tokens_per_s=_r(tps),
                      speculative=getattr(done, "speculative", None),
                      checkpoint=trace.checkpoint)
        if outcome == "rejected_queue_timeout":
            self._write("request_rejected", trace, status=503, code="request_queue_timeout",
                        **fields)
        elif outcome == "error":
            self._write("request_error", trace, status=500, code="server_error",
                        error_type=done.error, **fields)
        else:
            self._write("request_done", trace, **fields)
        return True

    def on_request_abandoned(self, trace: RequestTrace, *, output_tokens: int = 0) -> bool:
        """The client went away before the engine's DoneEvent was read (a dropped stream): a
        cancellation with the HTTP side's view only; the engine's own numbers are lost."""
        if not self._finish(trace, "cancelled"):
            return False
        now = time.monotonic()
        ttft = None if trace.first_token_at is None else trace.first_token_at - trace.t0
        self.metrics.views(trace.principal).request_seconds.observe(now - trace.t0)
        self._write("request_done", trace, outcome="cancelled", finish_reason="disconnected",
                    output_tokens=output_tokens, ttft_s=_r(ttft), total_s=_r(now - trace.t0),
                    speculative=None)
        return True

    def on_request_error(self, trace: RequestTrace, *, status: int = 500,
                         code: str | None = "server_error",
                         error_type: str | None = None) -> bool:
        """A failure outside the engine's DoneEvent (an exception in the handler). `error_type`
        is an exception class name: never str(exc), which may quote the request."""
        if not self._finish(trace, "error"):
            return False
        self._write("request_error", trace, outcome="error", status=status, code=code,
                    error_type=error_type, total_s=_r(time.monotonic() - trace.t0))
        return True

    def _finish(self, trace: RequestTrace, outcome: str) -> bool:
        if trace.finished:
            return False
        trace.outcome = outcome
        self.metrics.views(trace.principal).requests.labels(outcome).inc()
        return True
