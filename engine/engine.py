"""The serving engine: one thread that owns the device and runs requests from a queue.

The HTTP layer submits a `GenerationRequest` and receives events through the request's `emit`
callback (called on the engine thread; the server forwards them to its event loop). This first
version runs one sequence at a time; the runtime work adds paged KV and batching behind the same
interface.
"""
from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from engine import model as M
from engine.loader import LoadedModel
from engine.sampling import SamplingParams, request_key, sample, step_key


@dataclass
class TokenEvent:
    token_id: int


@dataclass
class DoneEvent:
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    output_tokens: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    error: str | None = None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    emit: Callable[[object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.monotonic)


def prefill_pieces(n: int, chunk: int) -> list[int]:
    """Split n prompt tokens into full chunks plus power-of-two pieces.

    Every piece size is a power of two <= chunk, so prefill compiles for at most log2(chunk)+1
    shapes and never needs padding (padding would enter the recurrent state).
    """
    pieces = [chunk] * (n // chunk)
    rest, bit = n % chunk, chunk >> 1
    while rest:
        if rest >= bit:
            pieces.append(bit)
            rest -= bit
        bit >>= 1
    return pieces


def _masked_sample(logits, temperature, top_k, top_p, keys, *, n_vocab: int):
    """Sample after masking the padded vocabulary rows (ids >= n_vocab have no token)."""
    ids = jnp.arange(logits.shape[-1])
    logits = jnp.where(ids[None, :] < n_vocab, logits, -jnp.inf)
    return sample(logits, temperature, top_k, top_p, keys)


class Engine:
    def __init__(self, model: LoadedModel, *, context_tokens: int, prefill_chunk: int):
        self.model = model
        self.context_tokens = context_tokens
        self.prefill_chunk = prefill_chunk
        self._queue: queue.Queue[GenerationRequest | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
        cfg, n_vocab = model.cfg, model.tokenizer.vocab_size
        fwd = M.jit_forward()
        # Logits only at the last position: a prefill chunk never materialises [T, V] logits.
        self._step = lambda p, t, c: fwd(p, cfg, t, c, last_only=True)
        self._sample = jax.jit(functools.partial(_masked_sample, n_vocab=n_vocab))

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def submit(self, req: GenerationRequest) -> None:
        self._queue.put(req)

    def warmup(self) -> float:
        """Compile the decode step and every prefill piece shape; returns seconds taken."""
        t0 = time.monotonic()
        sizes = sorted(set(prefill_pieces(2 * self.prefill_chunk - 1, self.prefill_chunk)))
        cache = M.init_cache(self.model.cfg, 1, self.context_tokens, self.model.kv_dtype)
        for size in sizes:
            logits, _, cache = self._step(self.model.params, jnp.zeros((1, size), jnp.int32),
                                          cache)
        self._sample_one(logits[:, -1], SamplingParams(), request_key(0), 0)
        jax.block_until_ready(cache)
        return time.monotonic() - t0

    # ---- the loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            req = self._queue.get()
            if req is None:
                return
            try:
                self._run(req)
            except Exception as e:  # the engine thread must survive a failed request
                req.emit(DoneEvent("error", len(req.prompt_ids), 0, error=type(e).__name__))

    def _sample_one(self, logits, sp: SamplingParams, key, step: int) -> int:
        tok = self._sample(logits, jnp.asarray([sp.temperature], jnp.float32),
                           jnp.asarray([sp.top_k], jnp.int32),
                           jnp.asarray([sp.top_p], jnp.float32), step_key(key, step)[None])
        return int(tok[0])

    def _run(self, req: GenerationRequest) -> None:
        n = len(req.prompt_ids)
        if req.cancelled.is_set():
            req.emit(DoneEvent("cancelled", n, 0))
            return
        t0 = time.monotonic()
        cache = M.init_cache(self.model.cfg, 1, self.context_tokens, self.model.kv_dtype)
        ids = np.asarray(req.prompt_ids, np.int32)[None]
        pos = 0
        for size in prefill_pieces(n, self.prefill_chunk):
            logits, _, cache = self._step(self.model.params, ids[:, pos:pos + size], cache)
            pos += size
        key = request_key(req.sampling.seed)
        tok = self._sample_one(logits[:, -1], req.sampling, key, 0)
        t1 = time.monotonic()
        produced = 0
        reason = "length"
        while True:
            if req.cancelled.is_set():
                reason = "cancelled"
                break
            if tok in req.stop_ids:
                reason = "stop"
                break
            req.emit(TokenEvent(tok))
            produced += 1
            if produced >= req.max_tokens or n + produced >= self.context_tokens:
                break
            logits, _, cache = self._step(self.model.params, jnp.asarray([[tok]], jnp.int32),
                                          cache)
            tok = self._sample_one(logits[:, -1], req.sampling, key, produced)
        req.emit(DoneEvent(reason, n, produced, prefill_s=t1 - t0,
                           decode_s=time.monotonic() - t1))
