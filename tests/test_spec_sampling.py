"""Speculative sampling keeps the target distribution: a chi-square test of the accept/resample
rule (engine/runtime/spec_sampling.py) with a proposal uniform over the target's top 8 tokens,
and the same test catching a rule that accepts every draft."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from engine.runtime.spec_sampling import accept_always, accept_resample

V, K, N = 64, 2, 20_000


def _target():
    """Two different target distributions (positions 1, 2) and the bonus one, over V tokens."""
    rng = np.random.default_rng(7)
    return jax.nn.softmax(jnp.asarray(rng.standard_normal((K + 1, V)) * 1.5, jnp.float32), -1)


def _uniform_top8(p):
    top = jax.lax.top_k(p, 8)[1]
    return jnp.zeros_like(p).at[jnp.arange(p.shape[0])[:, None], top].set(1 / 8)


def _draw(rule):
    """N seeded passes: drafts from q, then the rule. Returns (accepted [N], tokens [N, K+1])."""
    p = _target()
    q = _uniform_top8(p[:K])

    def one(seed):
        dk, rk = jax.random.split(jax.random.key(seed))
        drafts = jax.random.categorical(dk, jnp.log(q), axis=-1).astype(jnp.int32)
        return rule(p, q, drafts, rk)
    acc, toks = jax.jit(jax.vmap(one))(jnp.arange(N))
    return np.asarray(p), np.asarray(acc), np.asarray(toks)


def _p_value(samples, probs) -> float:
    """Chi-square goodness of fit; tokens expected fewer than 5 times share one bin."""
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    probs = np.asarray(probs, np.float64)
    expected = probs / probs.sum() * len(samples)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * (obs.sum() / exp.sum())).pvalue)


def test_accept_resample_keeps_the_target_distribution():
    p, acc, toks = _draw(accept_resample)
    assert _p_value(toks[:, 0], p[0]) >= 0.001
    second = toks[acc >= 1, 1]  # a second token exists where the first draft was kept
    assert len(second) > 2_000 and _p_value(second, p[1]) >= 0.001
    # it accepts sum_x min(p, q) of the first drafts: more than a matching rule's sum_x p q
    q = 1 / 8 * (np.argsort(-p[0])[:8][:, None] == np.arange(V)).any(0)
    assert abs((acc >= 1).mean() - np.minimum(p[0], q).sum()) < 0.02
    assert (acc >= 1).mean() > (p[0] * q).sum()


def test_always_accepting_fails_the_same_test():
    p, _, toks = _draw(accept_always)
    assert _p_value(toks[:, 0], p[0]) < 0.001
