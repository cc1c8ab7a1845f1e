"""Per-request-keyed batched sampling: greedy, temperature, top-k, top-p.

A request's token at step t is a function of (its seed, t, its logits row) only:
`step_key(request_key(seed), t)` is its key, and every random number a row uses is drawn from its
own key, indexed by token id (Gumbel-max over the whole vocabulary). So the same row gives the same
token in any batch, at any batch position, whichever code path the other rows need.

Order of operations (as in HF / vLLM): divide by temperature, keep the top k, keep the nucleus of
the renormalized top-k distribution (the smallest prefix of the sorted probabilities whose mass
reaches top_p; the top token is always kept), then sample. temperature == 0 is greedy: argmax of
the raw logits, lowest index on ties.

Cost for V = 248,320: a full sort per step is the thing to avoid (XLA:CPU argsort of one row:
~65 ms). Every sampled row takes `lax.top_k(scaled, cap)` with a static cap (default 64) plus O(V)
passes for the Gumbel noise and the normalizer. A row whose kept set provably lies in the cap
(top_k <= cap, or top_k off and top_p reached within the cap's share of the full distribution) is
sampled from the cap alone. Only a row whose set may reach past the cap (top_k > cap, or a flat
distribution under top_p) takes the full-vocab path: thresholds by 32-step bisections on float
bit patterns, no sort. Each path sits under a `lax.cond` that runs only when some row needs it,
and an all-greedy batch skips the noise too. Which path a row takes depends on that row alone,
and every path picks argmax(scaled logit + noise[token]) over the kept set.

Measured on the 2-core CPU box (`python -m engine.runtime.sampling`, best of 5 rounds), ms per step,
B=1 / B=4: greedy 1.1 / 2.3; temperature only 3.7 / 8.0; top_k=20 top_p=0.95 3.0 / 8.1; top_p=0.95
with the nucleus in the cap 3.4 / 8.3; top_p=0.95 on a flat distribution (full path) 6.5 / 21.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

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
        if not _is_int(self.top_k) or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an integer in [0, 2**31) (0 = off), "
                             f"got {self.top_k!r}")
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
            np.array([p.top_k for p in params], np.int32),
            np.array([p.top_p for p in params], np.float32))


class Paths(NamedTuple):
    """Which of the sampler's paths some row of a batch can take, known on the host from the
    rows' parameters (`batch_paths`). Passed to `sample` as a static argument, it replaces the
    data-dependent `lax.cond`s that choose them: on a GPU each such cond copies its predicate to
    the host and blocks the host until the device gets there, so a step's sampling would wait
    for the forward dispatched before it, and the engine could not dispatch the next step
    while the device runs this one (2 ms of idle device a 27B decode step on the H200)."""
    stochastic: bool  # a row with temperature > 0
    plain: bool       # ... and neither top-k nor top-p: the full softmax
    cut: bool         # ... with top-k and/or top-p: from the top `cap`
    full: bool        # ... whose kept set may reach past the cap (top-p alone, or top_k > cap)


def batch_paths(temperature, top_k, top_p, vocab: int,
                top_k_cap: int = DEFAULT_TOP_K_CAP) -> Paths:
    """The `Paths` of a batch from its host arrays (`batch_arrays`'s), rows as `sample` sees
    them: top_k <= 0 or >= vocab is off."""
    temperature, top_k, top_p = (np.asarray(a) for a in (temperature, top_k, top_p))
    hot = temperature > 0
    k = np.where((top_k <= 0) | (top_k >= vocab), 0, top_k)
    plain = hot & (k == 0) & (top_p >= 1.0)
    cut = hot & ~plain
    full = cut & (((k == 0) & (top_p < 1.0)) | (k > min(top_k_cap, vocab)))
    return Paths(bool(hot.any()), bool(plain.any()), bool(cut.any()), bool(full.any()))


@functools.partial(jax.jit, static_argnames=("top_k_cap", "paths"))
def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           keys: jax.Array, top_k_cap: int = DEFAULT_TOP_K_CAP,
           paths: Paths | None = None) -> jax.Array:
    """One token per row.

    logits [B, V] f32; temperature [B] f32 (0 = greedy); top_k [B] int32 (0 = off);
    top_p [B] f32 in (0, 1]; keys [B] typed PRNG keys or [B, 2] uint32 threefry key data.
    paths: None (each path runs under a `lax.cond` on the rows' values), or the batch's
    `batch_paths` (static: the paths no row takes are left out and no cond chooses among the
    others, except the full-vocabulary one on a CPU, where a cond costs nothing more). A row's
    token is the same either way. Returns tokens [B] int32.
    """
    if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.wrap_key_data(keys.astype(jnp.uint32), impl="threefry2x32")
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    top_k = jnp.where((top_k <= 0) | (top_k >= vocab), 0, top_k).astype(jnp.int32)  # 0 = off
    greedy = jnp.argmax(logits, axis=-1)
    stochastic = functools.partial(_sample_stochastic, cap=min(top_k_cap, vocab), paths=paths)
    args = (logits, temperature, top_k, top_p, keys)
    if paths is None:
        picked = jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda *_: greedy, *args)
    elif paths.stochastic:
        picked = stochastic(*args)
    else:
        return greedy.astype(jnp.int32)
    return jnp.where(temperature > 0, picked, greedy).astype(jnp.int32)


def _when(flag: bool | None, pred, fn, other, *args):
    """fn(*args) where some row needs it: under a cond on `pred` (flag None), always (True),
    never (False: `other`)."""
    if flag is None:
        return jax.lax.cond(pred, fn, lambda *_: other, *args)
    return fn(*args) if flag else other


def _sample_stochastic(logits, temperature, top_k, top_p, keys, *, cap, paths=None):
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, _MIN_TEMPERATURE)[:, None]  # [B, V]
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)  # [B, V]
    plain = (top_k == 0) & (top_p >= 1.0)  # [B]: sample from the full softmax, O(V)
    nothing = jnp.zeros(plain.shape, jnp.int32)
    plain_token = _when(paths and paths.plain, jnp.any(plain),
                        lambda: jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32), nothing)
    cut_token = _when(paths and paths.cut, jnp.any(~plain & (temperature > 0)),
                      functools.partial(_sample_cut, cap=cap, paths=paths), nothing,
                      scaled, noise, temperature, top_k, top_p)
    return jnp.where(plain, plain_token, cut_token)


def _full_under_cond() -> bool:
    """Whether the full-vocabulary path stays under its cond when the paths are known."""
    return jax.default_backend() == "cpu"


def _sample_cut(scaled, noise, temperature, top_k, top_p, *, cap, paths=None):
    """Rows with top-k and/or top-p: from the top `cap` when their kept set provably lies there."""
    # top_p applies to the distribution after top-k; with top-k off that is the full softmax.
    cap_vals, cap_idx = jax.lax.top_k(scaled, cap)  # [B, cap], descending, ties: lower index
    in_k = (top_k[:, None] == 0) | (jnp.arange(cap) < top_k[:, None])  # [B, cap]
    lse = jnp.where((top_k > 0)[:, None],
                    jax.nn.logsumexp(jnp.where(in_k, cap_vals, -jnp.inf), axis=-1, keepdims=True),
                    jax.nn.logsumexp(scaled, axis=-1, keepdims=True))  # [B, 1]
    probs = jnp.exp(cap_vals - lse) * in_k
    cum = jnp.cumsum(probs, axis=-1)
    keep = in_k & _in_nucleus(cum - probs, top_p)
    fits = jnp.where(top_k > 0, top_k <= cap, cum[:, -1] >= top_p)
    scores = jnp.where(keep, cap_vals + jnp.take_along_axis(noise, cap_idx, axis=-1), -jnp.inf)
    cap_token = jnp.take_along_axis(cap_idx, jnp.argmax(scores, axis=-1)[:, None], axis=-1)[:, 0]
    needs_full = ~fits & (temperature > 0)
    # with the paths known, the full path runs for every step that may need it, except on a
    # CPU (a cond there only costs the branch), where it stays under its cond
    flag = None if paths is None or (paths.full and _full_under_cond()) else paths.full
    full_token = _when(flag, jnp.any(needs_full),
                       functools.partial(_full_vocab, unroll=flag is not None), cap_token,
                       scaled, noise, top_k, top_p)
    return jnp.where(needs_full, full_token, cap_token)


def _in_nucleus(mass_before, top_p):
    # top_p == 1 keeps everything even where rounding lifts the running mass to 1.0.
    return (mass_before < top_p[:, None]) | (top_p >= 1.0)[:, None]


def _full_vocab(scaled, noise, top_k, top_p, unroll: bool = False):
    """Top-k then top-p over the whole vocabulary without sorting it. Tokens [B].

    Each cut is a threshold found by a 32-step bisection on float bit patterns (a few O(V)
    passes, where an XLA:CPU sort of 248K costs ~65 ms). Values tied at a threshold are all
    kept, so with ties the set can be larger than the rank-based one of the capped path."""
    order_key = _order_preserving_bits(scaled)  # [B, V] uint32, same order as scaled
    kth = _largest_threshold(order_key, lambda above: jnp.sum(above, axis=-1) >= top_k, unroll)
    in_k = (top_k[:, None] == 0) | (order_key >= kth[:, None])
    probs = jax.nn.softmax(jnp.where(in_k, scaled, -jnp.inf), axis=-1)  # >= 0: bits are ordered
    prob_bits = jax.lax.bitcast_convert_type(probs, jnp.uint32)
    cut = _largest_threshold(
        prob_bits, lambda above: jnp.sum(jnp.where(above, probs, 0.0), axis=-1) >= top_p,
        unroll)
    keep = in_k & ((prob_bits >= cut[:, None]) | (top_p >= 1.0)[:, None])
    return jnp.argmax(jnp.where(keep, scaled + noise, -jnp.inf), axis=-1)


def _order_preserving_bits(x):
    """float32 -> uint32 with a < b iff f(a) < f(b) (for non-NaN values)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(keys, enough, unroll: bool = False):
    """Per row, the largest uint32 t with enough(keys >= t) true ([B] -> [B] bool), built bit
    by bit from the top; enough must be monotone (true at t = 0). unroll: the 32 steps as
    straight-line code (no while loop, whose condition a GPU reads on the host each step)."""
    def step(i, t):
        cand = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(enough(keys >= cand[:, None]), cand, t)

    return jax.lax.fori_loop(0, 32, step, jnp.zeros(keys.shape[:1], jnp.uint32), unroll=unroll)


def _bench(vocab: int = 248_320, steps: int = 10, rounds: int = 5) -> None:
    """Per-step sampler cost on this machine: `python -m engine.runtime.sampling`."""
    import time

    cases = {  # name: (temperature, top_k, top_p, logit scale: large = peaked)
        "greedy": (0.0, 0, 1.0, 1.0),
        "temperature only": (0.8, 0, 1.0, 1.0),
        "top_k=20 top_p=0.95": (0.6, 20, 0.95, 1.0),
        "top_p=0.95, nucleus in cap": (0.7, 0, 0.95, 8.0),
        "top_p=0.95, flat (full path)": (1.0, 0, 0.95, 1.0),
    }
    rng = np.random.default_rng(0)
    for batch in (1, 4):
        for name, (t, k, p, scale) in cases.items():
            logits = jnp.asarray(rng.standard_normal((batch, vocab), np.float32) * scale)
            args = (np.full(batch, t, np.float32), np.full(batch, k, np.int32),
                    np.full(batch, p, np.float32))
            keys = jax.vmap(lambda i: step_key(request_key(1), i))(jnp.arange(batch))
            sample(logits, *args, keys).block_until_ready()
            times = []
            for _ in range(rounds):  # the best round: the machine may be shared
                start = time.perf_counter()
                for _ in range(steps):
                    out = sample(logits, *args, keys)
                out.block_until_ready()
                times.append((time.perf_counter() - start) / steps * 1e3)
            print(f"B={batch} V={vocab} {name:30s} {min(times):7.2f} ms/step")


if __name__ == "__main__":
    _bench()
