"""Speculative sampling's accept/resample rule (temperature > 0): the tokens it emits are
distributed exactly as the target's, whatever the drafter proposed.

For a draft x_1..x_k drawn from proposal distributions q_1..q_k and the target's distributions
p_1..p_{k+1} at those positions (after temperature, top-k/top-p and the constraint's mask):
draft token i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
the token is drawn from the residual norm(max(p_i - q_i, 0)) and the pass ends; when every draft
is accepted a bonus token is drawn from p_{k+1}. Each emitted token is then distributed as p
(Leviathan et al. 2023, Chen et al. 2023). A deterministic drafter (prompt lookup) has q a point
mass on its token: accepted with probability p(x), else drawn from p with x removed.

The engine's verify step (engine/runtime/speculative.py) accepts a draft only where the
verifier's own seeded sample equals it, which keeps seeded outputs equal to non-speculative
ones; this rule accepts more often at temperature > 0 (by sum_x min(p(x), q(x)) a position
instead of sum_x p(x) q(x)) and is what a drafter with a proposal distribution (MTP) wants.
Tested against the target distribution by a chi-square test (tests/test_spec_sampling.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def accept_resample(p, q, drafts, key):
    """One row's pass. p: target probabilities [k + 1, V]; q: proposal probabilities [k, V];
    drafts: [k] int32 drawn from q; key: a PRNG key. Returns (accepted: how many drafts were
    kept, tokens [k + 1]: the drafts kept, then the resampled or bonus token, then -1s)."""
    k = drafts.shape[0]
    u_key, r_key = jax.random.split(key)
    u = jax.random.uniform(u_key, (k,))
    px = jnp.take_along_axis(p[:k], drafts[:, None], axis=1)[:, 0]
    qx = jnp.take_along_axis(q, drafts[:, None], axis=1)[:, 0]
    # u < p/q, written without the division (q(x) > 0 for a drawn x)
    ok = u * qx < px
    accepted = jnp.argmin(jnp.concatenate([ok, jnp.zeros((1,), bool)]))  # first rejection
    residual = jnp.maximum(p[:k] - q, 0.0)
    # the bonus row (all accepted) samples p_{k+1} itself
    dist = jnp.concatenate([residual, p[k:k + 1]], axis=0)[accepted]
    dist = jnp.where(dist.sum() > 0, dist, p[accepted])  # p == q there: any p-draw is exact
    last = jax.random.categorical(r_key, jnp.log(dist))
    idx = jnp.arange(k + 1)
    tokens = jnp.where(idx < accepted, jnp.concatenate([drafts, jnp.zeros((1,), drafts.dtype)]),
                       jnp.where(idx == accepted, last, -1))
    return accepted, tokens.astype(jnp.int32)


def accept_always(p, q, drafts, key):
    """A wrong rule, for the test that must tell it apart: every draft kept, then a bonus
    token from p_{k+1}."""
    k = drafts.shape[0]
    bonus = jax.random.categorical(key, jnp.log(p[k]))
    return jnp.int32(k), jnp.concatenate([drafts, bonus[None]]).astype(jnp.int32)
