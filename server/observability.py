"""Observability: Prometheus metrics and a JSONL request log, composed by `Observability`
(what the app calls):

- `Metrics` (server/metrics.py): counters and histograms on private registries, the whole
  server's and each principal's own, plus pool gauges read at scrape time.
- `RequestLog`: JSONL, one object a line, append-only, 0600, rotated by size. It never holds
  prompt or output text, and never a key: a field whose name says it might is refused
  (ValueError: a programming error, caught by the tests), and strings are capped in length.
  The principal name is an operator's label, not a secret, but it is logged as a short
  domain-tagged digest like every other identity (`principal_digest(name)` recomputes it for
  grepping); the session key (`prompt_cache_key`) is a capability: only a digest scoped by
  the principal is logged. No function here takes a bearer key.
- `RequestTrace`: one request's identity and clock; it finishes exactly once, so a catch-all
  handler can report a rejection without double counting.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from server.checkpoints.status import SessionStatus
from server.metrics import OUTCOMES, PATHS, Metrics


EVENTS = frozenset({"server_start", "request_start", "request_rejected", "request_done",
                    "request_error", "server_stop", "checkpoint_saved", "checkpoint_refused",
                    "checkpoint_skipped", "checkpoint_restore", "executable_rejected",
                    "executable_unloadable", "executable_unserializable", "executable_unsaved",
                    "executables_saved"})


# ---- identity digests -------------------------------------------------------------------------
def _digest(tag: str, *parts: str) -> str:
    h = hashlib.sha256(f"ninfer-log/{tag}".encode())
    for p in parts:  # length-prefixed: ("ab", "c") and ("a", "bc") differ
        b = p.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "big") + b)
    return h.hexdigest()[:16]


def principal_digest(principal: str | None) -> str | None:
    return None if principal is None else "p-" + _digest("principal", principal)


def session_digest(principal: str | None, session: str | None) -> str | None:
    """The digest of a session (prompt_cache_key) of the principal named `principal`."""
    return session_digest_of(principal_digest(principal), session)


def session_digest_of(principal_dig: str | None, session: str | None) -> str | None:
    """The same, from the principal's digest: sessions are namespaced per principal."""
    return None if session is None else "s-" + _digest("session", principal_dig or "", session)


# ---- the request log --------------------------------------------------------------------------
# Name parts that say "this field may hold text or a secret". A part is exempt only when the name
# ends in a unit (prompt_tokens, output_bytes) and the value is a number.
_FORBIDDEN = frozenset({"text", "prompt", "prompts", "input", "inputs", "output", "outputs",
                        "content", "contents", "instructions", "instruction", "key", "keys",
                        "authorization", "auth", "bearer", "secret", "password", "message",
                        "messages", "body", "header", "headers", "delta", "token"})
_UNITS = frozenset({"tokens", "bytes", "chars", "count", "s", "ms"})
_MAX_STR = 200  # ids, codes, model names; anything longer is text that has no place here


def _check_field(name: str, value, where: str = "") -> None:
    parts = [p for p in re.split(r"[^a-z0-9]+", name.lower()) if p]
    if not parts:
        raise ValueError(f"request log: empty field name {where}{name!r}")
    numeric = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
    if _FORBIDDEN.intersection(parts) and not (parts[-1] in _UNITS and numeric):
        raise ValueError(f"request log: field {where}{name!r} may carry text or a secret")
    if isinstance(value, str) and len(value) > _MAX_STR:
        raise ValueError(f"request log: field {where}{name!r} is a {len(value)}-char string")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_field(str(k), v, f"{where}{name}.")
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_field(name, v, where)
    elif not (value is None or isinstance(value, (bool, int, float, str))):
        raise ValueError(f"request log: field {where}{name!r} has type {type(value).__name__}")


def rfc3339_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class RequestLog:
    """Append-only JSONL, mode 0600. Each record is one write(2) of one whole line on an O_APPEND
    descriptor, under a lock (the event loop and the engine thread both write), so a reader never
    sees half a line and nothing waits in a buffer. At `max_bytes` the file rotates: path.1 ..
    path.<backups> (oldest dropped), so at most backups + 1 files exist."""

    def __init__(self, path: str | os.PathLike, *, max_bytes: int = 64 << 20, backups: int = 5):
        if max_bytes < 1 or backups < 0:
            raise ValueError("max_bytes must be >= 1 and backups >= 0")
        self.path = Path(path)
        self.max_bytes, self.backups = max_bytes, backups
        self._lock = threading.Lock()
        self._closed = False
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size

    def _open(self) -> int:
        # O_NOFOLLOW: a symlink planted at the log path cannot redirect our writes.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # a pre-existing file with looser bits is tightened
        return fd

    def write(self, event: str, /, **fields) -> None:
        """Append one record {ts, event, **fields}. ValueError for a field that may carry text
        or a secret, an unknown event, or a value that is not JSON scalars/lists/dicts."""
        if event not in EVENTS:
            raise ValueError(f"request log: unknown event {event!r}")
        for reserved in ("ts", "event"):
            if reserved in fields:
                raise ValueError(f"request log: field {reserved!r} is set by the log")
        for name, value in fields.items():
            _check_field(name, value)
        record = {"ts": rfc3339_now(), "event": event, **fields}
        line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
        with self._lock:
            if self._closed:
                raise ValueError("request log is closed")
            if self._fd < 0:  # an earlier rotation failed to reopen: try again
                self._fd = self._open()
                self._size = os.fstat(self._fd).st_size
            if self._size and self._size + len(line) > self.max_bytes:
                self._rotate()
            view = memoryview(line)
            while view:  # a regular file takes it whole; loop anyway rather than assume
                view = view[os.write(self._fd, view):]
            self._size += len(line)

    def _rotate(self) -> None:
        """Shift path -> path.1 -> ... -> path.<backups>; the oldest falls off. Single writer
        process: the lock serializes this process's threads only."""
        os.close(self._fd)
        self._fd = -1
        try:
            if self.backups == 0:
                os.unlink(self.path)
            else:
                for i in range(self.backups - 1, 0, -1):
                    src = self.path.with_name(f"{self.path.name}.{i}")
                    if src.exists():
                        os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
                os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        finally:  # even when a rename failed, keep appending to whatever file is at `path`
            self._fd = self._open()
            self._size = os.fstat(self._fd).st_size

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> "RequestLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
