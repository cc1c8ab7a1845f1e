"""Batched sampler: greedy, temperature, top-k, top-p, per-row keys, validation."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.runtime import sampling
from engine.runtime.sampling import (Paths, SamplingParams, batch_arrays, batch_paths, request_key,
                                     sample, step_key)

V = 1000


def keys_for(seeds, steps):
    """[B] typed keys: row b uses step_key(request_key(seeds[b]), steps[b])."""
    base = jnp.stack([request_key(int(s)) for s in seeds])
    return jax.vmap(step_key)(base, jnp.asarray(steps, jnp.int32))


def run(logits, temperature, top_k, top_p, keys, cap=64):
    b = logits.shape[0]
    return np.asarray(sample(jnp.asarray(logits, jnp.float32),
                             jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,)),
                             jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (b,)),
                             jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,)),
                             keys, top_k_cap=cap))


def many_keys(seed, n):
    return jax.vmap(lambda t: step_key(request_key(seed), t))(jnp.arange(n))


def random_logits(seed, b, v=V, scale=3.0):
    return np.random.default_rng(seed).standard_normal((b, v)).astype(np.float32) * scale


def test_greedy_is_argmax_lowest_index_on_ties():
    logits = random_logits(0, 16)
    logits[3, [17, 400, 900]] = 50.0
    got = run(logits, 0.0, 0, 1.0, many_keys(1, 16))
    want = logits.argmax(-1)
    assert want[3] == 17 and (got == want).all() and got.dtype == np.int32
    # top_k / top_p do not change greedy, in a batch with sampled rows too
    temps = np.array([0.0, 1.0] * 8)
    got = run(logits, temps, 5, 0.3, many_keys(2, 16))
    assert (got[temps == 0] == want[temps == 0]).all()


def test_top_k_1_is_greedy():
    logits = random_logits(1, 16)
    for seed in range(3):
        assert (run(logits, 1.3, 1, 1.0, many_keys(seed, 16)) == logits.argmax(-1)).all()
        assert (run(logits, 1.3, 1, 1.0, many_keys(seed, 16), cap=V) == logits.argmax(-1)).all()


def chi_square(tokens, probs):
    counts = np.bincount(tokens, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "sampled a token of probability 0"
    expected = probs * len(tokens)
    nz = probs > 0
    return float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum()), int(nz.sum()) - 1


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,cap", [
    (0.7, 0, 1.0, 64),   # plain: full softmax
    (1.5, 0, 1.0, 64),
    (1.0, 3, 1.0, 64),   # top-k within the cap
    (1.0, 0, 0.8, 64),   # top-p, nucleus within the cap
    (1.0, 0, 0.8, 2),    # top-p, nucleus beyond the cap: full-vocab path
    (0.9, 5, 0.8, 2),    # top-k beyond the cap, then top-p: full-vocab path
])
def test_distribution_matches_softmax(temperature, top_k, top_p, cap):
    logits = np.array([2.0, 1.2, 0.9, 0.1, -0.5, -1.0, -3.0, -np.inf], np.float32)
    n = 20000
    p = softmax(logits.astype(np.float64) / temperature)
    order = np.argsort(-p, kind="stable")
    if top_k:
        p[order[top_k:]] = 0
        p /= p.sum()
    before = np.cumsum(p[order]) - p[order]
    p[order[before >= top_p]] = 0
    p /= p.sum()
    tokens = run(np.tile(logits, (n, 1)), temperature, top_k, top_p, many_keys(11, n), cap=cap)
    stat, dof = chi_square(tokens, p)
    assert stat < 3 * dof + 20, (stat, dof, np.bincount(tokens, minlength=8) / n, p)


def test_top_k_never_outside_top_k():
    b = 16
    rng = np.random.default_rng(5)
    logits = random_logits(5, b, scale=1.0)
    ks = rng.integers(1, 120, b)  # some beyond the cap of 64
    rank_of = np.argsort(np.argsort(-logits, axis=-1, kind="stable"), axis=-1)
    for step in range(40):
        tokens = run(logits, 2.0, ks, 1.0, keys_for(range(b), [step] * b))
        assert (rank_of[np.arange(b), tokens] < ks).all()


def nucleus(logits_row, temperature, top_p):
    p = softmax(logits_row.astype(np.float64) / temperature)
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    margin = np.abs(np.concatenate([before, [1.0]]) - top_p).min()
    return set(order[before < top_p].tolist()), margin


@pytest.mark.parametrize("scale,cap", [(4.0, 64), (0.5, 64), (4.0, 8)])
def test_top_p_never_outside_nucleus(scale, cap):
    b = 16
    logits = random_logits(6, b, scale=scale)
    top_p = np.random.default_rng(6).uniform(0.05, 0.99, b).astype(np.float32)
    sets = [nucleus(logits[i], 0.8, top_p[i]) for i in range(b)]
    for step in range(20):
        tokens = run(logits, 0.8, 0, top_p, keys_for(range(b), [step] * b), cap=cap)
        for i, t in enumerate(tokens):
            allowed, margin = sets[i]
            assert t in allowed or margin < 1e-5


def test_full_vocab_path_matches_ranked_path():
    """Thresholds by bisection (small cap) pick the same token as the rank cut (cap = V)."""
    b = 16
    logits = random_logits(7, b, scale=1.0)
    top_k = np.array([0, 0, 100, 300] * 4, np.int32)
    top_p = np.array([0.5, 0.9, 0.7, 1.0] * 4, np.float32)
    for step in range(5):
        keys = keys_for(range(b), [step] * b)
        assert (run(logits, 1.0, top_k, top_p, keys, cap=8)
                == run(logits, 1.0, top_k, top_p, keys, cap=V)).all()


def test_batch_invariance():
    """A row's token depends only on its own logits, params and key, not on its neighbours."""
    rng = np.random.default_rng(8)
    row_params = [(0.8, 0, 1.0), (0.6, 20, 0.95), (1.0, 0, 0.9), (1.0, 0, 0.99), (0.0, 0, 1.0)]
    for i, (t, k, p) in enumerate(row_params):
        row = random_logits(100 + i, 1, scale=0.3 if p == 0.99 else 3.0)  # 0.99 flat: full path
        solo, batched = [], []
        for step in range(30):
            solo.append(run(row, t, k, p, keys_for([1234 + i], [step]))[0])
            others = random_logits(step, 3, scale=rng.uniform(0.2, 4))
            pos = step % 4
            logits = np.insert(others, pos, row[0], axis=0)
            temps = np.insert(rng.choice([0.0, 0.7, 1.5], 3), pos, t)
            ks = np.insert(rng.choice([0, 1, 40, 500], 3), pos, k)
            ps = np.insert(rng.choice([1.0, 0.5, 0.97], 3), pos, p)
            seeds = np.insert(rng.integers(0, 99, 3), pos, 1234 + i)
            steps = np.insert(rng.integers(0, 99, 3), pos, step)
            batched.append(run(logits, temps, ks, ps, keys_for(seeds, steps))[pos])
        assert solo == batched, (t, k, p)
        if t > 0:
            assert len(set(solo)) > 1  # the row really samples


def test_determinism_and_key_schedule():
    logits = random_logits(9, 4)
    a = [run(logits, 1.0, 0, 0.9, keys_for([7, 8, 9, 10], [s] * 4)) for s in range(5)]
    b = [run(logits, 1.0, 0, 0.9, keys_for([7, 8, 9, 10], [s] * 4)) for s in range(5)]
    c = [run(logits, 1.0, 0, 0.9, keys_for([70, 80, 90, 100], [s] * 4)) for s in range(5)]
    assert all((x == y).all() for x, y in zip(a, b))
    assert any((x != y).any() for x, y in zip(a, c))
    # step t alone equals step t within a run of steps; raw key data equals typed keys
    keys = keys_for([7, 8, 9, 10], [3] * 4)
    assert (run(logits, 1.0, 0, 0.9, keys) == a[3]).all()
    assert (run(logits, 1.0, 0, 0.9, jax.random.key_data(keys)) == a[3]).all()
    assert (jax.random.key_data(request_key(42)) == jax.random.key_data(jax.random.key(42))).all()
    big = jax.random.key_data(request_key(2**64 - 1))
    assert big.tolist() == [2**32 - 1, 2**32 - 1]


def test_masked_tokens_never_sampled_and_jit_inside():
    logits = random_logits(10, 16)
    logits[:, ::2] = -np.inf

    @jax.jit
    def step(logits, keys):
        t, k, p = batch_arrays([SamplingParams(temperature=1.5, top_p=0.99)] * 16)
        return sample(logits, t, k, p, keys)

    for s in range(5):
        assert (step(logits, keys_for(range(16), [s] * 16)) % 2 == 1).all()


@pytest.mark.parametrize("kwargs,msg", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "1"}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"seed": 2**64}, "seed"), ({"seed": "x"}, "seed"), ({"max_tokens": 0}, "max_tokens"),
])
def test_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


def test_params_defaults_and_arrays():
    p = SamplingParams(temperature=0, top_k=20, top_p=0.95, seed=-3, max_tokens=10)
    assert p.greedy and not SamplingParams().greedy
    t, k, pp = batch_arrays([p, SamplingParams()])
    assert t.dtype == np.float32 and k.tolist() == [20, 0] and pp.tolist()[1] == 1.0


def test_batch_paths_classify_rows():
    """Which paths a batch takes, from the host arrays: top_k off at <= 0 and >= V, the full
    path for top-p alone or top_k past the cap."""
    def paths(*rows):
        t, k, p = (np.array(c) for c in zip(*rows))
        return batch_paths(t.astype(np.float32), k.astype(np.int32), p.astype(np.float32), V)

    assert paths((0.0, 0, 1.0), (0.0, 40, 0.5)) == Paths(False, False, False, False)
    assert paths((0.7, 0, 1.0), (0.0, 0, 0.5)) == Paths(True, True, False, False)
    assert paths((0.7, V, 1.0)) == Paths(True, True, False, False)   # top_k >= V: off
    assert paths((0.7, 20, 0.95)) == Paths(True, False, True, False)
    assert paths((0.7, 64, 1.0)) == Paths(True, False, True, False)  # top_k == cap fits
    assert paths((0.7, 65, 1.0)) == Paths(True, False, True, True)
    assert paths((0.7, 0, 0.9), (1.0, 0, 1.0)) == Paths(True, True, True, True)


@pytest.mark.parametrize("conds_on_cpu", [True, False])
def test_known_paths_pick_the_conds_tokens(monkeypatch, conds_on_cpu):
    """With the batch's paths passed (no cond on the device chooses them), every row gets the
    token the conds give, greedy, plain, top-k, nucleus and full-vocabulary rows mixed; also
    with the full path run unconditionally (unrolled), as on a GPU."""
    monkeypatch.setattr(sampling, "_full_under_cond", lambda: conds_on_cpu)
    eager = sample.__wrapped__  # traced afresh: the patched choice applies
    rows = [(0.0, 0, 1.0), (0.8, 0, 1.0), (0.6, 20, 0.95), (1.0, 0, 0.9), (1.0, 0, 0.999),
            (1.2, 300, 1.0)]
    b = len(rows)
    t, k, p = (np.array(c) for c in zip(*rows))
    t, k, p = t.astype(np.float32), k.astype(np.int32), p.astype(np.float32)
    logits = random_logits(21, b, scale=1.0)
    logits[4] *= 0.05  # flat under top_p 0.999: reaches past the cap
    subsets = [list(range(b)), [0], [1], [2, 0], [3, 4], [5, 1]]
    for step in range(4):
        keys = keys_for(range(b), [step] * b)
        for rows_ in subsets:
            x, tt, kk, pp = logits[rows_], t[rows_], k[rows_], p[rows_]
            want = run(x, tt, kk, pp, keys[np.array(rows_)], cap=8)
            paths = batch_paths(tt, kk, pp, V, top_k_cap=8)
            got = eager(jnp.asarray(x), tt, kk, pp, keys[np.array(rows_)], top_k_cap=8,
                        paths=paths)
            assert (np.asarray(got) == want).all(), (rows_, paths)


def test_known_paths_leave_no_cond(monkeypatch):
    """The point of the paths: with them, the sampler's program has no conditional, and the
    full path's bisections are straight-line code where it runs unconditionally (a GPU)."""
    t = np.array([0.7, 0.0], np.float32)
    k = np.array([0, 0], np.int32)
    p = np.array([0.9, 1.0], np.float32)
    args = (jnp.zeros((2, V)), t, k, p, keys_for([1, 2], [0, 0]))

    def branches(paths, under_cond=True):
        monkeypatch.setattr(sampling, "_full_under_cond", lambda: under_cond)
        jax.clear_caches()  # traced afresh: the patched choice applies
        text = sample.lower(*args, paths=paths).as_text()
        return text.count("stablehlo.case"), text.count("stablehlo.while")

    assert branches(None)[0] >= 3  # the default chooses every path on the device
    full = batch_paths(t, k, p, V)
    assert full == Paths(True, False, True, True)
    # A CPU keeps the full path's two bisections (loops) under a cond; unconditional, they
    # are straight-line code. The loop that may be left is the noise's threefry rounds (on a
    # CPU; a GPU's lowering has none): a fixed trip count, run without reading a condition.
    (c_cond, w_cond), (c_none, w_none) = branches(full, True), branches(full, False)
    assert (c_cond, c_none) == (1, 0) and w_cond - w_none == 2 and w_none <= 1
    assert branches(batch_paths(np.zeros(2, np.float32), k, p, V)) == (0, 0)  # greedy
