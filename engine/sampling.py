"""Per-request-keyed batched sampling: greedy, temperature, top-k, top-p.

A request's token at step t is a function of (its seed, t, its logits row) only:
`step_key(request_key(seed), t)` is its key, and every random number a row uses is drawn from its
own key, indexed by token id (Gumbel-max over the whole vocabulary). So the same row gives the same
token in any batch, at any batch position, whichever code path the other rows need.

Order of operations (as in HF / vLLM): divide by temperature, keep the top k, keep the nucleus of
the renormalized top-k distribution (the smallest prefix of the sorted probabilities whose mass
reaches top_p; the top token is always kept), then sample. temperature == 0 is greedy: argmax of
the raw logits, lowest index on ties.

Cost for V = 248,320: a full sort per step is the thing to avoid. Every row takes
`lax.top_k(logits, cap)` with a static cap (default 64) and one O(V) pass for the Gumbel noise and
the normalizer. A row whose kept set is provably inside the cap (top_k <= cap, or top_p reached
within the cap's mass of the full distribution) is sampled from the cap alone. Only a row whose
set may lie beyond the cap (top_k > cap, or top_k off with top_p not reached within the cap, e.g. a
flat distribution) needs the full-vocab sort, and that branch runs under `lax.cond` only when some
row of the batch needs it. Both paths pick argmax(scaled logit + noise[token]) over the same kept
set, so a row's token does not depend on which path ran.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_TOP_K_CAP = 64
_MIN_TEMPERATURE = 1e-6  # logits / T stays finite in f32 for |logit| < 3e32


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler. top_k == 0 and top_p == 1 mean off."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # None: the engine draws one when it admits the request
    max_tokens: int | None = None  # None: up to the context limit

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def request_key(seed: int) -> jax.Array:
    """A request's base key (typed, threefry). Any seed in [-2**63, 2**64), taken mod 2**64.

    Same key as `jax.random.key(seed)` for seeds in [0, 2**63)."""
    s = int(seed) % 2**64
    data = np.array([s >> 32, s & 0xFFFFFFFF], dtype=np.uint32)
    return jax.random.wrap_key_data(data, impl="threefry2x32")


def step_key(key: jax.Array, step) -> jax.Array:
    """The key of the token at decode step `step` (0 = first generated token); vmappable."""
    return jax.random.fold_in(key, step)


def batch_arrays(params: list[SamplingParams]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(temperature [B] f32, top_k [B] int32, top_p [B] f32) for `sample`."""
    return (np.array([p.temperature for p in params], np.float32),
            np.array([min(p.top_k, 2**31 - 1) for p in params], np.int32),
            np.array([p.top_p for p in params], np.float32))


@functools.partial(jax.jit, static_argnames=("top_k_cap",))
def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           keys: jax.Array, top_k_cap: int = DEFAULT_TOP_K_CAP) -> jax.Array:
    """One token per row.

    logits [B, V] f32; temperature [B] f32 (0 = greedy); top_k [B] int32 (0 = off);
    top_p [B] f32 in (0, 1]; keys [B] typed PRNG keys or [B, 2] uint32 threefry key data.
    Returns tokens [B] int32.
    """
    if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.wrap_key_data(keys.astype(jnp.uint32), impl="threefry2x32")
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    cap = min(top_k_cap, vocab)
    top_k = jnp.where((top_k <= 0) | (top_k >= vocab), 0, top_k)  # [B], 0 = off
    scaled = logits / jnp.maximum(temperature, _MIN_TEMPERATURE)[:, None]  # [B, V]
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)  # [B, V]

    # top_p is applied to the distribution after top-k; with top-k off that is the full softmax.
    cap_vals, cap_idx = jax.lax.top_k(scaled, cap)  # [B, cap], sorted descending
    ranks = jnp.arange(cap)
    in_k = jnp.where(top_k[:, None] > 0, ranks < top_k[:, None], True)  # [B, cap]
    full_lse = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)  # [B, 1]
    k_lse = jax.nn.logsumexp(jnp.where(in_k, cap_vals, -jnp.inf), axis=-1, keepdims=True)
    lse = jnp.where((top_k > 0)[:, None], k_lse, full_lse)
    probs = jnp.exp(cap_vals - lse) * in_k
    cum = jnp.cumsum(probs, axis=-1)  # [B, cap]
    keep = in_k & _in_nucleus(cum - probs, top_p)
    cap_mass = cum[:, -1]
    # Inside the cap: top_k <= cap, or top_p reached within the cap (top_k off).
    fits = jnp.where(top_k > 0, top_k <= cap, (top_p >= 1.0) | (cap_mass >= top_p))
    cap_noise = jnp.take_along_axis(noise, cap_idx, axis=-1)
    pick = jnp.argmax(jnp.where(keep, cap_vals + cap_noise, -jnp.inf), axis=-1)
    cap_token = jnp.take_along_axis(cap_idx, pick[:, None], axis=-1)[:, 0]

    # top_k and top_p off: plain sampling from the full softmax, O(V).
    plain_token = jnp.argmax(scaled + noise, axis=-1)
    needs_full = ~fits & ~((top_k == 0) & (top_p >= 1.0)) & (temperature > 0)
    full_token = jax.lax.cond(jnp.any(needs_full), _full_vocab, lambda *a: plain_token,
                              scaled, noise, top_k, top_p)
    stochastic = jnp.where(needs_full, full_token,
                           jnp.where((top_k == 0) & (top_p >= 1.0), plain_token, cap_token))
    return jnp.where(temperature <= 0, jnp.argmax(logits, axis=-1), stochastic).astype(jnp.int32)


def _in_nucleus(mass_before, top_p):
    # top_p == 1 keeps everything even where rounding lifts the running mass to 1.0.
    return (mass_before < top_p[:, None]) | (top_p >= 1.0)[:, None]


def _full_vocab(scaled, noise, top_k, top_p):
    """Top-k then top-p over the whole vocabulary: a sort of [B, V]. Tokens [B]."""
    order = jnp.argsort(-scaled, axis=-1, stable=True)  # ties: lower index first, as lax.top_k
    vals = jnp.take_along_axis(scaled, order, axis=-1)
    ranks = jnp.arange(scaled.shape[-1])
    in_k = jnp.where(top_k[:, None] > 0, ranks < top_k[:, None], True)
    vals_k = jnp.where(in_k, vals, -jnp.inf)
    probs = jax.nn.softmax(vals_k, axis=-1)
    keep = in_k & _in_nucleus(jnp.cumsum(probs, axis=-1) - probs, top_p)
    scores = jnp.where(keep, vals + jnp.take_along_axis(noise, order, axis=-1), -jnp.inf)
    return jnp.take_along_axis(order, jnp.argmax(scores, axis=-1)[:, None], axis=-1)[:, 0]


def _bench(vocab: int = 248_320, steps: int = 20) -> None:
    """Per-step sampler cost on this machine: `python -m engine.sampling`."""
    import time

    cases = {  # name: (temperature, top_k, top_p, logit scale: large = peaked)
        "greedy": (0.0, 0, 1.0, 1.0),
        "temperature only": (0.8, 0, 1.0, 1.0),
        "top_k=20 top_p=0.95": (0.6, 20, 0.95, 1.0),
        "top_p=0.95, nucleus in cap": (0.7, 0, 0.95, 8.0),
        "top_p=0.95, flat (full sort)": (1.0, 0, 0.95, 1.0),
    }
    rng = np.random.default_rng(0)
    for batch in (1, 4):
        for name, (t, k, p, scale) in cases.items():
            logits = jnp.asarray(rng.standard_normal((batch, vocab), np.float32) * scale)
            args = (np.full(batch, t, np.float32), np.full(batch, k, np.int32),
                    np.full(batch, p, np.float32))
            keys = jax.vmap(lambda i: step_key(request_key(1), i))(jnp.arange(batch))
            sample(logits, *args, keys).block_until_ready()
            start = time.perf_counter()
            for _ in range(steps):
                out = sample(logits, *args, keys)
            out.block_until_ready()
            ms = (time.perf_counter() - start) / steps * 1e3
            print(f"B={batch} V={vocab} {name:30s} {ms:7.2f} ms/step")


if __name__ == "__main__":
    _bench()
