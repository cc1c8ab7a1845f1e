"""The paged KV pool's format: one pool of fixed-size pages shared by every sequence.

Layout: k, v [L, num_pages, page_size, kv_heads, head_dim], L = attention-layer index (block i's
attention layer is index i, so the block scan's index picks its layer; a pool built with
`mtp=True` holds the MTP layer at index num_blocks). A batch row reaches its tokens through its
block table [B, max_pages] int32: slot s of the row lives in page table[b, s // P] at offset
s % P, in every layer. The host allocator owns the tables (refcounts, copy-on-write); this module
only reads them, so two rows may list the same page for a shared read-only prefix.

Invariant the allocator relies on: slot s of every layer is a function of tokens[0..s] only.
For the main layers slot = position. The MTP entry at position j pairs hidden h_j with token
x_{j+1}, so it is stored at slot j + 1 (`slot_offset=1`, slot 0 unused): then a page that holds
a shared prefix holds the MTP keys of that prefix too, and a fork never writes into it.

KV dtypes: float32, bfloat16, or int8 with fp32 scales [L, num_pages, page_size, kv_heads]
(symmetric, one scale per token and head over head_dim: scale = amax / 127, an all-zero row gets
scale 1, codes = clip(round_half_even(x / scale), -127, 127)).

The references here are plain jnp: `write_pool` (this step's K/V into the pool) and
`attend_blocks` (attention over a row's pages, walked in blocks); the paged kernels
(engine/kernels/paged_decode.py, paged_prefill.py, attn_prep.py) are checked against them, and
the model's `paged_write_attend` (engine/model/paged_kv.py) chooses between them by the plan.
cfg is a `ModelConfig` (engine/model/config.py), read for its fields only.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from engine.model.config import ModelConfig

PAGE_SIZE = 64  # tokens per page; docs/ARCHITECTURE.md "Paged KV" says why 64
KV_DTYPES = ("float32", "bfloat16", "int8")
INT8_QMAX = 127.0


class KVPool(NamedTuple):
    k: jax.Array               # [L, num_pages, page_size, kv_heads, head_dim]  kv dtype
    v: jax.Array               # [L, num_pages, page_size, kv_heads, head_dim]  kv dtype
    k_scale: jax.Array | None  # [L, num_pages, page_size, kv_heads] fp32 (int8 pools only)
    v_scale: jax.Array | None  # [L, num_pages, page_size, kv_heads] fp32 (int8 pools only)

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


class PagedKV(NamedTuple):
    """What an attention layer is given instead of the contiguous (k, v): the pool, the batch's
    block tables, and the slot of position 0 (0 for the main layers, 1 for the MTP layer)."""
    pool: KVPool
    table: jax.Array       # [B, max_pages] int32 page ids
    slot_offset: int = 0   # a Python int: static


def kv_storage_dtype(dtype) -> np.dtype:
    """The numpy dtype of a KV storage dtype given by name or dtype; ValueError if unsupported."""
    try:
        dt = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise ValueError(f"unknown KV dtype {dtype!r}; supported: {list(KV_DTYPES)}") from None
    if dt.name not in KV_DTYPES:
        raise ValueError(f"unsupported KV dtype {dt.name}; supported: {list(KV_DTYPES)}")
    return dt


def num_kv_layers(cfg: ModelConfig, *, mtp: bool = False) -> int:
    """Attention layers a pool holds: one per block, plus the MTP layer when asked for."""
    return cfg.num_blocks + (cfg.mtp_layers if mtp else 0)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype, *, mtp: bool = False) -> int:
    """Pool bytes one token occupies (K and V, all layers, int8 scales included).
    qwen3.8-27b: bfloat16 65,536; int8 32,768 + 512 of scales = 33,280; x 17/16 with mtp."""
    dt = kv_storage_dtype(kv_dtype)
    per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * dt.itemsize
    if dt == np.int8:
        per_layer += 2 * cfg.num_kv_heads * 4
    return num_kv_layers(cfg, mtp=mtp) * per_layer


def kv_pages_needed(tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Pages that hold `tokens` slots (host-side arithmetic for the allocator)."""
    if tokens < 0 or page_size <= 0:
        raise ValueError(f"need tokens >= 0 and page_size > 0, got {tokens}, {page_size}")
    return -(-tokens // page_size)


def init_kv_pool(cfg: ModelConfig, num_pages: int, page_size: int = PAGE_SIZE,
                 kv_dtype=jnp.bfloat16, *, mtp: bool = False) -> KVPool:
    """An all-zero pool of `num_pages` pages of `page_size` tokens. `mtp=True` adds the MTP
    layer (index cfg.num_blocks), needed by `mtp_forward` on a paged cache."""
    if not (isinstance(num_pages, int) and num_pages > 0):
        raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
    if not (isinstance(page_size, int) and page_size > 0):
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    dt = kv_storage_dtype(kv_dtype)
    shape = (num_kv_layers(cfg, mtp=mtp), num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    scale = (lambda: jnp.ones(shape[:-1], jnp.float32)) if dt == np.int8 else (lambda: None)
    return KVPool(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), k_scale=scale(),
                  v_scale=scale())


def quantize_kv(x):
    """x [..., head_dim] -> (codes int8 [..., head_dim], scale fp32 [...]), per row symmetric."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / INT8_QMAX, 1.0)
    # jnp.round rounds half to even, like np.rint in engine/ops/quant.py.
    codes = jnp.clip(jnp.round(x / scale[..., None]), -INT8_QMAX, INT8_QMAX)
    return codes.astype(jnp.int8), scale


def dequantize_kv(codes, scale):
    """codes int8 [..., head_dim], scale fp32 [...] -> fp32 [..., head_dim]."""
    return codes.astype(jnp.float32) * scale[..., None]


def _store(data, scale, layer, page, off, x):
    """Scatter x [B, T, kvh, hd] into data[layer, page, off] (page out of range: dropped)."""
    if scale is None:
        return data.at[layer, page, off].set(x.astype(data.dtype), mode="drop"), None
    codes, s = quantize_kv(x)
    return (data.at[layer, page, off].set(codes, mode="drop"),
            scale.at[layer, page, off].set(s, mode="drop"))


def _load(data, scale, layer, pages):
    """The row's pages of one layer as fp32 [B, n * P, kvh, hd]. pages: [B, n]. One gather
    over (layer, page): inside a loop, `data[layer][pages]` would have XLA copy the whole layer
    of the pool on every trip."""
    x = data[layer, pages]  # [B, n, P, kvh, hd]
    x = x.astype(jnp.float32) if scale is None else dequantize_kv(x, scale[layer, pages])
    b, mp, p = x.shape[:3]
    return x.reshape(b, mp * p, *x.shape[3:])


def write_pool(pool: KVPool, table, layer, positions, valid, slot_offset, k, v):
    """This step's K/V [B, T, kvh, hd] into the pool at slots positions + slot_offset (page
    table[b, s // P], offset s % P; quantized for int8 pools); invalid steps, slots past the
    table and page ids out of range write nothing. Returns (pool, slots)."""
    n, p, mp = pool.num_pages, pool.page_size, table.shape[1]
    slots = positions + slot_offset
    idx = slots // p
    page = jnp.take_along_axis(table, jnp.clip(idx, 0, mp - 1), axis=1)
    ok = valid & (idx < mp) & (page >= 0) & (page < n)
    page = jnp.where(ok, page, n)  # out of range -> dropped by the scatter
    k_data, k_scale = _store(pool.k, pool.k_scale, layer, page, slots % p, k)
    v_data, v_scale = _store(pool.v, pool.v_scale, layer, page, slots % p, v)
    return KVPool(k_data, v_data, k_scale, v_scale), slots


BLOCK_PAGES = 16  # pages per step of `attend_blocks` (1024 slots at P = 64)


def attend_blocks(pool: KVPool, table, layer, q, slots, valid, slot_offset=0):
    """`attention.attend` over the rows' pages (query t of row b sees slots
    slot_offset..slots[b, t]), walked in blocks of BLOCK_PAGES pages with an online softmax
    and a trip count set at run time by the furthest slot any valid query sees: the cost
    follows the live length, not the table width (a 32K-slot table no longer costs 32K slots
    per step). Masked slots score the same finite floor as `attend`; a block that a row cannot
    see changes nothing of that row's sums (its correction factor is exp(0) = 1 and its terms
    exp(floor - max) = 0), so a row's result does not depend on the other rows' lengths.
    Returns [B, T, heads, head_dim] in q.dtype."""
    n, p, mp = pool.num_pages, pool.page_size, table.shape[1]
    bp = min(BLOCK_PAGES, mp)
    blocks = -(-mp // bp)
    # Entries past a row's length may be anything (-1 included): clipped, and masked below.
    tab = jnp.clip(jnp.pad(table, ((0, 0), (0, blocks * bp - mp))), 0, n - 1)
    b, t, nh, hd = q.shape
    kvh = pool.k.shape[3]
    qg = q.astype(jnp.float32).reshape(b, t, kvh, nh // kvh, hd)
    floor = jnp.finfo(jnp.float32).min
    last = jnp.max(jnp.where(valid, slots, 0))
    trips = jnp.clip(last // (bp * p) + 1, 1, blocks)

    def step(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tab, i * bp, bp, axis=1)     # [B, bp]
        keys = _load(pool.k, pool.k_scale, layer, pages)             # [B, bp * P, ...]
        vals = _load(pool.v, pool.v_scale, layer, pages)
        s = i * bp * p + jnp.arange(bp * p)[None, None, :]
        visible = (s >= slot_offset) & (s <= slots[:, :, None])          # [B, T, bp * P]
        sc = jnp.einsum("btgrd,bsgd->bgrts", qg, keys,
                        precision=jax.lax.Precision.HIGHEST) * hd ** -0.5
        sc = jnp.where(visible[:, None, None], sc, floor)
        m_new = jnp.maximum(m, sc.max(-1))
        corr = jnp.exp(m - m_new)
        e = jnp.exp(sc - m_new[..., None])
        acc = acc * corr[..., None] + jnp.einsum("bgrts,bsgd->bgrtd", e, vals,
                                                 precision=jax.lax.Precision.HIGHEST)
        return m_new, l * corr + e.sum(-1), acc

    shape = (b, kvh, nh // kvh, t)
    init = (jnp.full(shape, floor, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, hd), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, trips, step, init)
    out = acc / l[..., None]                                  # l >= 1: the max term is exp(0)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nh, hd).astype(q.dtype)


def _copy_pages(pool: KVPool, src, dst) -> KVPool:
    n = pool.num_pages
    src = jnp.clip(jnp.asarray(src, jnp.int32), 0, n - 1)
    dst = jnp.asarray(dst, jnp.int32)
    dst = jnp.where((dst >= 0) & (dst < n), dst, n)
    return jax.tree.map(lambda a: a.at[:, dst].set(a[:, src], mode="drop"), pool)


@functools.partial(jax.jit, donate_argnums=0)
def copy_pages(pool: KVPool, src, dst) -> KVPool:
    """Copy pages src[i] -> dst[i] in every layer (K, V and scales): copy-on-write of a shared
    page, e.g. the partial last page of a forked response. src, dst: [n] int32. A negative dst
    is skipped, so callers can pad to a fixed n and avoid recompiles. dst ids must be distinct
    and not among src. The pool is donated (updated in place); use the returned one."""
    return _copy_pages(pool, src, dst)
