"""Prometheus metrics of one server, in views: the whole server's figures (request counts,
tokens, latencies, the engine's pools, checkpoints, storage faults) and each principal's own
request figures, so that `/metrics` can show a principal only its own activity
(server/routes/service.py) and the global view only to an admin.

Every view lives on a private `CollectorRegistry` (several servers or tests in one process
never collide); pool gauges are read at scrape time from a stats callback.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from server.checkpoints.status import RESTORE_OUTCOMES, SessionStatus

OUTCOMES = ("completed", "incomplete", "cancelled", "rejected_overloaded",
            "rejected_queue_timeout", "rejected_loading", "error", "bad_request", "unauthorized")
PATHS = ("root", "continuation", "fork", "shared-prefix", "host-restored", "disk-restored")
STORES = ("responses", "checkpoints")
FAULT_KINDS = ("full", "io", "corrupt")

StatsFn = Callable[[], "dict | None"]


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


class RequestMetrics:
    """The request figures of one view (the server, or one principal): outcomes, tokens, reuse
    paths and latencies."""

    def __init__(self, r: CollectorRegistry, ns: str):
        self.registry = r
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


class Views:
    """Calls one RequestMetrics method on every view a request counts in."""

    def __init__(self, views: list[RequestMetrics]):
        self.views = views

    def __getattr__(self, name):
        return _Fanout([getattr(v, name) for v in self.views])


class _Fanout:
    def __init__(self, metrics):
        self.metrics = metrics

    def labels(self, *values):
        return _Fanout([m.labels(*values) for m in self.metrics])

    def inc(self, amount=1):
        for m in self.metrics:
            m.inc(amount)

    def observe(self, value):
        for m in self.metrics:
            m.observe(value)


class Metrics:
    """Prometheus metrics of one server. `stats` returns `Memory.stats()` plus optional
    "running"/"waiting" counts, or None while the model loads (no pool gauges then).
    `all` is the server's view; `view(principal)` a principal's own (by its digest)."""

    def __init__(self, stats: StatsFn | None = None, namespace: str = "ninfer"):
        self.ns = namespace
        self.registry = CollectorRegistry(auto_describe=False)
        ns, r = namespace, self.registry
        self.all = RequestMetrics(r, ns)
        self._principals: dict[str, RequestMetrics] = {}
        self.log_errors = Counter(f"{ns}_log_write_errors", "Request log lines lost to I/O "
                                  "errors.", registry=r)
        self.storage_errors = Counter(
            f"{ns}_storage_errors", "Storage faults by store (the response database, the "
            "checkpoints) and kind (full disk, I/O error, corruption).", ["store", "kind"],
            registry=r)
        for store in STORES:
            for kind in FAULT_KINDS:
                self.storage_errors.labels(store, kind)
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

    def __getattr__(self, name):  # the server view's request figures: m.requests, ...
        if name.startswith("_") or name == "all":
            raise AttributeError(name)
        return getattr(self.all, name)

    def view(self, principal: str | None) -> RequestMetrics | None:
        """A principal's own request figures (by its digest), made at its first request."""
        if principal is None:
            return None
        v = self._principals.get(principal)
        if v is None:
            v = self._principals.setdefault(
                principal, RequestMetrics(CollectorRegistry(auto_describe=False), self.ns))
        return v

    def views(self, principal: str | None) -> Views:
        """The server's view and the principal's, for one request's figures."""
        own = self.view(principal)
        return Views([self.all] if own is None else [self.all, own])

    def render(self, principal: str | None = None) -> tuple[bytes, str]:
        """The exposition: the whole server's (None), or only `principal`'s own figures."""
        if principal is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        return generate_latest(self.view(principal).registry), CONTENT_TYPE_LATEST


