"""The serving engine: one thread owns the device and runs the scheduler's steps.

The HTTP layer submits a `GenerationRequest` (which may raise `QueueFull`) and receives
`TokenEvent`s and one `DoneEvent` through the request's `emit` callback, called on the engine
thread. Up to `max_concurrency` sequences run at once, each in its own row of a batched paged
cache: decode steps are batched over all decoding rows, prefill runs in chunks interleaved with
them. A prompt that extends a stored state (an earlier response of the same principal, or the
shared system prefix) continues from it and computes only its new tokens.
"""
from __future__ import annotations

import concurrent.futures
import functools
import secrets
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from engine.io.loader import LoadedModel, worker_threads
import engine.model.model as M
from engine.plan import REFERENCE, KernelPlan, check_plan
from engine.runtime.memory import Memory
from engine.runtime.scheduler import (QueueFull, Scheduler, Sequence,  # noqa: F401 (re-export)
                                      SeqStatus, piece_widths)
from engine.runtime.sampling import Paths, SamplingParams, batch_paths, request_key, sample


class PromptTooLong(ValueError):
    """A prompt of at least the engine's context_tokens: it could never be admitted (the
    server answers 400 context_length_exceeded before it gets here)."""


@dataclass
class TokenEvent:
    token_id: int


@dataclass
class DoneEvent:
    finish_reason: str  # "stop" | "length" | "cancelled" | "queue_timeout" | "error"
    prompt_tokens: int
    output_tokens: int
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    error: str | None = None
    cached_tokens: int = 0
    path: str = "root"  # root | continuation | fork | shared-prefix | host-restored

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    emit: Callable[[object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    principal: str | None = None         # states are stored and reused per principal only
    session: str | None = None           # prompt_cache_key: None marks a one-off request
    prefix_boundary: int = 0             # end of the stable prefix (system turn): snapshot there
    key_data: np.ndarray | None = None   # uint32[2], the request's sampling key
    first_token_at: float | None = None
    path: str = "root"
    cached_tokens: int = 0
    # engine.constrain.Constraint (tool_choice, JSON format, thinking budget); None: no mask and
    # no per-step cost. Owned by the engine thread once submitted.
    constraint: object | None = None


def _sample_rows(logits, temperature, top_k, top_p, key_data, steps, mask=None, *,
                 n_vocab: int, paths: Paths | None = None):
    """Sample one token per row; row b uses only fold_in(key_b, steps_b): batch-invariant.

    logits: [B, V] f32; key_data: [B, 2] uint32; steps: [B] int32. Ids >= n_vocab are padding
    rows of the embedding with no token: masked out. mask: None or int32 [B, W] bitmasks (bit
    id & 31 of word id >> 5 = allowed; an all-ones row leaves its logits bit-identical).
    """
    ids = jnp.arange(logits.shape[-1])
    allowed = ids[None, :] < n_vocab
    if mask is not None:
        word = jnp.take(mask, jnp.minimum(ids >> 5, mask.shape[1] - 1), axis=1)  # [B, V]
        allowed = allowed & (((word >> (ids & 31)) & 1) == 1)
    logits = jnp.where(allowed, logits, -jnp.inf)
    keys = jax.vmap(lambda k, s: jax.random.fold_in(jax.random.wrap_key_data(k), s))(
        key_data, steps)
    return sample(logits, temperature, top_k, top_p, keys, paths=paths)


# The sampler variants warm_run compiles: what the server's requests make (top_k is never set
# there): greedy, temperature alone, temperature with top_p < 1.
WARM_PATHS = (Paths(False, False, False, False), Paths(True, True, False, False),
              Paths(True, False, True, True))


# Stop ids a row may have for its decode steps to be chained on the device (`_chain`): the
# on-device stop test compares the sampled token with this many ids (padded with -1).
CHAIN_STOP_IDS = 16


def _next_inputs(picked, stops, live):
    """The next decode step's tokens [B, 1] and lengths [B] from the device-resident tokens
    `picked` [B] that the last step sampled: a row continues (length 1) where it is `live`
    and its token is none of its stop ids `stops` [B, S] (a stop token is never fed, as the
    synced path never feeds it); any other row has length 0 and its state is left alone."""
    cont = live & jnp.all(picked[:, None] != stops, axis=1)
    return picked[:, None].astype(jnp.int32), cont.astype(jnp.int32)


def _next_inputs_rows(picked, stops, live, rows):
    """`_next_inputs` for the cache rows `rows` [n] alone (a narrow decode step): tokens
    [n, 1], lengths [n]."""
    return _next_inputs(picked[rows], stops[rows], live[rows])


@dataclass
class _InFlight:
    """A chained decode step on the device whose sampled tokens the host has not read: its
    rows (as dispatched), the tokens, and its entry in the scheduler's step log."""
    seqs: tuple
    picked: object
    log_at: int


class Engine:
    def __init__(self, model: LoadedModel, *, context_tokens: int, prefill_chunk: int,
                 max_concurrency: int = 1, max_queue: int = 16, queue_timeout_s: float = 120.0,
                 capacity_tokens: int | None = None, state_slots: int = 8,
                 host_state_bytes: int = 0, before_evict=None, plan: KernelPlan = REFERENCE):
        self.model = model
        # what runs: the forward's implementations and the loop's form (engine/plan.py)
        self.plan = check_plan(plan)
        self.context_tokens = context_tokens
        self.max_queue = max_queue
        self.sched = Scheduler(max_concurrency=max_concurrency, max_queue=max_queue,
                               queue_timeout_s=queue_timeout_s,
                               capacity_tokens=min(capacity_tokens or context_tokens *
                                                   max_concurrency,
                                                   context_tokens * max_concurrency),
                               prefill_chunk=prefill_chunk)
        self._inbox: queue.Queue[Sequence | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
        cfg = model.cfg
        fwd = M.jit_forward()
        # Logits only at each row's last valid position: a prefill chunk never builds [T, V].
        def bound(f):  # the forward's call (and its ahead-of-time lowering) for this engine
            return lambda p, t, c, n: f(p, cfg, t, c, lengths=n, last_only=True, plan=plan)
        self._jit_fwd, self._lower = bound(fwd), bound(fwd.lower)
        # A prefill piece is one row's: in an engine of more rows it runs over that row alone
        # (`forward_rows`), not with the others as padding through every matmul.
        rows_fwd = M.jit_forward_rows()

        def bound_rows(f):
            return lambda p, t, c, n, r: f(p, cfg, t, c, r, lengths=n, plan=plan)
        self._jit_rows, self._lower_rows = bound_rows(rows_fwd), bound_rows(rows_fwd.lower)
        # (rows, width) -> its compiled forward (compile() fills it): called without jit's
        # dispatch and trace cache, so a width loaded from an ExecStore is never traced; rows
        # B: every row (`forward`), fewer: `forward_rows`
        self._compiled: dict[tuple[int, int], object] = {}
        self.exec_counts = {"loaded": 0, "compiled": 0}
        self.exec_saving: threading.Thread | None = None  # compile()'s background saves
        # paths (static): which sampler paths the batch's rows take, known here from their
        # parameters, so that no cond on the device decides it (`engine.runtime.sampling.Paths`)
        self._sample = jax.jit(functools.partial(_sample_rows,
                                                 n_vocab=model.tokenizer.vocab_size),
                               static_argnames=("paths",))
        self._mask_words = (model.tokenizer.vocab_size + 31) // 32  # bitmask row width
        self.mem = Memory(cfg, batch=max_concurrency, context_tokens=context_tokens,
                          capacity_tokens=capacity_tokens or context_tokens * max_concurrency,
                          kv_dtype=model.kv_dtype, conv_dtype=model.compute_dtype,
                          state_slots=state_slots, host_state_bytes=host_state_bytes,
                          before_evict=before_evict)
        self.B = max_concurrency
        # decode steps of fewer rows over those rows alone (the plan's narrow_decode: in an
        # engine of two rows one sequence decodes at a one-row engine's rate, not with the other
        # row as padding through every matmul)
        self._narrow = self.B > 1 and plan.narrow_decode
        # chained decode steps (the plan's chain_decode): the next step is dispatched with the
        # sampled tokens still on the device, before the host reads them, so the host's
        # dispatch and its token work run while the device computes
        self._overlap = plan.chain_decode
        self._next_inputs = jax.jit(_next_inputs)
        self._next_inputs_rows = jax.jit(_next_inputs_rows)
        # the device's stop ids, live rows and (narrow) row ids of the last chained row set: a
        # chain's steps reuse them instead of building and copying them each step
        self._chain_rows: tuple[tuple, object, object, object] | None = None
        self._inflight: _InFlight | None = None
        self.chained_steps = 0  # decode steps dispatched before the last one's tokens were read

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def submit(self, req: GenerationRequest) -> None:
        """Queue a request; raises QueueFull when max_queue requests already wait, and
        PromptTooLong at once for a prompt that leaves no room in the context (it would wait
        in the queue until its timeout, as no row can ever hold it)."""
        if len(req.prompt_ids) >= self.context_tokens:
            raise PromptTooLong(f"the prompt is {len(req.prompt_ids)} tokens; the context holds "
                                f"{self.context_tokens}, including at least one output token")
        with self._lock:
            if self._pending >= self.max_queue:
                raise QueueFull(f"{self._pending} requests already waiting")
            self._pending += 1
        seed = req.sampling.seed
        if seed is None:  # unseeded sampling: a fresh key per request
            seed = secrets.randbits(63)
        req.key_data = np.asarray(jax.random.key_data(request_key(seed)))
        self._inbox.put(Sequence(prompt_ids=list(req.prompt_ids), max_tokens=req.max_tokens,
                                 emit=req.emit, payload=req,
                                 breakpoint=req.prefix_boundary))

    def forget(self, principal: str, tokens) -> None:
        """Drop the stored state that follows exactly `tokens` for `principal` (asynchronous:
        done by the engine thread before its next step)."""
        from engine.runtime.prefix import token_key

        self._inbox.put(("forget", principal, token_key(principal, tokens)))

    def forget_session(self, principal: str, session: str) -> None:
        """Drop every stored state of (principal, session) (asynchronous, like `forget`)."""
        self._inbox.put(("forget_session", principal, session))

    def call(self, fn) -> concurrent.futures.Future:
        """Run `fn(self)` on the engine thread between steps (it may read and change `mem`);
        returns a Future with its result. Used for checkpoint export and restore."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self))
                except Exception as e:  # reported to the caller, never kills the loop
                    fut.set_exception(e)

        self._inbox.put(run)
        return fut

    def warmup(self, threads: int | None = None) -> float:
        """Compile the decode step, every prefill piece width and the sampler; returns seconds.
        The same as compile() then warm_run()."""
        return self.compile(threads) + self.warm_run()

    def _fwd(self, params, tokens, cache, lengths, rows=None):
        """The forward over every row, or over the cache rows `rows` (tokens and lengths then
        have one row each of them); returns (logits [B, 1, V], hidden or None, cache)."""
        compiled = self._compiled.get((tokens.shape[0], tokens.shape[1]))
        if rows is None:
            if compiled is not None:
                return compiled(params, tokens, cache, lengths=lengths)
            return self._jit_fwd(params, tokens, cache, lengths)
        if compiled is not None:
            logits, cache = compiled(params, tokens, cache, rows, lengths=lengths)
        else:
            logits, cache = self._jit_rows(params, tokens, cache, lengths, rows)
        return logits, None, cache

    def _narrow_step(self, kind: str, seqs) -> bool:
        """Whether a step runs over its own rows alone (`forward_rows`): a prefill piece (one
        row's) in an engine of more rows; a decode step of fewer rows with narrow decode on."""
        if kind == "prefill":
            return self.B > 1
        return self._narrow and len(seqs) < self.B

    def _shapes(self) -> list[tuple[int, int]]:
        """The (rows, width) forwards this engine runs: every prefill piece width over one
        row (all rows when the engine has one), and the decode step over all rows."""
        narrow = 1 if self.B > 1 else self.B
        decode = [(n, 1) for n in range(1, self.B)] if self._narrow else []
        return ([(narrow, w) for w in piece_widths(self.sched.prefill_chunk)] + decode
                + [(self.B, 1)])

    def compile(self, threads: int | None = None, store=None) -> float:
        """Compile the forward for the decode step and every prefill piece width, ahead of
        time; returns seconds. Needs only the params' shapes and dtypes, so it may run before
        they are on the device: an engine built on ModelLoad.abstract compiles while the
        weights are copied, and attach() gives it the loaded model afterwards.

        The widths compile on a thread pool: XLA compiles (or loads from the persistent cache)
        with the GIL released, so they overlap; the steps then call these executables. Nothing
        runs: running every prefill width, as a compile-by-calling warmup must, would cost ~16K
        tokens of forward work at startup.

        store: an ExecStore (engine/runtime/exec_store.py) or None. A width whose executable
        the store holds under this call's key is loaded from it, without tracing or lowering;
        the others are compiled, and saved into it on a background thread (`exec_saving`);
        the store drops what no start used for two weeks. `exec_counts` says how many were
        loaded and compiled."""
        from engine.runtime.exec_store import (compile_noting_cache, describe,
                                               runtime_description)

        t0 = time.monotonic()
        shapes = self._shapes()
        threads = threads or worker_threads()
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                              self.model.params)
        cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.mem.cache)
        # a plan with the CUDA ops: build and register their FFI targets first (a compiled or
        # loaded executable calls them; CudaUnavailable says why not); the library's digest
        # (source, compiler, arch, flags) is part of the key
        cuda_lib = None
        if self.plan.uses_cuda:
            from engine.kernels import cuda_ops

            cuda_lib = cuda_ops.require(self.plan).name

        def leaves(tree):
            flat, treedef = jax.tree.flatten(tree)
            return [str(treedef), [[list(x.shape), str(x.dtype)] for x in flat]]
        call = {"cfg": repr(self.model.cfg), "params": leaves(params), "cache": leaves(cache),
                "batch": self.B, "plan": self.plan.to_dict(), "fn": "forward/last_only",
                "cuda_lib": cuda_lib}
        runtime = runtime_description() if store is not None else None
        def describe_shape(n, w):
            if n == self.B:  # the key the store has always had for the whole batch's forward
                return describe({**call, "width": w}, runtime)
            return describe({**call, "fn": "forward_rows", "rows": n, "width": w}, runtime)
        keys = ({sw: describe_shape(*sw) for sw in shapes} if store is not None else {})

        to_save, from_cache = [], []  # (key, compiled), (key, lowered): for the store

        def compile_shape(sw):
            n, w = sw
            compiled = store.load(keys[sw]) if store is not None else None
            if compiled is not None:
                return sw, compiled, "loaded"
            i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
            if n == self.B:
                lowered = self._lower(params, i32((n, w)), cache, i32((n,)))
            else:
                lowered = self._lower_rows(params, i32((n, w)), cache, i32((n,)), i32((n,)))
            compiled, cached = compile_noting_cache(lowered)
            if store is not None:
                (from_cache if cached else to_save).append(
                    (keys[sw], lowered if cached else compiled))
            return sw, compiled, "compiled"
        with concurrent.futures.ThreadPoolExecutor(threads, "ninfer-compile") as pool:
            for sw, compiled, how in pool.map(compile_shape, shapes):
                self._compiled[sw] = compiled
                self.exec_counts[how] += 1
        if store is not None:
            store.keep(keys.values())
            if to_save or from_cache:  # serialized, written and fsynced off the start's path
                self.exec_saving = store.save_in_background(to_save, from_cache)
        return time.monotonic() - t0

    def attach(self, model: LoadedModel) -> None:
        """Give an engine built on a ModelLoad's abstract model the loaded one (same config,
        shapes and dtypes: the compiled executables stay valid). Before start() only."""
        if model.cfg != self.model.cfg or (
                jax.tree.structure(model.params) != jax.tree.structure(self.model.params)):
            raise ValueError("attach: the loaded model is not the one the engine was built for")
        self.model = model

    def warm_run(self) -> float:
        """Run the decode step once (length 0: nothing is written) and the samplers on its
        logits, so that the first request neither compiles nor loads anything; returns
        seconds. Needs the params on the device."""
        t0 = time.monotonic()
        self.mem.warm()  # admission, reuse and storing's device ops (`Memory.warm`)
        for n, w in self._shapes():  # a step's host arrays, as `_run_step` puts them
            jax.device_put(np.zeros((n, w), np.int32))
            jax.device_put(np.zeros((n,), np.int32))
        zero = jnp.zeros((self.B,), jnp.int32)
        logits, _, self.mem.cache = self._fwd(self.model.params,
                                              jnp.zeros((self.B, 1), jnp.int32), self.mem.cache,
                                              zero)
        picked, _ = self._sample_batch(logits[:, 0], [None] * self.B)
        # the chained steps' inputs (`_chain`), compiled here rather than on a first request
        stops = jnp.full((self.B, CHAIN_STOP_IDS), -1, jnp.int32)
        live = jnp.zeros((self.B,), bool)
        jax.block_until_ready(self._next_inputs(picked, stops, live))
        for n, w in self._shapes():
            if w == 1 and n < self.B:  # a narrow decode step's
                jax.block_until_ready(self._next_inputs_rows(
                    picked, stops, live, jax.device_put(np.zeros((n,), np.int32))))
        # The server's sampler variants, unmasked and masked (a first request, constrained
        # or not, would otherwise compile its own).
        args = (np.zeros((self.B,), np.float32), np.zeros((self.B,), np.int32),
                np.ones((self.B,), np.float32), np.zeros((self.B, 2), np.uint32),
                np.zeros((self.B,), np.int32))
        for paths in WARM_PATHS:
            for mask in (None, self._mask_rows()):
                jax.block_until_ready(self._sample(logits[:, 0], *args, mask, paths=paths))
        jax.block_until_ready(self.mem.cache)
        return time.monotonic() - t0

    # ---- the loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            if self._inflight is not None:
                # a chained decode step is on the device: chain the next one or read it; the
                # inbox (submissions, commands, stop) waits until no step is in flight
                self._advance_inflight()
                continue
            if not self._drain_inbox(block=self.sched.idle):
                return
            for seq in self.sched.expire():
                self._unpend()
                seq.emit(DoneEvent(seq.finish_reason, len(seq.prompt_ids), 0,
                                   queue_s=time.monotonic() - seq.enqueued_at))
            for seq in self.sched.admit():
                self._unpend()
                req = seq.payload
                req.path, req.cached_tokens = self.mem.begin(seq, req.principal)
                seq.computed = req.cached_tokens
            for seq in list(self.sched.running):
                if seq.payload.cancelled.is_set():
                    self._finish(seq, "cancelled")
            step = self.sched.next_step()
            if step is None:
                continue
            try:
                self._run_step(step)
            except Exception as e:  # the engine thread must survive a failed step
                for seq in step.seqs:
                    self._finish(seq, "error", error=type(e).__name__)

    def _drain_inbox(self, block: bool) -> bool:
        """Move submissions into the scheduler; False when asked to stop."""
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            while True:
                if item is None:
                    return False
                if callable(item):  # a command from `call`: runs between steps
                    item()
                elif isinstance(item, tuple):  # ("forget" | "forget_session", principal, key)
                    getattr(self.mem, item[0])(item[1], item[2])
                else:
                    self.sched.waiting.append(item)  # capacity was checked by submit()
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _unpend(self) -> None:
        with self._lock:
            self._pending -= 1

    def _run_step(self, step) -> None:
        # [B, width]: a prefill piece may be right-padded past its size; padded steps are not
        # valid, so they write no KV and leave the GDN state alone (tests/test_engine_padding.py),
        # and pages are made for the real tokens only.
        # Over the step's own rows where that is narrower than the engine (`_narrow_step`):
        # tokens row i is step.seqs[i]'s; else over every row, row b the sequence in slot b.
        narrow = self._narrow_step(step.kind, step.seqs)
        n = len(step.seqs) if narrow else self.B
        tokens = np.zeros((n, step.width), np.int32)
        lengths = np.zeros((n,), np.int32)
        for i, seq in enumerate(step.seqs):
            at = i if narrow else seq.slot
            if step.kind == "prefill":
                tokens[at, :step.size] = seq.prompt_ids[step.start:step.start + step.size]
                lengths[at] = step.size
            else:
                tokens[at, 0] = seq.output_ids[-1]
                lengths[at] = 1
        rows = np.array([seq.slot for seq in step.seqs], np.int32) if narrow else None
        self.mem.prepare(step.seqs, max(step.size, 1))
        # fresh arrays each step: device_put (jnp.asarray compiles a staging computation for
        # each new shape, ~10 ms the first time a piece width runs)
        logits, _, self.mem.cache = self._fwd(
            self.model.params, jax.device_put(tokens), self.mem.cache, jax.device_put(lengths),
            None if rows is None else jax.device_put(rows))
        if step.kind == "prefill":
            seq = step.seqs[0]
            self.sched.prefilled(seq, step.size)
            if seq.computed == seq.breakpoint:
                self.mem.snapshot(seq, seq.payload.principal, seq.computed, "prefix")
            ready = [s for s in step.seqs if s.prefill_remaining == 0]
        else:
            ready = list(step.seqs)
        if ready:
            rows = [None] * self.B
            for s in ready:
                rows[s.slot] = s
            picked, failed = self._sample_batch(logits[:, 0], rows)
            # a decode step: the next one goes to the device before this one's tokens are read
            nxt = self._chain(step.seqs, picked) if step.kind == "decode" and not failed \
                else None
            self._collect(ready, picked, failed)
            if nxt is not None:
                self._settle_log(nxt)
            self._inflight = nxt

    # ---- chained decode steps -------------------------------------------------------------
    # While only decode steps of the same rows can follow (nothing waiting or prefilling, no
    # constraint, no command or submission in the inbox), step K + 1 is dispatched with step
    # K's sampled tokens still on the device, and only then are K's tokens read and accepted:
    # the host's dispatch and token work run while the device computes, where the synced
    # path leaves the device idle for both (H200 v24i: 0.7-0.8 ms a 27B step). The results
    # are the synced path's: K + 1 feeds a row exactly the token the synced path would feed
    # it (a stop token, tested on the device, and a row ending at its budget get length 0,
    # which leaves its state alone), with the same sampling key and step; a row that ended
    # at K is dropped from K + 1's log entry and its K + 1 token is never read.
    def _may_chain(self, seqs) -> bool:
        running = self.sched.running
        return (self._overlap and self._inbox.empty() and not self.sched.waiting
                and all(s.status is SeqStatus.DECODING for s in running)
                and set(running) <= set(seqs)
                and all(s.payload.constraint is None and not s.payload.cancelled.is_set()
                        and len(s.payload.stop_ids) <= CHAIN_STOP_IDS for s in seqs))

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the token in flight for `seq` (not yet read) will be its last (`_accept`)."""
        done = len(seq.output_ids) + 1
        return done >= seq.max_tokens or len(seq.prompt_ids) + done >= self.context_tokens

    def _chain(self, seqs, picked) -> _InFlight | None:
        """Dispatch the decode step after the one whose sampled tokens `picked` (on the
        device, unread) are for `seqs`; None where it may not be chained (`_may_chain`)."""
        if not self._may_chain(seqs):
            return None
        nxt = tuple(s for s in seqs
                    if s.status is SeqStatus.DECODING and not self._ends_by_length(s))
        # only where the pages are there without evicting a stored state: the synced path
        # would release the pages of rows that end at K first
        if not nxt or not all(s.table.can_append(1) for s in nxt):
            return None
        rows = [None] * self.B
        for s in nxt:
            rows[s.slot] = s
        key = tuple((s.slot, s.seq_id) for s in nxt)
        if self._chain_rows is None or self._chain_rows[0] != key:
            stops = np.full((self.B, CHAIN_STOP_IDS), -1, np.int32)
            live = np.zeros((self.B,), bool)
            for s in nxt:
                ids = sorted(s.payload.stop_ids)
                stops[s.slot, :len(ids)] = ids
                live[s.slot] = True
            rows_dev = None
            if self._narrow_step("decode", nxt):
                rows_dev = jax.device_put(np.array([s.slot for s in nxt], np.int32))
            self._chain_rows = (key, jax.device_put(stops), jax.device_put(live), rows_dev)
        self.sched.step_log.append(("decode", tuple(s.seq_id for s in nxt)))
        log_at = len(self.sched.step_log) - 1
        self.mem.prepare(nxt, 1)
        _, stops_dev, live_dev, rows_dev = self._chain_rows
        if rows_dev is None:
            tokens, lengths = self._next_inputs(picked, stops_dev, live_dev)
        else:
            tokens, lengths = self._next_inputs_rows(picked, stops_dev, live_dev, rows_dev)
        logits, _, self.mem.cache = self._fwd(self.model.params, tokens, self.mem.cache,
                                              lengths, rows_dev)
        nxt_picked, _ = self._sample_batch(logits[:, 0], rows, ahead=1)
        self.chained_steps += 1
        return _InFlight(nxt, nxt_picked, log_at)

    def _settle_log(self, inf: _InFlight) -> None:
        """Once the step before `inf` is read (its entry is the log's last): rows that ended
        there were never fed by `inf` (length 0): its log entry lists the rows the synced
        path's step would have had, and goes when none is left."""
        ids = tuple(s.seq_id for s in inf.seqs if s.status is SeqStatus.DECODING)
        if ids:
            self.sched.step_log[inf.log_at] = ("decode", ids)
        else:  # every row ended at K: a step the synced path never runs (its rows all at 0)
            del self.sched.step_log[inf.log_at]

    def _advance_inflight(self) -> None:
        """Chain the step after the one in flight (when it may be), then read and accept the
        in-flight step's tokens."""
        inf, self._inflight = self._inflight, None
        try:
            nxt = self._chain(inf.seqs, inf.picked)
            self._collect([s for s in inf.seqs if s.status is SeqStatus.DECODING],
                          inf.picked, [])
            if nxt is not None:
                self._settle_log(nxt)
            self._inflight = nxt
        except Exception as e:  # the engine thread must survive a failed step
            for seq in inf.seqs:
                if seq.status is not SeqStatus.FINISHED:
                    self._finish(seq, "error", error=type(e).__name__)

    def _collect(self, seqs, picked, failed: list) -> None:
        """Read a step's sampled tokens (the host waits for the device here) and accept each
        row's; failed rows (a constraint that could not build its mask) get -1."""
        picked = np.array(picked)
        picked[failed] = -1  # _accept finishes these with "error"
        for s in seqs:
            self._accept(s, int(picked[s.slot]))

    def _sample_batch(self, logits, rows: list, ahead: int = 0) -> tuple[jax.Array, list]:
        """Dispatch the sampling of each row's token: (the tokens [B] on the device, the rows
        whose constraint failed). `ahead`: tokens sampled but not yet accepted before this
        one (1 for a chained step), so its key step is the synced path's."""
        temp = np.zeros((self.B,), np.float32)
        top_k = np.zeros((self.B,), np.int32)
        top_p = np.ones((self.B,), np.float32)
        keys = np.zeros((self.B, 2), np.uint32)
        steps = np.zeros((self.B,), np.int32)
        mask, failed = None, []
        for b, seq in enumerate(rows):
            if seq is None:
                continue
            sp = seq.payload.sampling
            temp[b], top_k[b], top_p[b] = sp.temperature, sp.top_k, sp.top_p
            keys[b], steps[b] = seq.payload.key_data, len(seq.output_ids) + ahead
            if seq.payload.constraint is not None:
                # Host work for constrained rows only, while the device still runs the
                # forward just dispatched; other rows keep all-ones rows (logits unchanged).
                mask = self._mask_rows() if mask is None else mask
                try:
                    seq.payload.constraint.fill_mask(mask[b], self._remaining(seq))
                except Exception:  # a failed constraint ends its own sequence only
                    mask[b] = -1
                    failed.append(b)
        paths = batch_paths(temp, top_k, top_p, logits.shape[-1])
        return self._sample(logits, temp, top_k, top_p, keys, steps, mask, paths=paths), failed

    def _mask_rows(self) -> np.ndarray:
        return np.full((self.B, self._mask_words), -1, np.int32)

    def _remaining(self, seq: Sequence) -> int:
        """Tokens `seq` may still produce, the one being sampled included."""
        done = len(seq.output_ids)
        return min(seq.max_tokens - done, self.context_tokens - len(seq.prompt_ids) - done)

    def _accept(self, seq: Sequence, tok: int) -> None:
        req: GenerationRequest = seq.payload
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        con = req.constraint
        if con is not None:
            try:
                if tok < 0:
                    raise RuntimeError("the constraint failed to build its mask")
                con.accept(tok)
            except Exception as e:  # a failed constraint ends its own sequence only
                self._finish(seq, "error", error=f"constraint: {type(e).__name__}")
                return
        if tok in req.stop_ids:
            self._finish(seq, "stop")
            return
        seq.output_ids.append(tok)
        seq.emit(TokenEvent(tok))
        total = len(seq.prompt_ids) + len(seq.output_ids)
        if con is not None and con.terminated:  # the grammar is complete: nothing may follow
            self._finish(seq, "stop", last_fed=False)
        elif len(seq.output_ids) >= seq.max_tokens or total >= self.context_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, error: str | None = None,
                last_fed: bool | None = None) -> None:
        req: GenerationRequest = seq.payload
        if reason in ("stop", "length") and seq.status.value == "decoding":
            # The state covers every token fed so far: all outputs when the last sampled token
            # was a stop token (never fed), all but the last when the budget ran out or the
            # constraint ended the output on a token that was never fed.
            last_fed = reason != "length" if last_fed is None else last_fed
            fed = len(seq.prompt_ids) + len(seq.output_ids) - (not last_fed)
            self.mem.snapshot(seq, req.principal, fed, "response", one_off=req.session is None,
                              session=req.session)
        self.mem.end(seq)
        self.sched.finish(seq, reason)
        now = time.monotonic()
        first = req.first_token_at or now
        admitted = seq.admitted_at or seq.enqueued_at
        seq.emit(DoneEvent(reason, len(seq.prompt_ids), len(seq.output_ids),
                           queue_s=admitted - seq.enqueued_at, prefill_s=first - admitted,
                           decode_s=now - first, error=error,
                           cached_tokens=req.cached_tokens, path=req.path))
