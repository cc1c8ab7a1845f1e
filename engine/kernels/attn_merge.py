"""A decode step's attention tail in one kernel: the paged decode kernel's splits merged, the
output gate applied, and the group sums that o_proj's int4 GEMV takes.

After `paged_decode`'s kernel, XLA runs four kernels a gated-attention layer for this (the
splits' max, the weighted sums of the values and of the softmax denominators, then the gate's
multiply with the group sums: ~7 us a layer, 16 layers, on the H200). Here program (row, head,
column tile) walks only the row's non-empty splits (which the row's own length fixes, as the
paged kernel split them) in chunks, in split order: the max, then the weighted sums; divides,
rounds to the activations' dtype, multiplies by sigmoid(gate) read from the projections' one
output, and writes the tile and its 64-value group sums. The order of every addition depends
on the row alone, so a row's bits are the same at any batch size (XLA's reductions tile by
shape, `paged_decode.check_merge`).

`merge_gate_sums_ref` is the model's ops (`paged_decode._merge`, the gate in
`attention.attention_mixer`, `cuda_ops.group_sums`). A plan's attn_merge sends a decode step's
attention layers here (with the prep kernel, `attn_prep`); no preset does: measured on the H200
within the runs' spread of the default path (C2 +0.8% at 1K, -1.4% at 32K).

`paged_attend_gated` is the paged decode kernel (`paged_decode`'s partials) followed by this one:
the gated decode attention the model calls.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from engine.kernels import resolve_interpret, triton_params
from engine.kernels.cuda_ops import group_sums
from engine.kernels.paged_decode import (_ROWS, _STATIC, TILE_ROWS, _merge, _partials,
                                         _settings)
from engine.ops.paged_kv import KVPool
from engine.ops.quant import GROUP

TILE = 128  # output columns a program (two groups of 64)


def takes(cfg) -> bool:
    """Whether a model's attention layers fit the kernel: a head's columns split into its
    tiles (a power of two, at least one group of 64) and a KV head's query heads fit the paged
    kernel's tile (`paged_decode.TILE_ROWS`)."""
    hd = cfg.head_dim
    return (hd % GROUP == 0 and hd & (hd - 1) == 0
            and cfg.num_heads // cfg.num_kv_heads <= TILE_ROWS)


def active_splits(last, page: int, splits: int, max_pages: int):
    """How many of a row's splits hold pages: the paged kernel gives the row's visible pages
    (up to its last slot) to its splits in runs of ceil(pages / splits)."""
    pages = jnp.minimum(last // page + 1, max_pages)
    pps = jnp.maximum(1, (pages + splits - 1) // splits)
    return (pages + pps - 1) // pps


def merge_gate_sums_ref(acc, m, l, gate, out_dtype):
    """acc [B, S, kvh, R, hd], m and l [B, S, kvh, R] (the paged kernel's partials, R >= the
    heads a KV head serves), gate [B, nh hd] (nh = kvh r, head h = g r + i) -> (y [B, nh hd]
    in out_dtype, its group sums [B, nh hd / 64] fp32): the merged attention rounded to
    out_dtype, times sigmoid(gate) rounded to out_dtype."""
    b, _, kvh, _, hd = acc.shape
    r = gate.shape[-1] // (kvh * hd)
    out = _merge(acc, m, l)[:, :, :r].reshape(b, kvh * r * hd).astype(out_dtype)
    y = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out_dtype)
    return y, group_sums(y)


def _kernel(last_ref, acc_ref, m_ref, l_ref, g_ref, y_ref, c_ref, *, r, hd, tile, chunk, page,
            splits, max_pages, gate_at, gate_stride):
    b, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    grp, i = h // r, h % r
    ns = active_splits(last_ref[b], page, splits, max_pages)
    chunks = (ns + chunk - 1) // chunk

    def m_at(j):
        return m_ref[b, pl.ds(j * chunk, chunk), grp, i]

    m_all = lax.fori_loop(0, chunks, lambda j, mx: jnp.maximum(mx, jnp.max(m_at(j))),
                          jnp.float32(-jnp.inf))

    def add(j, carry):
        num, den = carry
        mv = m_at(j)
        w = jnp.where(mv > -jnp.inf, jnp.exp(mv - m_all), 0.0)                   # [chunk]
        a = acc_ref[b, pl.ds(j * chunk, chunk), grp, i, pl.ds(t * tile, tile)]     # [chunk, tile]
        return (num + jnp.sum(a * w[:, None], axis=0),
                den + jnp.sum(l_ref[b, pl.ds(j * chunk, chunk), grp, i] * w))

    num, den = lax.fori_loop(0, chunks, add, (jnp.zeros((tile,), jnp.float32),
                                              jnp.float32(0.0)))
    dt = y_ref.dtype
    out = (num / den).astype(dt).astype(jnp.float32)
    gate = g_ref[b, pl.ds(gate_at + h * gate_stride + t * tile, tile)].astype(jnp.float32)
    sig = (1.0 / (1.0 + jnp.exp(-gate))).astype(dt).astype(jnp.float32)
    y = (out * sig).astype(dt)
    col = h * hd + t * tile
    y_ref[b, pl.ds(col, tile)] = y
    c_ref[b, pl.ds(col // GROUP, tile // GROUP)] = jnp.sum(
        y.astype(jnp.float32).reshape(tile // GROUP, GROUP), axis=1)


def _chunk(splits: int, most: int = 16) -> int:
    """Splits a loop step: the largest power of two <= most that divides `splits`."""
    c = 1
    while 2 * c <= most and splits % (2 * c) == 0:
        c *= 2
    return c


def merge_gate_sums(acc, m, l, last, gate_src, *, heads: int, page: int, max_pages: int,
                    gate_at: int, gate_stride: int, out_dtype, tile: int = TILE,
                    interpret: bool | None = None, num_warps: int = 4):
    """`merge_gate_sums_ref` as one kernel, with head h's gate at columns [gate_at + h
    gate_stride, + hd) of gate_src [B, P] (the projections' output as the GEMV wrote it: q and
    gate side by side a head gives gate_at = hd, gate_stride = 2 hd) and the row's splits
    that hold pages found from its last visible slot `last` [B] as the paged kernel found them
    (page size, the table's width max_pages). Returns (y [B, heads hd], sums [B, heads hd /
    64])."""
    return _merge_gate(acc, m, l, last, gate_src, heads=int(heads), page=int(page),
                       max_pages=int(max_pages), gate_at=int(gate_at),
                       gate_stride=int(gate_stride), out_dtype=jnp.dtype(out_dtype),
                       tile=int(tile), interpret=resolve_interpret(interpret),
                       num_warps=int(num_warps))


@functools.partial(jax.jit, static_argnames=("heads", "page", "max_pages", "gate_at",
                                             "gate_stride", "out_dtype", "tile", "interpret",
                                             "num_warps"))
def _merge_gate(acc, m, l, last, gate_src, *, heads, page, max_pages, gate_at, gate_stride,
                out_dtype, tile, interpret, num_warps):
    b, splits, kvh, rows, hd = acc.shape
    r = heads // kvh
    if heads % kvh or r > rows:
        raise ValueError(f"merge_gate_sums: {heads} heads on {kvh} KV heads of {rows} rows")
    if m.shape != acc.shape[:-1] or l.shape != m.shape:
        raise ValueError(f"merge_gate_sums: m {m.shape} and l {l.shape} must be acc's "
                         f"{acc.shape[:-1]}")
    tile = min(tile, hd)
    if tile % GROUP or hd % tile or tile & (tile - 1):
        raise ValueError(f"merge_gate_sums: the tile ({tile}) must be a power of two, a "
                         f"multiple of {GROUP} dividing head_dim {hd}")
    if gate_src.ndim != 2 or gate_src.shape[0] != b or \
            gate_at + (heads - 1) * gate_stride + hd > gate_src.shape[1]:
        raise ValueError(f"merge_gate_sums: the gates (at {gate_at}, {gate_stride} a head) "
                         f"must lie in gate_src {gate_src.shape} of {b} rows")
    kern = functools.partial(_kernel, r=r, hd=hd, tile=tile, chunk=_chunk(splits), page=page,
                             splits=splits, max_pages=max_pages, gate_at=gate_at,
                             gate_stride=gate_stride)
    return pl.pallas_call(
        kern, grid=(b, heads, hd // tile),
        out_shape=(jax.ShapeDtypeStruct((b, heads * hd), out_dtype),
                   jax.ShapeDtypeStruct((b, heads * hd // GROUP), jnp.float32)),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, 1),
        name="attn_merge")(last.astype(jnp.int32), acc, m, l, gate_src)


def paged_attend_gated(pool: KVPool, table, layer, q, last_slot, gate_src, gate_at: int,
                       gate_stride: int, slot_offset: int = 0, *, heads: int | None = None,
                       interpret: bool | None = None, programs: int | None = None,
                       num_warps: int | None = None, num_stages: int | None = None,
                       unroll: int | None = None):
    """`paged_decode.paged_attend` with the attention layer's tail: the splits merged, the
    output gated by sigmoid of head h's gate at columns [gate_at + h gate_stride, + hd) of
    gate_src [B, P], and the group sums of the result, in this module's kernel after the paged
    one. heads: q is already the kernel's tile [B, kvh,
    TILE_ROWS, hd] holding this many heads (the prep kernel's `pad`), else q is [B, 1, nh,
    hd]. Returns (y [B, 1, heads hd] in q.dtype, sums [B, 1, heads hd / 64] fp32)."""
    if heads is not None and (q.ndim != 4 or q.shape[1] != pool.k.shape[3]
                              or q.shape[2] != _ROWS or heads % q.shape[1]
                              or heads // q.shape[1] > _ROWS):
        raise ValueError(f"paged_attend_gated: a padded q must be [B, kvh {pool.k.shape[3]}, "
                         f"{_ROWS}, hd] holding {heads} heads, got {q.shape}")
    return _paged_attend_gated(pool, table, layer, q, last_slot, gate_src, slot_offset,
                               gate_at=int(gate_at), gate_stride=int(gate_stride),
                               heads=None if heads is None else int(heads),
                               interpret=interpret, **_settings(pool, programs, num_warps,
                                                                num_stages, unroll))


@functools.partial(jax.jit, static_argnames=_STATIC + ("gate_at", "gate_stride", "heads"))
def _paged_attend_gated(pool: KVPool, table, layer, q, last_slot, gate_src, slot_offset: int,
                        *, gate_at: int, gate_stride: int, heads: int | None,
                        interpret: bool | None, programs: int, num_warps: int,
                        num_stages: int, unroll: int):
    nh = heads if heads is not None else q.shape[2]  # heads: q is already the kernel's tile
    if nh // pool.k.shape[3] > _ROWS:
        raise ValueError(f"paged_attend_gated: {nh} heads on {pool.k.shape[3]} KV heads "
                         f"exceed the kernel's {_ROWS} rows (`attn_merge.takes`)")
    acc, m, l = _partials(pool, table, layer, q, last_slot, slot_offset, interpret=interpret,
                          programs=programs, num_warps=num_warps, num_stages=num_stages,
                          unroll=unroll, padded=heads is not None)
    y, sums = merge_gate_sums(acc, m, l, last_slot, gate_src, heads=nh, page=pool.page_size,
                              max_pages=table.shape[1], gate_at=gate_at,
                              gate_stride=gate_stride, out_dtype=q.dtype, interpret=interpret)
    return y[:, None], sums[:, None]
