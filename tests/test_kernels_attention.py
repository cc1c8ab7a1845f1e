"""Paged attention decode and flash prefill kernels (engine/kernels/) against the plain-jnp
references, in the Pallas interpreter on CPU, lowered for CUDA, and on the GPU (-m gpu)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels.flash_prefill import flash_attend, flash_attend_ref
from engine.kernels.paged_decode import paged_attend, paged_attend_ref
from tests.kernel_checks import assert_close, lowers_for_cuda, on_gpu, random_pool


def _paged_case(rng, kv_dtype, batch, layers=2, pages=24, page=16, kvh=2, hd=32, nh=6, mp=6):
    pool = random_pool(rng, kv_dtype, layers, pages, page, kvh, hd)
    table = jnp.asarray(rng.permutation(pages)[:batch * mp].reshape(batch, mp), jnp.int32)
    qdt = jnp.float32 if kv_dtype == "float32" else jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((batch, 1, nh, hd)), qdt)
    last = jnp.asarray(rng.integers(1, mp * page, batch), jnp.int32)
    return pool, table, q, last


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("slot_offset", [0, 1])
def test_paged_decode_matches_reference(kv_dtype, batch, slot_offset):
    rng = np.random.default_rng()
    pool, table, q, last = _paged_case(rng, kv_dtype, batch)
    layer = jnp.int32(1)
    # programs=8 forces several pages per split and splits that end past a row's length.
    got = paged_attend(pool, table, layer, q, last, slot_offset, interpret=True, programs=8)
    want = paged_attend_ref(pool, table, layer, q, last, slot_offset)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_close(got, want, q.dtype)


def test_paged_decode_launch_settings():
    """The launch settings by page dtype; a non-positive setting is an error; pages a loop
    step (unroll) and warps/stages change nothing of the result."""
    from engine.kernels.paged_decode import LAUNCH_DEFAULTS, launch_default

    assert launch_default("bfloat16") == LAUNCH_DEFAULTS["bfloat16"] == (512, 8, 2, 1)
    assert launch_default("int8") == (512, 4, 2, 1)
    assert launch_default("float32") == launch_default("float16") == (512, 4, 2, 1)
    rng = np.random.default_rng(13)
    pool, table, q, last = _paged_case(rng, "bfloat16", 1)
    with pytest.raises(ValueError, match="positive"):
        paged_attend(pool, table, jnp.int32(0), q, last, interpret=True, unroll=0)
    for kv_dtype in ("bfloat16", "int8"):
        pool, table, q, last = _paged_case(rng, kv_dtype, 2, mp=7)
        base = paged_attend(pool, table, jnp.int32(1), q, last, interpret=True, programs=4)
        for unroll in (2, 3):
            again = paged_attend(pool, table, jnp.int32(1), q, last, interpret=True,
                                 programs=4, unroll=unroll)
            np.testing.assert_array_equal(np.asarray(base, np.float32),
                                          np.asarray(again, np.float32))


def test_paged_decode_int8_codes_are_exact_in_bf16():
    """Every int8 code converted to bf16 (how the kernel's dots take INT8 pages) comes out as
    itself."""
    codes = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    np.testing.assert_array_equal(np.asarray(codes.astype(jnp.bfloat16), np.float32),
                                  np.arange(-128, 128, dtype=np.float32))


def test_paged_decode_reads_only_visible_slots():
    """Poison every slot past a row's position (NaN on pages past its last one, which must not
    be read at all; large finite values in its last page, which must weigh exactly 0): the
    output must not change."""
    rng = np.random.default_rng()
    pool, table, q, last = _paged_case(rng, "float32", 2)
    got = paged_attend(pool, table, jnp.int32(0), q, last, interpret=True, programs=8)
    page = pool.page_size
    slot = np.arange(table.shape[1] * page)
    k, v = np.array(pool.k), np.array(pool.v)
    for b in range(2):
        for s in slot[slot > int(last[b])]:
            pid = int(table[b, s // page])
            bad = np.nan if s // page > int(last[b]) // page else 1e4
            k[0, pid, s % page] = bad
            v[0, pid, s % page] = bad
    poisoned = pool._replace(k=jnp.asarray(k), v=jnp.asarray(v))
    again = paged_attend(poisoned, table, jnp.int32(0), q, last, interpret=True, programs=8)
    np.testing.assert_array_equal(got, again)


@pytest.mark.parametrize("merge", ["reduce", "chain"])
def test_paged_decode_is_batch_invariant(merge):
    """Row 0 alone and row 0 beside another row: bit-identical (the split does not depend on
    the batch size)."""
    rng = np.random.default_rng()
    pool, table, q, last = _paged_case(rng, "bfloat16", 2)
    both = paged_attend(pool, table, jnp.int32(0), q, last, interpret=True, programs=8,
                        merge=merge)
    alone = paged_attend(pool, table[:1], jnp.int32(0), q[:1], last[:1], interpret=True,
                         programs=8, merge=merge)
    np.testing.assert_array_equal(np.asarray(alone[0], np.float32),
                                  np.asarray(both[0], np.float32))


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_paged_decode_chained_merge_matches(kv_dtype):
    """merge="chain" (a plan's paged_merge): the reference's result, within the reduction's
    rounding of the merged sums; short rows in a wide table (empty splits weigh nothing); an
    unknown merge is an error."""
    rng = np.random.default_rng()
    pool, table, q, last = _paged_case(rng, kv_dtype, 2)
    last = last.at[1].set(3)  # row 1: one page of a wide table
    got = paged_attend(pool, table, jnp.int32(1), q, last, interpret=True, programs=8,
                       merge="chain")
    bound = q.dtype  # the output's: fp32 queries with fp32 pages, else bf16
    assert_close(got, paged_attend_ref(pool, table, jnp.int32(1), q, last), bound)
    red = paged_attend(pool, table, jnp.int32(1), q, last, interpret=True, programs=8,
                       merge="reduce")
    assert_close(got, red, bound)
    with pytest.raises(ValueError, match="merge must be one of"):
        paged_attend(pool, table, jnp.int32(1), q, last, interpret=True, merge="tree")


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_paged_decode_short_rows_in_a_wide_table(kv_dtype):
    """Rows of 1-3 pages in a table of 24 (an engine's pool sized for its longest context):
    each row splits its own pages, so it matches the reference, and its result is the same bits
    in a table of 6 pages as in one of 24 (the splits depend on the row's length alone)."""
    rng = np.random.default_rng(3)
    pool = random_pool(rng, kv_dtype, 1, 48, 16, 2, 32)
    narrow = rng.permutation(48)[:12].reshape(2, 6)
    wide = np.full((2, 24), 47, np.int32)  # columns past the row: another row's page
    wide[:, :6] = narrow
    q = jnp.asarray(rng.standard_normal((2, 1, 6, 32)), jnp.bfloat16)
    last = jnp.asarray([5, 40], jnp.int32)  # 1 and 3 pages
    got = {}
    for name, table in (("narrow", narrow), ("wide", wide)):
        table = jnp.asarray(table, jnp.int32)
        got[name] = paged_attend(pool, table, jnp.int32(0), q, last, interpret=True,
                                 programs=16)
        assert_close(got[name], paged_attend_ref(pool, table, jnp.int32(0), q, last), q.dtype)
    np.testing.assert_array_equal(np.asarray(got["narrow"], np.float32),
                                  np.asarray(got["wide"], np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("start", [0, 37])
@pytest.mark.parametrize("split", [True, False])
def test_flash_prefill_matches_reference(dtype, start, split):
    """With start 37 the second query tile sees its first key tile whole: with `split` it runs
    in the unmasked loop, the diagonal tiles in the masked one."""
    rng = np.random.default_rng()
    L, B, S, kvh, hd, nh, T = 2, 2, 128, 2, 32, 6, 32
    kc = jnp.asarray(rng.standard_normal((L, B, S, kvh, hd)), dtype)
    vc = jnp.asarray(rng.standard_normal((L, B, S, kvh, hd)), dtype)
    q = jnp.asarray(rng.standard_normal((B, T, nh, hd)), dtype)
    pos = jnp.asarray([[start], [start + 50]], jnp.int32) + jnp.arange(T)[None]
    got = flash_attend(kc, vc, jnp.int32(1), q, pos, interpret=True, bq=16, bk=32, split=split)
    assert_close(got, flash_attend_ref(kc, vc, jnp.int32(1), q, pos), dtype)


def test_flash_prefill_query_tile():
    """The query tile is the largest power of two up to 128 dividing T (down to 16): T = 48 or
    96 still runs the kernel; T = 40 takes the reference."""
    from engine.kernels.flash_prefill import _query_tile, supported

    assert [_query_tile(t, 128) for t in (16, 48, 96, 128, 192, 8192, 8256)] == \
        [16, 16, 32, 128, 64, 128, 64]
    kc = jnp.zeros((1, 1, 256, 2, 32), jnp.float32)
    assert [supported(kc, jnp.zeros((1, t, 4, 32))) for t in (8, 40, 48, 96, 256)] == \
        [False, False, True, True, True]


def test_attention_kernels_lower_to_triton():
    rng = np.random.default_rng(0)
    for kv_dtype in ("bfloat16", "int8"):
        pool, table, q, last = _paged_case(rng, kv_dtype, 2, pages=8, page=64, kvh=4, hd=256,
                                           nh=24, mp=4)
        lowers_for_cuda(lambda p, t, q, s: paged_attend(p, t, jnp.int32(0), q, s,
                                                        interpret=False),
                        pool, table, q, last)
    kc = jnp.zeros((1, 1, 256, 4, 256), jnp.bfloat16)
    q = jnp.zeros((1, 128, 24, 256), jnp.bfloat16)
    pos = jnp.arange(128, dtype=jnp.int32)[None]
    lowers_for_cuda(lambda k, v, q, p: flash_attend(k, v, jnp.int32(0), q, p, interpret=False),
                    kc, kc, q, pos)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("merge", ["reduce", "chain"])
def test_paged_decode_gpu_27b_heads(kv_dtype, batch, merge):
    """At the 27B's heads against the reference; with two rows, row 0's bits do not depend on
    row 1 (what greedy C1 == C2 in an engine of fixed width needs: its C1 steps run the same
    two-row program with the other row idle). "chain" also promises row 0 alone (a program of
    one row) gives the same bits; "reduce" does not (XLA may tile a reduction over the splits
    differently for B = 1 and B = 2: v28 saw 1 of 6,144 values differ by one ulp)."""
    assert on_gpu()
    rng = np.random.default_rng()
    pool, table, q, last = _paged_case(rng, kv_dtype, batch, layers=2, pages=batch * 40,
                                       page=64, kvh=4, hd=256, nh=24, mp=40)
    got = paged_attend(pool, table, jnp.int32(1), q, last, merge=merge)
    assert_close(got, paged_attend_ref(pool, table, jnp.int32(1), q.astype(jnp.float32), last),
                 jnp.bfloat16)
    if batch == 2:
        # row 1 idle (length 0, as the engine leaves a free row) and then another query
        for q1, last1 in ((q[1:], 0), (-q[1:], int(last[1]) // 2 + 1)):
            other = paged_attend(pool, table, jnp.int32(1), q.at[1:].set(q1),
                                 last.at[1].set(last1), merge=merge)
            np.testing.assert_array_equal(np.asarray(other[0], np.float32),
                                          np.asarray(got[0], np.float32))
        if merge == "chain":
            alone = paged_attend(pool, table[:1], jnp.int32(1), q[:1], last[:1],
                                 merge=merge)
            np.testing.assert_array_equal(np.asarray(alone[0], np.float32),
                                          np.asarray(got[0], np.float32))


@pytest.mark.gpu
def test_flash_prefill_gpu_27b_heads():
    """The flash kernel at the 27B's heads (head dim 256, 24 query heads on 4 KV heads) after
    a 512-token prefix and from slot 0."""
    assert on_gpu()
    rng = np.random.default_rng()
    L, B, S, T = 1, 1, 2048, 1024
    kc = jnp.asarray(rng.standard_normal((L, B, S, 4, 256)), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal((L, B, S, 4, 256)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((B, T, 24, 256)), jnp.bfloat16)
    for start in (512, 0):
        pos = jnp.arange(T, dtype=jnp.int32)[None] + start
        got = flash_attend(kc, vc, jnp.int32(0), q, pos)
        assert_close(got, flash_attend_ref(kc, vc, jnp.int32(0), q.astype(jnp.float32), pos),
                     jnp.bfloat16)
