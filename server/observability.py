"""Observability: Prometheus metrics and a JSONL request log.

Three pieces, composed by `Observability` (what the app calls):

- `Metrics`: counters and histograms on a private `CollectorRegistry` (several servers or tests in
  one process never collide), plus pool gauges read at scrape time from a stats callback.
- `RequestLog` (server/request_log.py): JSONL, append-only, 0600, rotated by size; never prompt
  or output text, never a key, identities as digests.
- `RequestTrace`: one request's identity and clock; it finishes exactly once, so a catch-all
  handler can report a rejection without double counting.
"""
from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from server.checkpoints.status import RESTORE_OUTCOMES, SessionStatus
from server.request_log import (EVENTS, RequestLog, principal_digest, session_digest,
                                session_digest_of)

__all__ = ["EVENTS", "OUTCOMES", "PATHS", "Metrics", "Observability", "RequestLog",
           "RequestTrace", "engine_stats", "principal_digest", "session_digest"]

OUTCOMES = ("completed", "incomplete", "cancelled", "rejected_overloaded",
            "rejected_queue_timeout", "rejected_loading", "error", "bad_request", "unauthorized")
PATHS = ("root", "continuation", "fork", "shared-prefix", "host-restored", "disk-restored")
_FINISH_OUTCOME = {"stop": "completed", "length": "incomplete", "cancelled": "cancelled",
                   "queue_timeout": "rejected_queue_timeout", "error": "error"}

StatsFn = Callable[[], "dict | None"]


# ---- metrics ----------------------------------------------------------------------------------
class _PoolCollector:
    """Gauges computed from `stats()` at scrape time (the engine's pools change between scrapes)."""

    def __init__(self, stats: StatsFn, ns: str):
        self.stats, self.ns = stats, ns

    def _read(self) -> dict | None:
        # The engine thread mutates the pools while we read them: a dict may change size under
        # iteration. Retry a little; a scrape without pool gauges beats a failed scrape.
        for _ in range(3):
            try:
                return self.stats()
            except RuntimeError:
                continue
        return None

    def collect(self):
        s = self._read()
        try:
            families = list(self._families(s)) if s else []
        except (KeyError, TypeError, AttributeError):
            families = []  # a stats dict of an unexpected shape: no pool gauges, scrape still works
        yield from families

    def _families(self, s: dict):
        ns, kv, st = self.ns, s.get("kv", {}), s.get("states", {})

        def gauge(name, doc, value, labels=None):
            g = GaugeMetricFamily(f"{ns}_{name}", doc, labels=labels)
            for label_values, v in (value if labels else [((), value)]):
                g.add_metric(list(label_values), v)
            return g

        def tiers(device_key, host_key):
            return [(("device",), st[device_key]), (("host",), st[host_key])]

        if kv:
            yield gauge("kv_capacity_bytes", "KV pool size in bytes.", kv["kv_bytes_total"])
            yield gauge("kv_used_bytes", "KV bytes in pages held by any table.",
                        kv["kv_bytes_used"])
            yield gauge("kv_pages", "KV pages by state (shared: refcount > 1).",
                        [((k,), kv[f"pages_{k}"]) for k in ("used", "free", "shared")], ["state"])
        if st:
            yield gauge("state_images", "Recurrent-state images by tier.",
                        tiers("device_images", "host_images"), ["tier"])
            yield gauge("state_bytes", "Bytes held by recurrent-state images by tier.",
                        tiers("device_bytes", "host_bytes"), ["tier"])
            yield gauge("state_capacity_bytes", "Recurrent-state capacity by tier.",
                        tiers("device_reserved_bytes", "host_bytes_limit"), ["tier"])
            yield gauge("state_pinned_images", "Images pinned for a restore.", st["pinned_images"])
            moves = CounterMetricFamily(f"{ns}_state_moves", "State pool operations.",
                                        labels=["op"])
            for op in ("stores", "restores", "spills", "fetches", "evictions", "drops"):
                if op in st:
                    moves.add_metric([op], st[op])
            yield moves
        if "snapshots" in s:
            yield gauge("snapshots", "Stored prefix/response states.", s["snapshots"])
        if "evictions" in s:
            ev = CounterMetricFamily(f"{ns}_snapshot_evictions", "Stored states evicted.")
            ev.add_metric([], s["evictions"])
            yield ev
        seqs = [((k,), s[k]) for k in ("running", "waiting") if k in s]
        if seqs:
            yield gauge("sequences", "Sequences by scheduler state.", seqs, ["state"])


class Metrics:
    """Prometheus metrics of one server. `stats` returns `Memory.stats()` plus optional
    "running"/"waiting" counts, or None while the model loads (no pool gauges then)."""

    def __init__(self, stats: StatsFn | None = None, namespace: str = "ninfer"):
        self.registry = CollectorRegistry(auto_describe=False)
        ns, r = namespace, self.registry
        self.requests = Counter(f"{ns}_requests", "Requests by outcome.", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)  # every series exists from the start, at 0
        self.prompt_tokens = Counter(f"{ns}_prompt_tokens", "Prompt tokens.", registry=r)
        self.cached_tokens = Counter(f"{ns}_cached_tokens",
                                     "Prompt tokens served from a stored state.", registry=r)
        self.computed_tokens = Counter(f"{ns}_computed_prompt_tokens",
                                       "Prompt tokens prefilled.", registry=r)
        self.output_tokens = Counter(f"{ns}_output_tokens", "Generated tokens.", registry=r)
        self.by_path = Counter(f"{ns}_requests_by_path", "Admitted requests by reuse path.",
                               ["path"], registry=r)
        for p in PATHS:
            self.by_path.labels(p)
        # speculative decoding (engine/runtime/speculative.py): per draft position (0-based)
        self.spec_passes = Counter(f"{ns}_speculative_verify_passes",
                                   "Speculative verify passes.", registry=r)
        self.spec_drafted = Counter(f"{ns}_speculative_drafted_tokens",
                                    "Tokens drafted, by draft position.", ["position"],
                                    registry=r)
        self.spec_accepted = Counter(f"{ns}_speculative_accepted_tokens",
                                     "Drafted tokens the verifier accepted, by draft position.",
                                     ["position"], registry=r)
        self.log_errors = Counter(f"{ns}_log_write_errors", "Request log lines lost to I/O "
                                  "errors.", registry=r)
        self.queue_wait = Histogram(f"{ns}_queue_wait_seconds", "Time waiting for admission.",
                                    buckets=(.001, .005, .01, .05, .1, .25, .5, 1, 2.5, 5, 10,
                                             30, 60, 120), registry=r)
        ttft_buckets = (.01, .025, .05, .1, .25, .5, 1, 2, 4, 8, 16, 32, 64, 128)
        self.ttft = Histogram(f"{ns}_ttft_seconds", "Request arrival to first token.",
                              buckets=ttft_buckets, registry=r)
        self.prefill = Histogram(f"{ns}_prefill_seconds", "Admission to first token.",
                                 buckets=ttft_buckets, registry=r)
        self.decode_per_token = Histogram(
            f"{ns}_decode_seconds_per_token", "Decode time per generated token, per request.",
            buckets=(.001, .0025, .005, .01, .015, .02, .03, .05, .075, .1, .25, .5, 1),
            registry=r)
        self.request_seconds = Histogram(
            f"{ns}_request_seconds", "Request arrival to its end.",
            buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=r)
        # Durable checkpoints (server/checkpoints): fed by the manager's events (on_event).
        self.ckpt_saves = Counter(f"{ns}_checkpoint_saves", "Checkpoint saves by outcome.",
                                  ["outcome"], registry=r)
        self.ckpt_save_bytes = Counter(f"{ns}_checkpoint_save_bytes",
                                       "Bytes written by checkpoint saves.", registry=r)
        self.ckpt_restores = Counter(f"{ns}_checkpoint_restores",
                                     "Checkpoint restore attempts by outcome (restored, "
                                     "no_room, missing, incompatible, corrupt).", ["outcome"],
                                     registry=r)
        self.ckpt_restore_bytes = Counter(f"{ns}_checkpoint_restore_bytes",
                                          "Bytes read and verified by restores.", registry=r)
        io_buckets = (.01, .025, .05, .1, .25, .5, 1, 2, 4, 8, 16, 32, 64)
        self.ckpt_save_seconds = Histogram(f"{ns}_checkpoint_save_seconds",
                                           "Duration of a checkpoint save (hash, write, "
                                           "publish).", buckets=io_buckets, registry=r)
        self.ckpt_restore_seconds = Histogram(f"{ns}_checkpoint_restore_seconds",
                                              "Duration of a restore (read, verify, install).",
                                              buckets=io_buckets, registry=r)
        for o in (SessionStatus.SAVED, SessionStatus.REFUSED):
            self.ckpt_saves.labels(o)
        for o in RESTORE_OUTCOMES:
            self.ckpt_restores.labels(o)
        if stats is not None:
            r.register(_PoolCollector(stats, ns))

    def checkpoint_event(self, event: str, fields: dict) -> None:
        """Count a checkpoint manager event (server/checkpoints/manager.py)."""
        if event == "checkpoint_saved":
            self.ckpt_saves.labels(SessionStatus.SAVED).inc()
            self.ckpt_save_bytes.inc(int(fields.get("written_bytes") or 0))
            if fields.get("seconds") is not None:
                self.ckpt_save_seconds.observe(float(fields["seconds"]))
        elif event == "checkpoint_refused":
            self.ckpt_saves.labels(SessionStatus.REFUSED).inc()
        elif event == "checkpoint_restore":
            state, reason = fields.get("state"), fields.get("reason")
            available = state == SessionStatus.AVAILABLE
            outcome = reason if available else state
            if outcome in RESTORE_OUTCOMES:
                self.ckpt_restores.labels(outcome).inc()
            if available and reason == SessionStatus.RESTORED:
                self.ckpt_restore_bytes.inc(int(fields.get("read_bytes") or 0))
                if fields.get("seconds") is not None:
                    self.ckpt_restore_seconds.observe(float(fields["seconds"]))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


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
        self._write(event, None, **fields)

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
        m = self.metrics
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
        self.metrics.request_seconds.observe(now - trace.t0)
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
        self.metrics.requests.labels(outcome).inc()
        return True
