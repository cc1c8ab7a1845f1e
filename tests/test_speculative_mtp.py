"""The MTP drafter's bookkeeping on the embedded tiny model (fp32, CPU), against a reference.

An engine that drafts with the model's MTP layer keeps that layer's KV current behind every
forward (`mtp_track`): prefill pieces and decode steps over a paged cache must leave the MTP
entries a single `mtp_forward` over the whole history writes into a contiguous cache, and
`mtp_draft` must propose what chaining `mtp_forward` greedily from the last hidden state does.
(The engine-level check, speculation on against off, is tests/test_speculative.py.)
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import engine.model.model as M
from engine.ops import paged_kv as pk
from engine.runtime.speculative import SpecConfig

N = 40          # tokens of history
PIECES = (16, 16)  # two prefill pieces, then decode steps to N
PAGE = 16


@pytest.fixture(scope="module")
def history(tiny_model):
    rng = np.random.default_rng(3)
    return rng.integers(1000, 60000, size=N + 1).astype(np.int32)  # x_0..x_N


def _paged(model, tokens, rows: int = 1):
    """Feed tokens[:N] through a paged MTP-tracking cache as the engine does (the same tokens in
    each of `rows` rows); returns it."""
    cfg = model.cfg
    pages = -(-(N + 8) // PAGE)
    pool = pk.init_kv_pool(cfg, rows * pages, PAGE, jnp.float32, mtp=True)
    table = np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)
    cache = M.init_paged_cache(cfg, pool, table)
    cache = cache._replace(mtp_hidden=jnp.zeros((rows, cfg.hidden_size), jnp.float32))
    at = 0
    for width in PIECES + (1,) * (N - sum(PIECES)):
        chunk = jnp.asarray(np.repeat(tokens[None, at:at + width], rows, axis=0))
        _, _, cache = M.forward(model.params, cfg, chunk, cache, last_only=True)
        at += width
    return cache


def test_tracked_mtp_entries_and_drafts_match_one_full_pass(tiny_model, history):
    cfg, params = tiny_model.cfg, tiny_model.params
    cache = _paged(tiny_model, history)
    assert int(cache.pos[0]) == N and int(cache.mtp_pos[0]) == N - 1

    # the reference: the whole history at once, then the MTP layer over entries 0..N-2
    ref = M.init_cache(cfg, 1, N + 8, jnp.float32)
    _, hidden, _ = M.forward(params, cfg, jnp.asarray(history[None, :N]), ref)
    mref = M.init_cache(cfg, 1, N + 8, jnp.float32)
    _, _, mref = M.mtp_forward(params, cfg, hidden[:, :N - 1],
                               jnp.asarray(history[None, 1:N]), mref)
    # entry j sits in slot j + 1 of the MTP layer (pool layer num_blocks)
    k_pool = np.asarray(cache.pool.k[cfg.num_blocks]).reshape(-1, *cache.pool.k.shape[3:])
    got = k_pool[1:N]
    want = np.asarray(mref.mtp_k[0, 0, :N - 1])
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(cache.mtp_hidden[0]), np.asarray(hidden[0, N - 1]),
                               rtol=2e-4, atol=2e-4)

    # drafts after x_N: chain mtp_forward greedily from h_{N-1}
    k = 3
    want_drafts, h, tok = [], hidden[:, N - 1:N], jnp.asarray(history[None, N:N + 1])
    for _ in range(k):
        logits, h, mref = M.mtp_forward(params, cfg, h, tok, mref)
        tok = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
        want_drafts.append(int(tok[0, 0]))
    drafts, after = M.mtp_draft(params, cfg, jnp.asarray(history[N:N + 1]), cache,
                                jnp.asarray([k], jnp.int32), k)
    assert [int(t) for t in np.asarray(drafts)[0]] == want_drafts
    assert int(after.mtp_pos[0]) == N - 1 and int(after.pos[0]) == N


def test_drafts_take_the_engine_plan(tiny_model, history):
    """mtp_draft runs the engine's kernel plan (the runner passes it): under the cpu plan the
    shared lm_head is the one-row product of each live row (a cond under a map in the traced
    program; absent under the reference plan), and the live row drafts the same tokens."""
    import jax

    from engine.plan import CPU, REFERENCE

    cfg, params, k = tiny_model.cfg, tiny_model.params, 3
    cache = _paged(tiny_model, history, rows=2)
    last, steps = jnp.asarray(history[N:N + 1].repeat(2)), jnp.asarray([k, 0], jnp.int32)
    got = {}
    for name, plan in (("reference", REFERENCE), ("cpu", CPU)):
        jaxpr = str(jax.make_jaxpr(lambda c, plan=plan: M.mtp_draft(params, cfg, last, c, steps,
                                                                     k, plan=plan))(cache))
        assert ("cond[" in jaxpr) == (name == "cpu"), name
        mine = jax.tree.map(jnp.copy, cache)  # the jitted draft donates its cache
        drafts, _ = M.jit_mtp_draft()(params, cfg, last, mine, steps, k=k, plan=plan)
        got[name] = [int(t) for t in np.asarray(drafts)[0]]
    assert got["cpu"] == got["reference"]


def test_a_row_drafting_fewer_steps_writes_no_further_slot(tiny_model, history):
    cfg = tiny_model.cfg
    cache = _paged(tiny_model, history)
    before = np.asarray(cache.pool.k[cfg.num_blocks]).copy()
    _, after = M.mtp_draft(tiny_model.params, cfg, jnp.asarray(history[N:N + 1]), cache,
                           jnp.asarray([1], jnp.int32), 4)
    now = np.asarray(after.pool.k[cfg.num_blocks]).reshape(-1, *after.pool.k.shape[3:])
    was = before.reshape(now.shape)
    changed = [s for s in range(now.shape[0]) if not np.array_equal(now[s], was[s])]
    assert changed in ([], [N])  # step 1 rewrites entry N - 1 (slot N) with the same inputs


def test_mtp_drafter_needs_mtp_weights(tiny_model, tmp_path):
    import dataclasses

    from engine.engine import Engine

    bare = dataclasses.replace(tiny_model, params={k: v for k, v in tiny_model.params.items()
                                                   if k != "mtp"})
    with pytest.raises(ValueError, match="speculative.method 'mtp' needs a model with MTP"):
        Engine(bare, context_tokens=64, prefill_chunk=16,
               speculative=SpecConfig.from_settings("mtp", 2))
