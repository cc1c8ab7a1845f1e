"""The paged KV pool: paged forward == contiguous forward (fp32, shuffled and shared pages, MTP
included), INT8 KV against BF16 KV on the acceptance bound, the int8 row codec, page copies."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import QWEN38_27B, TEST_SMALL, ConfigError
from engine.model import (init_cache, init_paged_cache, jit_forward, jit_mtp_forward,
                          stack_params)
from engine.paged_kv import (PAGE_SIZE, PagedKV, copy_pages, dequantize_kv, init_kv_pool,
                             kv_bytes_per_token, kv_pages_needed, paged_write_attend,
                             quantize_kv)
from engine.params import random_flat_params

CFG = dataclasses.replace(TEST_SMALL, name="test-small-mtp", mtp_layers=1)
P = 16           # page size of the exactness tests: several pages per row at these lengths
MAX_PAGES = 8    # 8 x 16 = 128 slots = MAX_LEN, so both paths attend over the same slot count
MAX_LEN = MAX_PAGES * P
NUM_PAGES = 24
TOL = 1e-6
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
    ref, _, ref_cache = fwd(params, seqs[:, :40], init_cache(CFG, 2, MAX_LEN), [40, 40])
    ref = [np.asarray(ref)[:, P:]]
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
    assert rel_err(shared_out, ref) <= TOL
    np.testing.assert_array_equal(np.asarray(shared_cache.pool.k[:, shared]), page_before[0])
    np.testing.assert_array_equal(np.asarray(shared_cache.pool.v[:, shared]), page_before[1])
