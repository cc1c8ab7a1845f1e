"""Paged attention decode (one query token per row) over the KV pool of engine/paged_kv.py.

Flash-decoding: the grid is (row, kv head, split); each program walks its share of the row's
pages through the block table, one page (64 tokens x head_dim, contiguous per token) per loop
step, with an online softmax, for all query heads of its KV head at once (GQA: the group's
heads are the rows of one [16, hd] tile, zero-padded, so both products are tensor-core dots).
Programs stop at the row's last visible page, so a short row costs only its own pages. XLA then
merges the splits' (max, sum, acc) partials. INT8 pages enter the dots as they are (int8 codes
are exact in bf16); their per-token scales multiply the page's 64 scores (K) and the 64
softmax weights (V) instead of every element: per element only a conversion is left.

`paged_attend` takes what `paged_write_attend` gives `attention.attend` (after the write) and
returns the same [B, 1, heads, head_dim]; `paged_attend_ref` is that reference path.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from engine.attention import attend
from engine.kernels import resolve_interpret, triton_params
from engine.paged_kv import KVPool, _load

_ROWS = 16  # minimum M of a Triton dot: the query-head group is padded to it


def paged_attend_ref(pool: KVPool, table, layer, q, last_slot, slot_offset: int = 0, **_):
    """Reference. pool: KVPool; table [B, max_pages] int32; layer: int32 scalar; q [B, 1, nh, hd];
    last_slot [B] int32 (the newest slot each row sees, inclusive); slots below slot_offset are
    not visible. Returns [B, 1, nh, hd] in q.dtype."""
    n, p, mp = pool.num_pages, pool.page_size, table.shape[1]
    pages = jnp.clip(table, 0, n - 1)
    keys = _load(pool.k, pool.k_scale, layer, pages)
    vals = _load(pool.v, pool.v_scale, layer, pages)
    s = jnp.arange(mp * p)[None, None, :]
    visible = (s >= slot_offset) & (s <= last_slot[:, None, None])
    return attend(q, keys, vals, visible)


def _kernel(layer_ref, table_ref, last_ref, q_ref, k_ref, v_ref, *rest, pps, page, hd,
            max_pages, num_pages, slot_offset, quant, scale, fold):
    if quant:
        ks_ref, vs_ref, o_ref, m_ref, l_ref = rest
    else:
        o_ref, m_ref, l_ref = rest
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    last = last_ref[b]
    q = q_ref[b, h]                                                    # [16, hd]
    first = s * pps
    n = jnp.clip(jnp.minimum(last // page + 1, max_pages) - first, 0, pps)
    tok = lax.broadcasted_iota(jnp.int32, (_ROWS, page), 1)

    def body(j, carry):
        m_i, l_i, acc = carry
        pj = first + j
        pid = jnp.clip(table_ref[b, pj], 0, num_pages - 1)
        k = k_ref[layer, pid, :, h, :]                                # [page, hd]
        v = v_ref[layer, pid, :, h, :]
        k_scale, v_scale = scale, None
        if quant and fold:  # per-token scales on the scores and on the softmax weights
            k_scale = ks_ref[layer, pid, :, h][None, :] * scale           # [1, page]
            v_scale = vs_ref[layer, pid, :, h][None, :]
        elif quant:  # dequantized element by element (the A/B baseline, fold=False)
            k = k.astype(jnp.float32) * ks_ref[layer, pid, :, h][:, None]
            v = v.astype(jnp.float32) * vs_ref[layer, pid, :, h][:, None]
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) * k_scale  # [16, page]
        slot = pj * page + tok
        sc = jnp.where((slot >= slot_offset) & (slot <= last), sc, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(sc, axis=1))
        pr = jnp.exp(sc - m_new[:, None])
        alpha = jnp.exp(m_i - m_new)
        pv = pr if v_scale is None else pr * v_scale
        acc = acc * alpha[:, None] + lax.dot_general(
            pv.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return m_new, l_i * alpha + jnp.sum(pr, axis=1), acc

    init = (jnp.full((_ROWS,), -jnp.inf, jnp.float32), jnp.zeros((_ROWS,), jnp.float32),
            jnp.zeros((_ROWS, hd), jnp.float32))
    m_i, l_i, acc = lax.fori_loop(0, n, body, init)
    o_ref[b, s, h] = acc
    m_ref[b, s, h] = m_i
    l_ref[b, s, h] = l_i


def _pages_per_split(kvh: int, max_pages: int, programs: int) -> int:
    """Pages per program. It must not depend on the batch size: the split decides the order of
    the softmax merge, and a row's result must not change with the rows beside it (batch
    invariance: the same greedy tokens at C1 and C2)."""
    return max(1, -(-max_pages * kvh // programs))


def fold_default() -> bool:
    """Whether INT8 pages take their scales on the scores and softmax weights (default) or
    element by element (NINFER_PAGED_INT8=dequant: the benchmark's A/B baseline)."""
    return os.environ.get("NINFER_PAGED_INT8", "fold") != "dequant"


def paged_attend(pool: KVPool, table, layer, q, last_slot, slot_offset: int = 0, *,
                 interpret: bool | None = None, programs: int = 512, num_warps: int = 4,
                 num_stages: int = 2, fold: bool | None = None):
    """The kernel; same contract as `paged_attend_ref` (T must be 1). fold: INT8 scales on
    the scores and softmax weights (None: `fold_default()`, read here, outside the jit cache)."""
    return _paged_attend(pool, table, layer, q, last_slot, slot_offset, interpret=interpret,
                         programs=programs, num_warps=num_warps, num_stages=num_stages,
                         fold=fold_default() if fold is None else fold)


@functools.partial(jax.jit, static_argnames=("slot_offset", "interpret", "programs",
                                             "num_warps", "num_stages", "fold"))
def _paged_attend(pool: KVPool, table, layer, q, last_slot, slot_offset: int, *,
                  interpret: bool | None, programs: int, num_warps: int, num_stages: int,
                  fold: bool):
    interpret = resolve_interpret(interpret)
    b, t, nh, hd = q.shape
    if t != 1:
        raise ValueError(f"paged_attend decodes one token per row, got T={t}")
    kvh, page, mp = pool.k.shape[3], pool.page_size, table.shape[1]
    r = nh // kvh
    if r > _ROWS:
        return paged_attend_ref(pool, table, layer, q, last_slot, slot_offset)
    pps = _pages_per_split(kvh, mp, programs)
    splits = -(-mp // pps)
    # [B, kvh, 16, hd]: head h = g * r + i (HF repeat_kv order) -> group g, row i.
    cdt = jnp.bfloat16 if pool.k.dtype in (jnp.bfloat16, jnp.int8) else jnp.float32
    qg = q[:, 0].reshape(b, kvh, r, hd).astype(cdt)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, _ROWS - r), (0, 0)))
    quant = pool.k_scale is not None
    kern = functools.partial(_kernel, pps=pps, page=page, hd=hd, max_pages=mp,
                             num_pages=pool.num_pages, slot_offset=slot_offset, quant=quant,
                             scale=hd ** -0.5, fold=fold)
    args = [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), table.astype(jnp.int32),
            last_slot.astype(jnp.int32), qg, pool.k, pool.v]
    if quant:
        args += [pool.k_scale, pool.v_scale]
    f32 = jnp.float32
    out_shape = (jax.ShapeDtypeStruct((b, splits, kvh, _ROWS, hd), f32),
                 jax.ShapeDtypeStruct((b, splits, kvh, _ROWS), f32),
                 jax.ShapeDtypeStruct((b, splits, kvh, _ROWS), f32))
    acc, m, l = pl.pallas_call(
        kern, grid=(b, kvh, splits), out_shape=out_shape, interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
        name="paged_decode")(*args)
    # Merge the splits; an empty split has m = -inf and weighs 0.
    m_all = jnp.max(m, axis=1, keepdims=True)
    w = jnp.where(jnp.isfinite(m), jnp.exp(m - m_all), 0.0)                   # [B, S, kvh, 16]
    out = jnp.sum(acc * w[..., None], axis=1) / jnp.sum(l * w, axis=1)[..., None]
    return out[:, :, :r].reshape(b, 1, nh, hd).astype(q.dtype)
