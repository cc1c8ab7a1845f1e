"""The model runner: the forward as an engine runs it, compiled ahead of time, and the sampling
dispatch of a step.

A step's forward runs over every row of the batched cache, or over its own rows alone
(`forward_rows`) where that is narrower (`ModelRunner.narrow`): a prefill piece (one row's) in
an engine of more rows, and with the plan's narrow_decode a decode step of fewer rows than the
engine has. Logits come only at each row's last valid position: a prefill chunk never builds
[T, V]. `compile` builds the executable of every (rows, width) the engine runs, or loads it from
an ExecStore; `forward` then calls them without jit's dispatch and trace cache.

`BatchSampler` samples one token per cache row, from each row's own request: each row's
parameters, key and step come from its sequence's request; a row with a constraint gets its
token bitmask filled on the host while the device still runs the forward just dispatched. Which
sampler paths the batch takes (`engine.runtime.sampling.Paths`) is decided here from the rows'
parameters, so that no cond on the device decides it.
"""
from __future__ import annotations

import concurrent.futures
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from engine.io.loader import LoadedModel, worker_threads
import engine.model.model as M
from engine.plan import KernelPlan
from engine.runtime.sampling import Paths, batch_paths, sample
from engine.runtime.scheduler import Sequence, piece_widths


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


class ModelRunner:
    """The forward of an engine of `batch` rows whose prefill pieces are at most
    `prefill_chunk` wide, for `model` under `plan`."""

    def __init__(self, model: LoadedModel, plan: KernelPlan, *, batch: int, prefill_chunk: int):
        self.model, self.plan, self.B = model, plan, batch
        self.prefill_chunk = prefill_chunk
        cfg = model.cfg
        fwd = M.jit_forward()

        def bound(f):  # the forward's call (and its ahead-of-time lowering) for this engine
            return lambda p, t, c, n: f(p, cfg, t, c, lengths=n, last_only=True, plan=plan)
        self._jit_fwd, self._lower = bound(fwd), bound(fwd.lower)
        rows_fwd = M.jit_forward_rows()

        def bound_rows(f):
            return lambda p, t, c, n, r: f(p, cfg, t, c, r, lengths=n, plan=plan)
        self._jit_rows, self._lower_rows = bound_rows(rows_fwd), bound_rows(rows_fwd.lower)
        # decode steps of fewer rows over those rows alone (the plan's narrow_decode: in an
        # engine of two rows one sequence decodes at a one-row engine's rate, not with the other
        # row as padding through every matmul)
        self.narrow_decode = batch > 1 and plan.narrow_decode
        # (rows, width) -> its compiled forward (compile() fills it): called without jit's
        # dispatch and trace cache, so a width loaded from an ExecStore is never traced; rows
        # B: every row (`forward`), fewer: `forward_rows`
        self._compiled: dict[tuple[int, int], object] = {}
        self._verify = None  # the speculative verify pass (engine/model/verify.py), on first use
        self._draft = None  # the MTP layer's drafts, on first use
        self.exec_counts = {"loaded": 0, "compiled": 0}
        self.exec_saving: threading.Thread | None = None  # compile()'s background saves

    def narrow(self, kind: str, n_seqs: int) -> bool:
        """Whether a step of `n_seqs` sequences runs over its own rows alone (`forward_rows`):
        a prefill piece (one row's) in an engine of more rows; a decode step of fewer rows
        with narrow decode on."""
        if kind == "prefill":
            return self.B > 1
        return self.narrow_decode and n_seqs < self.B

    def shapes(self) -> list[tuple[int, int]]:
        """The (rows, width) forwards this engine runs: every prefill piece width over one
        row (all rows when the engine has one), the narrow decode steps, and the decode step
        over all rows."""
        narrow = 1 if self.B > 1 else self.B
        decode = [(n, 1) for n in range(1, self.B)] if self.narrow_decode else []
        return ([(narrow, w) for w in piece_widths(self.prefill_chunk, self.plan.short_piece)]
                + decode
                + [(self.B, 1)])

    def forward(self, tokens, cache, lengths, rows=None):
        """The forward over every row, or over the cache rows `rows` (tokens and lengths then
        have one row each of them); returns (logits [B, 1, V], hidden or None, cache)."""
        params = self.model.params
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

    def verify(self, tokens, cache, lengths):
        """The speculative verify pass over every row (engine/model/verify.py): returns
        ((logits [T, B, V], conv and rec after each position), the cache). Compiled on first
        use, one executable a draft width."""
        if self._verify is None:
            from engine.model.verify import jit_verify

            fn, cfg, plan = jit_verify(), self.model.cfg, self.plan
            self._verify = lambda p, t, c, n: fn(p, cfg, t, c, n, plan=plan)
        return self._verify(self.model.params, tokens, cache, lengths)

    def draft(self, last, cache, active, k: int):
        """The MTP layer's greedy drafts (engine/model/model.py `mtp_draft`): ([B, k] int32,
        the cache). Compiled on first use."""
        if self._draft is None:
            fn, cfg, plan = M.jit_mtp_draft(), self.model.cfg, self.plan
            self._draft = lambda p, t, c, a, n: fn(p, cfg, t, c, a, k=n, plan=plan)
        return self._draft(self.model.params, last, cache, active, k)

    def compile(self, cache, threads: int | None = None, store=None) -> float:
        """Compile the forward of every shape (`shapes`) for a cache of `cache`'s shapes, ahead
        of time; returns seconds. Needs only the params' shapes and dtypes, so it may run
        before they are on the device: a runner built on ModelLoad.abstract compiles while the
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
        shapes = self.shapes()
        threads = threads or worker_threads()
        params, cache = _abstract(self.model.params), _abstract(cache)
        # a plan with the CUDA ops: build and register their FFI targets first (a compiled or
        # loaded executable calls them; CudaUnavailable says why not); the library's digest
        # (source, compiler, arch, flags) is part of the key
        cuda_lib = None
        if self.plan.uses_cuda:
            from engine.kernels import cuda_build

            cuda_lib = cuda_build.require(self.plan).name

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

        from_cache: list = []  # (key, lowered): compiled afresh and stored in the background

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
            compiled, _ = compile_noting_cache(lowered)
            if store is not None:
                # stored only as compiled afresh in the background (fresh_options): an
                # executable JAX handed back from one of its caches, persistent or in this
                # process (no cache-hit event then), lacks kernels when loaded from the store
                # ("Function wrapped_iota not found" at its first dispatch)
                from_cache.append((keys[sw], lowered))
            return sw, compiled, "compiled"
        with concurrent.futures.ThreadPoolExecutor(threads, "ninfer-compile") as pool:
            for sw, compiled, how in pool.map(compile_shape, shapes):
                self._compiled[sw] = compiled
                self.exec_counts[how] += 1
        if store is not None:
            store.keep(keys.values())
            if from_cache:  # compiled, serialized, written and fsynced off the start's path
                self.exec_saving = store.save_in_background([], from_cache)
        return time.monotonic() - t0

    def attach(self, model: LoadedModel) -> None:
        """Give a runner built on a ModelLoad's abstract model the loaded one (same config,
        shapes and dtypes: the compiled executables stay valid)."""
        if model.cfg != self.model.cfg or (
                jax.tree.structure(model.params) != jax.tree.structure(self.model.params)):
            raise ValueError("attach: the loaded model is not the one the engine was built for")
        self.model = model

    def warm(self, cache):
        """Put a step's host arrays of every shape on the device (as the steps put them) and
        run the decode step once over `cache` with length 0 (nothing is written); returns
        (its logits [B, 1, V], the cache)."""
        for n, w in self.shapes():
            jax.device_put(np.zeros((n, w), np.int32))
            jax.device_put(np.zeros((n,), np.int32))
        logits, _, cache = self.forward(jnp.zeros((self.B, 1), jnp.int32), cache,
                                        jnp.zeros((self.B,), jnp.int32))
        return logits, cache


# ---- the sampling dispatch ------------------------------------------------------------------
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


# The most alternatives a token's log-probabilities list (the Responses API's top_logprobs: 0-20).
MAX_TOP_LOGPROBS = 20


def _token_logprobs(logits, picked, *, n_vocab: int, k: int):
    """Each row's sampled token's log-probability under the model's distribution (the raw
    logits at temperature 1, before top_p and any constraint mask) and its k most likely
    tokens: (logprob [B], top ids [B, k], top logprobs [B, k])."""
    ids = jnp.arange(logits.shape[-1])
    logp = jax.nn.log_softmax(jnp.where(ids[None, :] < n_vocab, logits, -jnp.inf), axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.maximum(picked, 0)[:, None], axis=1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, k)
    return chosen, top_ids, top_lp


# The sampler variants `BatchSampler.warm` compiles: what the server's requests make (top_k is
# never set there): greedy, temperature alone, temperature with top_p < 1.
WARM_PATHS = (Paths(False, False, False, False), Paths(True, True, False, False),
              Paths(True, False, True, True))


class BatchSampler:
    """The sampler of an engine of `batch` rows over a vocabulary of `n_vocab` tokens (ids past
    it are padding) and a context of `context_tokens`."""

    def __init__(self, *, batch: int, n_vocab: int, context_tokens: int):
        self.B, self.context_tokens = batch, context_tokens
        # paths (static): which sampler paths the batch's rows take
        self._sample = jax.jit(functools.partial(_sample_rows, n_vocab=n_vocab),
                               static_argnames=("paths",))
        self._mask_words = (n_vocab + 31) // 32  # bitmask row width
        self._logprobs = jax.jit(functools.partial(_token_logprobs, n_vocab=n_vocab),
                                 static_argnames=("k",))

    def logprobs(self, logits, picked, rows: list):
        """The log-probabilities of the tokens `picked` for the rows whose request asked for
        them (`GenerationRequest.logprobs`), or None when no row did: (logprob [B], top ids
        [B, k], top logprobs [B, k]) as numpy arrays, k the most any row asked for (a row's
        own count is cut from it). Rows that did not ask pay nothing: the call is skipped."""
        wanted = [s.payload.logprobs for s in rows
                  if s is not None and s.payload.logprobs is not None]
        if not wanted:
            return None
        k = max(1, min(MAX_TOP_LOGPROBS, max(wanted)))
        return tuple(np.asarray(a) for a in self._logprobs(logits, picked, k=k))

    def sample(self, logits, rows: list, ahead: int = 0) -> tuple[jax.Array, list]:
        """Dispatch the sampling of each row's token (`rows[b]`: the sequence in cache row b,
        or None): (the tokens [B] on the device, the rows whose constraint failed). `ahead`:
        tokens sampled but not yet accepted before this one (1 for a chained step), so its key
        step is the synced path's."""
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
                mask = self.mask_rows() if mask is None else mask
                try:
                    seq.payload.constraint.fill_mask(mask[b], self.remaining(seq) - ahead)
                except Exception:  # a failed constraint ends its own sequence only
                    mask[b] = -1
                    failed.append(b)
        paths = batch_paths(temp, top_k, top_p, logits.shape[-1])
        return self._sample(logits, temp, top_k, top_p, keys, steps, mask, paths=paths), failed

    def mask_rows(self) -> np.ndarray:
        """All-ones bitmasks, one row per cache row: every token allowed."""
        return np.full((self.B, self._mask_words), -1, np.int32)

    def remaining(self, seq: Sequence) -> int:
        """Tokens `seq` may still produce, the one being sampled included."""
        done = len(seq.output_ids)
        return min(seq.max_tokens - done, self.context_tokens - len(seq.prompt_ids) - done)

    def warm(self, logits) -> None:
        """Compile the server's sampler variants (`WARM_PATHS`), unmasked and masked, on
        `logits` [B, V] (a first request, constrained or not, would otherwise compile its
        own)."""
        args = (np.zeros((self.B,), np.float32), np.zeros((self.B,), np.int32),
                np.ones((self.B,), np.float32), np.zeros((self.B, 2), np.uint32),
                np.zeros((self.B,), np.int32))
        for paths in WARM_PATHS:
            for mask in (None, self.mask_rows()):
                jax.block_until_ready(self._sample(logits, *args, mask, paths=paths))
