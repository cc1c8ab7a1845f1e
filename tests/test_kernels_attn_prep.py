"""The attention layer's decode prep kernel (engine/kernels/attn_prep.py: q/k norms, RoPE and
the K/V write into the paged pool) against the model's ops in the Pallas interpreter, its
Triton lowering, and the model's paged decode through it against the plain path; on a GPU
(`-m gpu`) at the 27B's heads."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels import attn_prep as A
from engine.model.config import QWEN38_27B, TEST_SMALL
from engine.ops import paged_kv as pk
from engine.plan import PALLAS
from tests.kernel_checks import assert_close, lowers_for_cuda, on_gpu, paged_decode_ab


def _case(rng, cfg, b=2, pages=6, page=16, layers=3, dtype=jnp.bfloat16):
    nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = jnp.asarray(rng.standard_normal((b, 1, nh * 2 * hd + 2 * kvh * hd)) * 2, dtype)
    qn = jnp.asarray(rng.standard_normal((4, hd)) * 0.2, dtype)
    kn = jnp.asarray(rng.standard_normal((4, hd)) * 0.2, dtype)
    shape = (layers, pages, page, kvh, hd)
    pool = pk.KVPool(jnp.asarray(rng.standard_normal(shape), dtype),
                     jnp.asarray(rng.standard_normal(shape), dtype), None, None)
    # row 0 on pages [4, 1, ...], row 1 on [2, 5, ...]: its slot in the second page
    table = jnp.asarray([[4, 1, -1], [2, 5, 0]][:b], jnp.int32)
    positions = jnp.asarray([[5], [page + 3]][:b], jnp.int32)
    return qkv, qn, kn, pool, table, positions


def _run(cfg, qkv, qn, kn, pool, table, positions, valid, layer, off=0):
    got = A.attn_prep(cfg, qkv, qn, kn, pool, table, positions, valid, jnp.int32(layer), off,
                      qn_index=jnp.asarray([3], jnp.int32), kn_index=jnp.asarray([1], jnp.int32))
    want = A.prep_ref(cfg, qkv, qn[3], kn[1], pool, table, positions, valid, jnp.int32(layer), off)
    return got, want


@pytest.mark.parametrize("off", [0, 1])
def test_attn_prep_matches_the_model_ops(off):
    cfg = TEST_SMALL
    rng = np.random.default_rng()
    qkv, qn, kn, pool, table, positions = _case(rng, cfg)
    valid = jnp.asarray([[True], [True]])
    (q, got), (want_q, want) = _run(cfg, qkv, qn, kn, pool, table, positions, valid, 2, off)
    assert q.shape == want_q.shape and q.dtype == jnp.bfloat16
    assert_close(q, want_q, jnp.bfloat16)
    # one slot a row written (close to the reference's), every other slot untouched
    for new, ref, old in ((got.k, want.k, pool.k), (got.v, want.v, pool.v)):
        new, ref, old = (np.asarray(a, np.float32) for a in (new, ref, old))
        slots = (ref != old).any(axis=(-1, -2))
        assert slots.sum() == 2
        assert np.array_equal(new[~slots], old[~slots])
        assert_close(new[slots], ref[slots], jnp.bfloat16)


def test_attn_prep_drops_invalid_rows_and_slots_past_the_table():
    cfg = TEST_SMALL
    rng = np.random.default_rng()
    qkv, qn, kn, pool, table, positions = _case(rng, cfg)
    valid = jnp.asarray([[False], [True]])
    positions = positions.at[1, 0].set(3 * 16 + 2)  # past row 1's three pages
    (q, got), (want_q, _) = _run(cfg, qkv, qn, kn, pool, table, positions, valid, 0)
    for a, b in ((got.k, pool.k), (got.v, pool.v)):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert_close(q, want_q, jnp.bfloat16)


def test_attn_prep_checks_its_input_and_says_what_it_takes():
    cfg = TEST_SMALL
    rng = np.random.default_rng()
    qkv, qn, kn, pool, table, positions = _case(rng, cfg)
    with pytest.raises(ValueError, match="columns"):
        A.attn_prep(cfg, qkv[..., :-1], qn[0], kn[0], pool, table, positions,
                    jnp.ones((2, 1), bool), jnp.int32(0))
    x = jnp.zeros((2, 1, cfg.hidden_size), jnp.bfloat16)
    assert A.takes(cfg, pool, x) and A.takes(QWEN38_27B, pool, x)
    assert not A.takes(cfg, pool, x.astype(jnp.float32))
    assert not A.takes(cfg, pool, jnp.zeros((2, 4, cfg.hidden_size), jnp.bfloat16))
    int8 = pk.KVPool(pool.k.astype(jnp.int8), pool.v.astype(jnp.int8),
                     jnp.ones(pool.k.shape[:-1], jnp.float32),
                     jnp.ones(pool.v.shape[:-1], jnp.float32))
    assert not A.takes(cfg, int8, x)


def test_attn_prep_lowers_to_triton():
    cfg = QWEN38_27B
    rng = np.random.default_rng()
    qkv, qn, kn, pool, table, positions = _case(rng, cfg, pages=4, page=64, layers=2)
    lowers_for_cuda(lambda q, a, b, p, t, s: A.attn_prep(
        cfg, q, a, b, p, t, s, jnp.ones((2, 1), bool), jnp.int32(1), 0,
        qn_index=jnp.asarray([0], jnp.int32), kn_index=jnp.asarray([2], jnp.int32),
        interpret=False), qkv, qn, kn, pool, table, positions)


CFG = dataclasses.replace(TEST_SMALL, name="test-small-prep")


def test_model_paged_decode_through_attn_prep_matches_the_plain_path():
    """bf16 paged decode steps with the pallas plan: the prep kernel (attn_prep=True) gives
    the plain path's logits within bf16's bound and writes the same KV pages."""
    prep = dataclasses.replace(PALLAS, attn_prep=True)
    outs = paged_decode_ab(CFG, {"off": PALLAS, "on": prep}, "attn_prep")
    assert_close(outs["on"][0], outs["off"][0], jnp.bfloat16)
    assert_close(outs["on"][1].pool.k, outs["off"][1].pool.k, jnp.bfloat16)
    assert_close(outs["on"][1].pool.v, outs["off"][1].pool.v, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu(), reason="needs a GPU (run with -m gpu on the H200)")
def test_attn_prep_gpu_27b_heads():
    cfg = QWEN38_27B
    rng = np.random.default_rng()
    qkv, qn, kn, pool, table, positions = _case(rng, cfg, pages=6, page=64, layers=2)
    valid = jnp.asarray([[True], [True]])
    (q, got), (want_q, want) = _run(cfg, qkv, qn, kn, pool, table, positions, valid, 1)
    assert_close(q, want_q, jnp.bfloat16)
    assert_close(got.k, want.k, jnp.bfloat16)
    assert np.array_equal(np.asarray(got.v, np.float32), np.asarray(want.v, np.float32))


def test_attn_prep_writes_q_as_the_paged_kernel_tiles_it():
    """pad=16: q as [B, kvh, 16, hd], each group's heads then zero rows, bit for bit the
    plain q; the same pool; a pad short of a group's heads is an error; it lowers."""
    cfg = TEST_SMALL
    rng = np.random.default_rng()
    qkv, qn, kn, pool, table, positions = _case(rng, cfg)
    valid = jnp.asarray([[True], [False]])
    args = (cfg, qkv, qn[0], kn[1], pool, table, positions, valid, jnp.int32(1))
    q, p1 = A.attn_prep(*args)
    qp, p2 = A.attn_prep(*args, pad=16)
    b, kvh, r, hd = 2, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    assert qp.shape == (b, kvh, 16, hd)
    want = np.zeros((b, kvh, 16, hd), np.float32)
    want[:, :, :r] = np.asarray(q, np.float32).reshape(b, kvh, r, hd)
    np.testing.assert_array_equal(np.asarray(qp, np.float32), want)
    for a, c in ((p1.k, p2.k), (p1.v, p2.v)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
    with pytest.raises(ValueError, match="pad"):
        A.attn_prep(*args, pad=1)
    big = QWEN38_27B
    qkv, qn, kn, pool, table, positions = _case(rng, big, pages=4, page=64, layers=2)
    lowers_for_cuda(lambda q, a, c, p, t, s: A.attn_prep(
        big, q, a, c, p, t, s, jnp.ones((2, 1), bool), jnp.int32(1), 0, interpret=False,
        pad=16), qkv, qn[0], kn[0], pool, table, positions)
