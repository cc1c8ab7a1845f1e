"""The paged KV pool: paged forward == contiguous forward (fp32, shuffled and shared pages, MTP
included), INT8 KV against BF16 KV on the acceptance bound, the int8 row codec, page copies."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.model.config import QWEN38_27B, TEST_SMALL, ConfigError
from engine.model.model import (init_cache, init_paged_cache, jit_forward, jit_mtp_forward,
                                stack_params)
from engine.model.paged_kv import paged_write_attend
from engine.model.params import random_flat_params
from engine.ops.paged_kv import (PAGE_SIZE, PagedKV, copy_pages, dequantize_kv, init_kv_pool,
                                 kv_bytes_per_token, kv_pages_needed, quantize_kv)
from engine.plan import PALLAS

CFG = dataclasses.replace(TEST_SMALL, name="test-small-mtp", mtp_layers=1)
P = 16           # page size of the exactness tests: several pages per row at these lengths
MAX_PAGES = 8    # 8 x 16 = 128 slots = MAX_LEN, so both paths attend over the same slot count
MAX_LEN = MAX_PAGES * P
NUM_PAGES = 24
TOL = 4e-6  # fp32: the paged path sums its softmax blockwise (online), the contiguous one at once
FWD, MTP = jit_forward(), jit_mtp_forward()


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def params():
    return stack_params(random_flat_params(CFG, seed=0), CFG)


def shuffled_tables(rng, rows_pages: list[int]) -> np.ndarray:
    """[B, MAX_PAGES] tables of distinct, shuffled page ids; entries past a row's need are -1."""
    ids = rng.permutation(NUM_PAGES)
    table, k = np.full((len(rows_pages), MAX_PAGES), -1, np.int32), 0
    for b, n in enumerate(rows_pages):
        table[b, :n], k = ids[k:k + n], k + n
    return table


def fwd(params, tokens, cache, lengths):
    """FWD on tokens right-padded to T=40 or T=1 (two compiled shapes per cache kind: compiles
    dominate this file's run time). tokens: [B, <= T] int32; lengths: [B]."""
    tokens = np.asarray(tokens, np.int32)
    t = 1 if tokens.shape[1] == 1 else 40
    tokens = np.pad(tokens, ((0, 0), (0, t - tokens.shape[1])), constant_values=7)
    return FWD(params, CFG, jnp.asarray(tokens), cache, lengths=jnp.asarray(lengths, jnp.int32))


def step_both(params, caches, tokens, lengths):
    """One forward on the contiguous and the paged cache; returns (logits pair, hiddens, caches)."""
    outs = [fwd(params, tokens, c, lengths) for c in caches]
    return [np.asarray(o[0]) for o in outs], [np.asarray(o[1]) for o in outs], [o[2] for o in outs]


def assert_rows_equal(pair, lengths):
    for b, n in enumerate(lengths):  # padded steps compute garbage from stale slots: skip them
        assert rel_err(pair[1][b, :n], pair[0][b, :n]) <= TOL


def test_paged_forward_and_mtp_match_contiguous(params):
    """Ragged prefill in pieces, decode, MTP pieces, more decode: rows at different positions,
    shuffled non-contiguous pages, -1 past each row's pages."""
    rng = np.random.default_rng(1)
    lens = np.array([[40, 25], [24, 30], [1, 1], [1, 1], [1, 1]])  # per step, per row
    table = shuffled_tables(rng, [kv_pages_needed(n, P) for n in lens.sum(0) + 3])
    caches = [init_cache(CFG, 2, MAX_LEN),
              init_paged_cache(CFG, init_kv_pool(CFG, NUM_PAGES, P, jnp.float32, mtp=True),
                               table)]
    seqs = rng.integers(0, CFG.vocab_size, (2, 100)).astype(np.int32)
    hidden = [[], []]  # per row: valid hidden states in order
    for ls in lens:
        pos = np.asarray(caches[0].pos)
        toks = np.stack([np.resize(seqs[b, pos[b]:pos[b] + ls[b]], ls.max()) for b in range(2)])
        logits, hs, caches = step_both(params, caches, toks, ls)
        assert_rows_equal(logits, ls)
        assert_rows_equal(hs, ls)
        for b in range(2):
            hidden[b].append(hs[0][b, :ls[b]])
    hidden = [np.concatenate(h) for h in hidden]
    # MTP: entry j pairs h_j with x_{j+1}; pieces of [32, 20] entries, then 3 single steps.
    for ls in ([32, 20], [1, 1], [1, 1], [1, 1]):
        mpos, t = np.asarray(caches[0].mtp_pos), max(ls)
        h = np.stack([np.resize(hidden[b][mpos[b]:mpos[b] + ls[b]], (t, CFG.hidden_size))
                      for b in range(2)])
        x = np.stack([np.resize(seqs[b, mpos[b] + 1:mpos[b] + 1 + ls[b]], t) for b in range(2)])
        outs = [MTP(params, CFG, jnp.asarray(h), jnp.asarray(x), c,
                    lengths=jnp.asarray(ls, jnp.int32)) for c in caches]
        assert_rows_equal([np.asarray(o[0]) for o in outs], ls)
        caches = [o[2] for o in outs]
    assert np.asarray(caches[1].mtp_pos).tolist() == [35, 23]
    # The MTP writes went to their own layer: the main model still agrees afterwards.
    for _ in range(3):
        pos = np.asarray(caches[0].pos)
        logits, _, caches = step_both(params, caches, seqs[[0, 1], pos][:, None], [1, 1])
        assert_rows_equal(logits, [1, 1])
    assert np.asarray(caches[1].pos).tolist() == np.asarray(caches[0].pos).tolist() == [70, 61]


def test_shared_prefix_page_equals_private_copies(params):
    """Two rows whose block tables share the page holding a 16-token prefix give the same logits
    as when each row has its own copy (made by copy_pages, as copy-on-write would), match the
    contiguous forward, and leave the shared page untouched."""
    rng = np.random.default_rng(2)
    seqs = rng.integers(0, CFG.vocab_size, (2, 44)).astype(np.int32)
    seqs[1, :P] = seqs[0, :P]
    # The contiguous reference is fed in the same pieces (prefix, then 24, then 1 at a time).
    _, _, ref_cache = fwd(params, seqs[:, :P], init_cache(CFG, 2, MAX_LEN), [P, P])
    ref, _, ref_cache = fwd(params, seqs[:, P:40], ref_cache, [40 - P, 40 - P])
    ref = [np.asarray(ref)[:, :40 - P]]
    for t in range(40, 44):
        lg, _, ref_cache = fwd(params, seqs[:, t:t + 1], ref_cache, [1, 1])
        ref.append(np.asarray(lg))
    ref = np.concatenate(ref, 1)

    table = shuffled_tables(rng, [4, 4])
    shared, private = int(table[0, 0]), int(table[1, 0])
    table[1, 0] = shared
    pool = init_kv_pool(CFG, NUM_PAGES, P, jnp.float32, mtp=True)  # same shapes: no recompile
    cache = init_paged_cache(CFG, pool, table)
    # The prefix is prefilled once, on row 0; row 1 takes row 0's GDN states and position.
    _, _, cache = fwd(params, seqs[:, :P], cache, [P, 0])
    cache = cache._replace(conv=cache.conv.at[:, :, 1].set(cache.conv[:, :, 0]),
                           rec=cache.rec.at[:, :, 1].set(cache.rec[:, :, 0]),
                           pos=jnp.asarray([P, P], jnp.int32))
    page_before = np.asarray(cache.pool.k[:, shared]), np.asarray(cache.pool.v[:, shared])

    def continue_rows(cache):
        lg, _, cache = fwd(params, seqs[:, P:40], cache, [40 - P, 40 - P])
        out = [np.asarray(lg)[:, :40 - P]]
        for t in range(40, 44):
            lg, _, cache = fwd(params, seqs[:, t:t + 1], cache, [1, 1])
            out.append(np.asarray(lg))
        return np.concatenate(out, 1), cache

    state = jax.tree.map(np.asarray, cache)  # a host copy: every forward donates its cache
    shared_out, shared_cache = continue_rows(jax.tree.map(jnp.asarray, state))
    own = jax.tree.map(jnp.asarray, state)
    own = own._replace(pool=copy_pages(own.pool, jnp.asarray([shared]), jnp.asarray([private])),
                       block_table=own.block_table.at[1, 0].set(private))
    own_out, _ = continue_rows(own)
    np.testing.assert_array_equal(shared_out, own_out)
    assert rel_err(shared_out, ref) <= TOL, rel_err(shared_out, ref)
    np.testing.assert_array_equal(np.asarray(shared_cache.pool.k[:, shared]), page_before[0])
    np.testing.assert_array_equal(np.asarray(shared_cache.pool.v[:, shared]), page_before[1])


# ---- INT8 KV against BF16 KV (acceptance) ----------------------------------------------------
# "INT8 KV: normwise logit error <= 2e-2 of BF16 and greedy agreement >= 95% of tokens over a
# fixed set of 20 prompts x 64 tokens." fp32 weights and compute; only the pool dtype differs.
# Greedy agreement is teacher-forced: the BF16 pool decodes greedily; the INT8 pool is fed the
# same prompt + BF16 tokens (one prefill) and its argmax is compared at each of the 64 steps.
ROWS, PROMPT, GEN = 20, 32, 64
INT8_CFG = TEST_SMALL
WEIGHT_SCALE = 2.0  # peaked, varied continuations (asserted below) rather than near-ties


def test_int8_kv_matches_bf16_kv_on_acceptance_bound():
    flat = random_flat_params(INT8_CFG, seed=3)
    flat = {n: w * WEIGHT_SCALE if w.ndim == 2 and n != "embed_tokens"
            and not n.endswith("conv1d") else w for n, w in flat.items()}
    params = stack_params(flat, INT8_CFG)
    rng = np.random.default_rng(4)
    prompts = rng.integers(0, INT8_CFG.vocab_size, (ROWS, PROMPT)).astype(np.int32)
    pages = kv_pages_needed(PROMPT + GEN, PAGE_SIZE)
    table = rng.permutation(ROWS * pages).reshape(ROWS, pages).astype(np.int32)

    def cache(dtype):
        return init_paged_cache(INT8_CFG, init_kv_pool(INT8_CFG, ROWS * pages, PAGE_SIZE, dtype),
                                table)

    logits, _, c = FWD(params, INT8_CFG, jnp.asarray(prompts), cache(jnp.bfloat16))
    last, toks, ref = logits[:, -1], [], []
    for step in range(GEN):
        ref.append(np.asarray(last))
        toks.append(np.asarray(jnp.argmax(last, axis=-1), np.int32))
        if step < GEN - 1:
            logits, _, c = FWD(params, INT8_CFG, jnp.asarray(toks[-1])[:, None], c)
            last = logits[:, 0]
    toks, ref = np.stack(toks, 1), np.stack(ref, 1)  # [ROWS, GEN], [ROWS, GEN, V]
    assert min(len(set(r)) for r in toks.tolist()) >= 16, "degenerate continuations"

    forced = np.concatenate([prompts, toks[:, :-1]], axis=1)
    logits, _, _ = FWD(params, INT8_CFG, jnp.asarray(forced), cache(jnp.int8))
    q = np.asarray(logits)[:, PROMPT - 1:]
    err = np.linalg.norm(q - ref) / np.linalg.norm(ref)
    agree = float((q.argmax(-1) == toks).mean())
    print(f"int8 vs bf16 KV: normwise logit error {err:.3e}, greedy agreement {agree:.4f}")
    assert err <= 2e-2 and agree >= 0.95


# ---- the int8 row codec, bytes, pages ----------------------------------------------------------
def test_int8_kv_round_trip_bounds():
    rng = np.random.default_rng(5)
    x = rng.normal(0.0, 1.0, (4, 64, 2, 256)).astype(np.float32) * rng.uniform(
        1e-3, 1e3, (4, 64, 2, 1)).astype(np.float32)
    x[0, 0, 0] = 0.0  # an all-zero row
    codes, scale = quantize_kv(jnp.asarray(x))
    assert codes.dtype == jnp.int8 and codes.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    codes, scale, back = np.asarray(codes), np.asarray(scale), np.asarray(dequantize_kv(codes,
                                                                                      scale))
    amax = np.abs(x).max(-1)
    # Within an ulp: XLA may turn the division by 127 into a multiply by its reciprocal.
    np.testing.assert_allclose(scale[amax > 0], (amax / 127.0)[amax > 0], rtol=3e-7)
    assert scale[0, 0, 0] == 1.0 and not back[0, 0, 0].any()
    assert np.abs(codes).max() == 127 and codes.min() >= -127
    # Each element within half a step; rows normwise within the uniform-noise bound.
    assert (np.abs(back - x) <= 0.5 * scale[..., None] * (1 + 1e-6)).all()
    rows = np.linalg.norm(back - x, axis=-1) / np.maximum(np.linalg.norm(x, axis=-1), 1e-30)
    assert rows.max() <= 1.5e-2 and np.median(rows) <= 8e-3
    # Round half to even: amax 127 gives scale 1, so the codes are the rounded values.
    half = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.49], np.float32)
    np.testing.assert_array_equal(np.asarray(quantize_kv(jnp.asarray(half))[0]),
                                  [127, 0, 2, 2, 0, -2, 3])


def test_kv_bytes_per_token_and_pages():
    assert kv_bytes_per_token(QWEN38_27B, jnp.bfloat16) == 65_536
    assert kv_bytes_per_token(QWEN38_27B, "int8") == 32_768 + 512
    assert kv_bytes_per_token(QWEN38_27B, jnp.float32) == 131_072
    assert kv_bytes_per_token(QWEN38_27B, jnp.bfloat16, mtp=True) == 65_536 * 17 // 16
    pool = init_kv_pool(TEST_SMALL, 3, 8, "int8")
    nbytes = sum(a.nbytes for a in jax.tree.leaves(pool))
    assert nbytes == 3 * 8 * kv_bytes_per_token(TEST_SMALL, "int8")
    assert pool.k_scale.shape == (TEST_SMALL.num_blocks, 3, 8, TEST_SMALL.num_kv_heads)
    assert init_kv_pool(TEST_SMALL, 3, 8).k_scale is None
    assert [kv_pages_needed(n) for n in (0, 1, 64, 65, 128)] == [0, 1, 1, 2, 2]
    assert kv_pages_needed(17, 16) == 2
    with pytest.raises(ValueError, match="KV dtype"):
        init_kv_pool(TEST_SMALL, 3, 8, jnp.float16)
    with pytest.raises(ValueError, match="page_size"):
        init_kv_pool(TEST_SMALL, 3, 0)


def test_paged_mtp_needs_the_mtp_layer_in_the_pool(params):
    cache = init_paged_cache(CFG, init_kv_pool(CFG, 4, P, jnp.float32), np.zeros((1, 2), np.int32))
    with pytest.raises(ConfigError, match="no MTP layer"):
        jax.eval_shape(lambda c: MTP(params, CFG, jnp.zeros((1, 1, CFG.hidden_size)),
                                     jnp.zeros((1, 1), jnp.int32), c), cache)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_copy_pages_copies_every_layer_and_skips_padding(dtype):
    pool = init_kv_pool(CFG, 6, 4, dtype, mtp=True)
    rng = np.random.default_rng(6)
    pool = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 50).astype(a.dtype),
                        pool)
    before = jax.tree.map(np.asarray, pool)
    after = copy_pages(pool, jnp.asarray([1, 4, 0]), jnp.asarray([3, 5, -1]))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        b = np.asarray(b)
        np.testing.assert_array_equal(b[:, [3, 5]], a[:, [1, 4]])
        np.testing.assert_array_equal(b[:, [0, 1, 2, 4]], a[:, [0, 1, 2, 4]])


def test_paged_write_skips_invalid_steps_and_unowned_slots():
    """Invalid steps, slots past the table and -1 page ids write nothing; valid ones land at
    table[pos // P], pos % P, quantized (int8) to what dequantize_kv gives back."""
    cfg, p = TEST_SMALL, 4
    pool = init_kv_pool(cfg, 5, p, "int8")
    table = jnp.asarray([[3, -1], [0, 2]], jnp.int32)
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.normal(size=(2, 3, cfg.num_heads, cfg.head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 3, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
            for _ in range(2))
    positions = jnp.asarray([[2, 3, 4], [5, 6, 7]], jnp.int32)
    valid = jnp.asarray([[True, True, True], [True, False, True]])
    out, kv = jax.jit(paged_write_attend)(PagedKV(pool, table), 1, q, k, v, positions, valid)
    assert out.shape == q.shape and bool(jnp.isfinite(out[:, :2]).all())
    new = jax.tree.map(np.asarray, kv.pool)
    # (page, offset) -> (row, step), in layer 1
    written = {(3, 2): (0, 0), (3, 3): (0, 1), (2, 1): (1, 0), (2, 3): (1, 2)}
    codes, scale = (np.asarray(a) for a in jax.jit(quantize_kv)(k))
    mask = np.zeros(new.k.shape[:3], bool)
    for (page, off), (b, t) in written.items():
        mask[1, page, off] = True
        np.testing.assert_array_equal(new.k[1, page, off], codes[b, t])
        np.testing.assert_array_equal(new.k_scale[1, page, off], scale[b, t])
    # Row 0 step 2 (pos 4 -> table entry -1) and row 1 step 1 (invalid) wrote nothing.
    assert not new.k[~mask].any() and (new.k_scale[~mask] == 1.0).all()


def test_an_idle_row_of_a_decode_step_reads_its_first_slot_only():
    """The pallas plan, T = 1: a row without a token this step (valid False: idle in a wider
    engine) attends over its first visible slot alone instead of its whole stored context; the
    live row's output is what it is with the idle row reading everything."""
    from engine.kernels.paged_decode import paged_attend, paged_attend_ref

    cfg, p, layer = TEST_SMALL, 8, 1
    rng = np.random.default_rng()
    shape = init_kv_pool(cfg, 12, p, "float32").k.shape
    pool = init_kv_pool(cfg, 12, p, "float32")._replace(
        k=jnp.asarray(rng.normal(size=shape), jnp.float32),
        v=jnp.asarray(rng.normal(size=shape), jnp.float32))
    table = jnp.asarray([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 1, cfg.num_heads, cfg.head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 1, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
            for _ in range(2))
    positions = jnp.asarray([[20], [44]], jnp.int32)  # row 1 holds 44 tokens (six pages)
    valid = jnp.asarray([[True], [False]])
    out, kv = paged_write_attend(PagedKV(pool, table), jnp.int32(layer), q, k, v, positions,
                                 valid, plan=PALLAS)
    # the live row: as when every row reads up to its position
    full = paged_attend(kv.pool, table, jnp.int32(layer), q, positions[:, 0])
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(full[0]))
    ref = paged_attend_ref(kv.pool, table, jnp.int32(layer), q, positions[:, 0])
    assert rel_err(out[0], ref[0]) < 1e-5
    # the idle row: one key, so each head's output is that slot's value (page 6, offset 0)
    r = cfg.num_heads // cfg.num_kv_heads
    want = np.repeat(np.asarray(kv.pool.v[layer, 6, 0]), r, axis=0)       # [heads, hd]
    np.testing.assert_allclose(np.asarray(out[1, 0]), want, rtol=1e-6, atol=1e-6)
    assert rel_err(full[1], out[1]) > 1e-2  # reading its context would have given another


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_attend_blocks_matches_one_softmax_and_ignores_other_rows(kv_dtype):
    """The blocked online softmax against one softmax over the gathered slots (`attend`), with
    rows of very different lengths, slot_offset > 0 and a step that sees nothing; a row's result
    is bitwise the same beside a short or a long neighbour."""
    from engine.model.attention import attend
    from engine.ops.paged_kv import BLOCK_PAGES, _load, attend_blocks
    from tests.kernel_checks import random_pool

    rng = np.random.default_rng(5)
    p, mp, kvh, hd, nh = 16, 3 * BLOCK_PAGES + 5, 2, 32, 4
    pool = random_pool(rng, kv_dtype, 2, 2 * mp, p, kvh, hd)
    table = jnp.asarray(rng.permutation(2 * mp).reshape(2, mp).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((2, 3, nh, hd)), jnp.float32)

    def run(slots, valid, off):
        slots, valid = jnp.asarray(slots, jnp.int32), jnp.asarray(valid)
        got = attend_blocks(pool, table, 1, q, slots, valid, off)
        keys, vals = (_load(a, s, 1, table) for a, s in ((pool.k, pool.k_scale),
                                                         (pool.v, pool.v_scale)))
        s = jnp.arange(mp * p)[None, None, :]
        want = attend(q, keys, vals, (s >= off) & (s <= slots[:, :, None]))
        return np.asarray(got), np.asarray(want)

    long_row, short_row = [mp * p - 3, mp * p - 2, mp * p - 1], [40, 41, 42]
    for off in (0, 5):
        got, want = run([long_row, short_row], [[True] * 3] * 2, off)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        beside_short, _ = run([short_row, short_row], [[True] * 3] * 2, off)
        np.testing.assert_array_equal(got[1], beside_short[1])  # same row, other neighbour
    # a step below slot_offset sees nothing: finite garbage, not NaN; its row's others agree
    got, want = run([[2, 41, 42], short_row], [[True] * 3] * 2, 5)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[:, 1:], want[:, 1:], rtol=2e-5, atol=2e-5)
