"""Paged prefill attention kernel (engine/kernels/paged_prefill.py) against the plain-jnp
reference: in the Pallas interpreter on CPU, lowered for CUDA, on the GPU (-m gpu), and in the
model (the pallas plan against the reference plan for a prefill chunk over a paged cache)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels.paged_prefill import paged_prefill_attend, paged_prefill_attend_ref
import engine.model.model as M
from engine.model.config import TEST_SMALL
from engine.model.params import random_flat_params, stack_params
from engine.ops import paged_kv as pk
from engine.plan import PALLAS, REFERENCE
from tests.kernel_checks import assert_close, lowers_for_cuda, on_gpu, random_pool


def _case(rng, kv_dtype, batch, slot_offset, *, t=13, starts=(0, 21), layers=2, pages=24,
          page=16, kvh=2, hd=32, nh=6, mp=6):
    """Rows start at `starts` (row 0 at position 0, row 1 mid-page); pages in scrambled order;
    table entries past a row's last slot are -1. T * (nh / kvh) is not a multiple of the tile."""
    pool = random_pool(rng, kv_dtype, layers, pages, page, kvh, hd)
    table = rng.permutation(pages)[:batch * mp].reshape(batch, mp).astype(np.int32)
    pos = np.asarray(starts[:batch], np.int32)[:, None] + np.arange(t, dtype=np.int32)[None]
    slots = pos + slot_offset
    for b in range(batch):
        table[b, int(slots[b, -1]) // page + 1:] = -1
    qdt = jnp.float32 if kv_dtype == "float32" else jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((batch, t, nh, hd)), qdt)
    return pool, jnp.asarray(table), q, jnp.asarray(slots)


# programs=1: one program per (row, kv head, tile) walks the whole table; programs=24: the
# table (6 pages) is split in 3 x 2 pages per tile, splits past a row's length stay empty.
SPLITS = {"whole": 1, "split": 24}


@pytest.mark.parametrize("kv_dtype,batch,slot_offset,split", [
    ("float32", 1, 0, "whole"), ("float32", 2, 1, "split"), ("bfloat16", 2, 0, "whole"),
    ("bfloat16", 1, 1, "split"), ("int8", 2, 0, "split"), ("int8", 1, 1, "whole")])
def test_paged_prefill_matches_reference(kv_dtype, batch, slot_offset, split):
    rng = np.random.default_rng()
    pool, table, q, slots = _case(rng, kv_dtype, batch, slot_offset)
    layer = jnp.int32(1)
    # block_rows=16: 13 tokens x 3 heads = 39 rows -> 3 tiles, the last one part padding.
    got = paged_prefill_attend(pool, table, layer, q, slots, slot_offset, interpret=True,
                               block_rows=16, programs=SPLITS[split])
    want = paged_prefill_attend_ref(pool, table, layer, q, slots, slot_offset)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_close(got, want, q.dtype)


def test_paged_prefill_default_tile_and_gqa_group_of_one():
    """The default tile (64 rows, more than T * r here: one tile of 32) and r = 1."""
    rng = np.random.default_rng()
    pool, table, q, slots = _case(rng, "float32", 2, 0, t=30, starts=(0, 40), kvh=2, nh=2)
    got = paged_prefill_attend(pool, table, jnp.int32(0), q, slots, interpret=True)
    assert_close(got, paged_prefill_attend_ref(pool, table, jnp.int32(0), q, slots), q.dtype)


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_paged_prefill_invalid_steps_are_finite(split):
    """Padded steps: a slot past the table (sees the whole table, like the reference) and one
    below slot_offset (sees nothing): finite output, and the valid steps still match."""
    rng = np.random.default_rng()
    pool, table, q, slots = _case(rng, "bfloat16", 2, 1)
    slots = slots.at[1, -3:].set(10_000).at[1, -1].set(0)
    got = paged_prefill_attend(pool, table, jnp.int32(0), q, slots, 1, interpret=True,
                               block_rows=16, programs=SPLITS[split])
    assert np.isfinite(np.asarray(got, np.float32)).all()
    want = paged_prefill_attend_ref(pool, table, jnp.int32(0), q, slots, 1)
    assert_close(got[:, :-3], want[:, :-3], q.dtype)


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_paged_prefill_reads_only_visible_pages(split):
    """NaN on every page past a row's last visible page (never read), large finite values on
    slots past a row's last slot in its last page (read, must weigh exactly 0): same output."""
    rng = np.random.default_rng()
    pool, table, q, slots = _case(rng, "float32", 2, 0)
    run = lambda p: paged_prefill_attend(p, table, jnp.int32(0), q, slots,  # noqa: E731
                                         interpret=True, block_rows=16,
                                         programs=SPLITS[split])
    got = run(pool)
    page, tab = pool.page_size, np.asarray(table)
    k, v = np.array(pool.k), np.array(pool.v)
    used = set(int(x) for x in tab.ravel() if x >= 0)
    for pid in range(pool.num_pages):
        if pid not in used:
            k[0, pid], v[0, pid] = np.nan, np.nan
    for b in range(tab.shape[0]):
        last = int(slots[b, -1])
        for s in range(last + 1, tab.shape[1] * page):
            pid = int(tab[b, s // page])
            if pid >= 0:
                bad = np.nan if s // page > last // page else 1e4
                k[0, pid, s % page], v[0, pid, s % page] = bad, bad
    again = run(pool._replace(k=jnp.asarray(k), v=jnp.asarray(v)))
    np.testing.assert_array_equal(got, again)


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_paged_prefill_is_batch_invariant(split):
    """Row 0 alone and row 0 beside another row: bit-identical."""
    rng = np.random.default_rng()
    pool, table, q, slots = _case(rng, "bfloat16", 2, 0)
    kw = dict(interpret=True, block_rows=16, programs=SPLITS[split])
    both = paged_prefill_attend(pool, table, jnp.int32(0), q, slots, **kw)
    alone = paged_prefill_attend(pool, table[:1], jnp.int32(0), q[:1], slots[:1], **kw)
    np.testing.assert_array_equal(np.asarray(alone[0], np.float32),
                                  np.asarray(both[0], np.float32))


def test_paged_prefill_lowers_to_triton():
    """27B heads (hd 256, 24 query / 4 KV heads, 64-token pages), bf16 and int8 pools."""
    rng = np.random.default_rng(0)
    for kv_dtype, programs in (("bfloat16", 512), ("int8", 512), ("bfloat16", 1)):
        pool, table, q, slots = _case(rng, kv_dtype, 2, 0, t=128, starts=(0, 100), layers=1,
                                      pages=8, page=64, kvh=4, hd=256, nh=24, mp=4)
        lowers_for_cuda(lambda p, t, q, s: paged_prefill_attend(
            p, t, jnp.int32(0), q, s, interpret=False, programs=programs),
            pool, table, q, slots)


def test_model_paged_prefill_pallas_equals_xla():
    """A second prefill chunk over a paged cache (row 0 continues mid-page, row 1 is shorter
    and right-padded; scrambled pages): the pallas and reference plans give the same
    logits."""
    cfg, b, page = TEST_SMALL, 2, 16
    params = stack_params(random_flat_params(cfg, seed=3), cfg)
    rng = np.random.default_rng()
    pool = pk.init_kv_pool(cfg, 12, page, jnp.float32)
    table = rng.permutation(12)[:8].reshape(b, 4).astype(np.int32)
    table[1, 3] = -1
    fwd = M.jit_forward()
    first = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 11)), jnp.int32)
    _, _, c0 = fwd(params, cfg, first, M.init_paged_cache(cfg, pool, table))
    chunk = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 20)), jnp.int32)
    lengths = jnp.asarray([20, 13], jnp.int32)
    outs = {}
    for name, plan in (("xla", REFERENCE), ("pallas", PALLAS)):
        lg, _, _ = fwd(params, cfg, chunk, jax.tree.map(jnp.copy, c0), lengths=lengths,
                       plan=plan)
        outs[name] = jnp.concatenate([lg[0], lg[1, :13]], 0)
    assert_close(outs["pallas"], outs["xla"], jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,programs", [("bfloat16", 512), ("int8", 512),
                                               ("bfloat16", 1)])
def test_paged_prefill_gpu_27b_heads(kv_dtype, programs):
    """The compiled kernel at the 27B heads: a 512-token chunk over ~4K context, two rows (one
    starting mid-page), scrambled pages; against the reference, and batch invariant.
    programs=512 splits each tile's live pages in 5; programs=1 walks them whole."""
    assert on_gpu()
    rng = np.random.default_rng()
    pool, table, q, slots = _case(rng, kv_dtype, 2, 0, t=512, starts=(3584, 2500), layers=2,
                                  pages=160, page=64, kvh=4, hd=256, nh=24, mp=72)
    got = paged_prefill_attend(pool, table, jnp.int32(1), q, slots, programs=programs)
    want = paged_prefill_attend_ref(pool, table, jnp.int32(1), q.astype(jnp.float32), slots)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_close(got, want, jnp.bfloat16)
    alone = paged_prefill_attend(pool, table[:1], jnp.int32(1), q[:1], slots[:1],
                                 programs=programs)
    np.testing.assert_array_equal(np.asarray(alone[0], np.float32),
                                  np.asarray(got[0], np.float32))
