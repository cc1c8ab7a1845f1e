"""The sampling dispatch of a step: one token per cache row, from each row's own request.

Each row's parameters, key and step come from its sequence's request; a row with a constraint
gets its token bitmask filled on the host while the device still runs the forward just
dispatched. Which sampler paths the batch takes (`engine.runtime.sampling.Paths`) is decided
here from the rows' parameters, so that no cond on the device decides it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from engine.runtime.sampling import Paths, batch_paths, sample
from engine.runtime.scheduler import Sequence


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
