"""A gated-attention layer's decode work between its projections and the paged attention kernel,
as one kernel: q and k RMSNorms (each head, the layer's weights read from their stacks), RoPE on
their first rotary dims, and this step's K and V written into the paged pool in place.

In XLA that is ~7 small kernels a layer on the GPU (the norms with RoPE for q and for k, the
weights' slices, the page arithmetic, two scatters into the pool, in an H200 trace). Here program
(b, h) takes head h of row b's projections, laid out as the one GEMV launch writes them
([q | gate] per query head, then K, then V): a query head is normed and rotated into q; a key
head is normed, rotated and stored at its slot; a value head is stored. A row whose step is not
valid, or whose slot falls outside its table or on a page id out of range, stores nothing (as
the reference's scatter drops it). bf16 or fp32 pools only (int8 pages keep the XLA path).

A head is handled as [head_dim / half, half] with half = rotary_dim / 2: RoPE's rotate-half
pairs rows 0 and 1 of that tile, so the rotation is two row sums and a select, with no
shuffles and no masked stores. Reference: `prep_ref` (the model's ops: `rms_norm`,
`rope_tables`, `apply_rope`, `paged_kv._store`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from engine.kernels import resolve_interpret, triton_params


def takes(cfg, pool, x) -> bool:
    """Whether `attn_prep` handles this layer's decode step: T == 1, bf16 activations, a bf16
    or fp32 pool, head and rotary dims the tile needs (half a power of two dividing head_dim
    into a power-of-two count of rows)."""
    hd, d = cfg.head_dim, cfg.rotary_dim
    half = d // 2
    rows = hd // half if half else 0
    return (x.ndim == 3 and x.shape[1] == 1 and x.dtype == jnp.bfloat16
            and pool.k_scale is None and d % 2 == 0 and half > 0
            and half & (half - 1) == 0 and hd % half == 0 and rows & (rows - 1) == 0)


def prep_ref(cfg, qkv, qn, kn, pool, table, positions, valid, layer, slot_offset=0):
    """The model's ops: (q [B, 1, nh, hd] normed and rotated, the pool with this step's K/V
    written). qkv [B, 1, nh 2 hd + 2 kvh hd]; qn, kn [hd]."""
    from engine.ops.attention import apply_rope, rope_tables
    from engine.ops.norms import rms_norm
    from engine.ops.paged_kv import write_pool

    b = qkv.shape[0]
    nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = qkv[..., :nh * 2 * hd].reshape(b, 1, nh, 2 * hd)
    k = qkv[..., nh * 2 * hd:nh * 2 * hd + kvh * hd].reshape(b, 1, kvh, hd)
    v = qkv[..., nh * 2 * hd + kvh * hd:].reshape(b, 1, kvh, hd)
    q = rms_norm(qg[..., :hd], qn, cfg.rms_norm_eps)
    k = rms_norm(k, kn, cfg.rms_norm_eps)
    cos, sin = rope_tables(cfg, positions)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    pool, _ = write_pool(pool, table, layer, positions, valid, slot_offset, k, v)
    return q, pool


def _kernel(at_ref, pos_ref, ok_ref, tab_ref, inv_ref, x_ref, qn_ref, kn_ref, kp_ref, vp_ref,
            q_ref, ko_ref, vo_ref, *, nh, kvh, rows, half, eps, mp, n, page_size, offset,
            pad):
    del kp_ref, vp_ref  # aliased to ko_ref / vo_ref
    b, h = pl.program_id(0), pl.program_id(1)
    layer, qi, ki = at_ref[0], at_ref[1], at_ref[2]
    hd = rows * half
    pos = pos_ref[b]
    slot = pos + offset
    pidx = slot // page_size
    page = tab_ref[b, jnp.minimum(pidx, mp - 1)]
    ok = (ok_ref[b] != 0) & (pidx < mp) & (page >= 0) & (page < n)
    off = slot % page_size
    rid = lax.broadcasted_iota(jnp.int32, (rows, half), 0)

    def head(col):  # [rows, half] fp32 of the head whose first column is `col`
        return x_ref[b, pl.ds(col // half, rows), :].astype(jnp.float32)

    def norm_rope(x, w):
        r = lax.rsqrt(jnp.sum(x * x) / hd + eps)
        y = (x * r * (1.0 + w)).astype(x_ref.dtype).astype(jnp.float32)  # rms_norm's bf16
        ang = pos.astype(jnp.float32) * inv_ref[...]                    # [half]
        cos, sin = jnp.cos(ang)[None, :], jnp.sin(ang)[None, :]
        r0 = jnp.sum(jnp.where(rid == 0, y, 0.0), axis=0)[None, :]
        r1 = jnp.sum(jnp.where(rid == 1, y, 0.0), axis=0)[None, :]
        y = jnp.where(rid == 0, r0 * cos - r1 * sin, jnp.where(rid == 1, r1 * cos + r0 * sin, y))
        return y

    r = nh // kvh

    @pl.when(h < nh)
    def _():
        w = qn_ref[qi, :, :].astype(jnp.float32)
        y = norm_rope(head(h * 2 * hd), w).astype(q_ref.dtype)
        if pad:  # q as the paged kernel tiles it: [kvh, pad rows, ...], head h = g r + i
            q_ref[b, h // r, h % r, :, :] = y
        else:
            q_ref[b, h, :, :] = y

    if pad:  # the K programs zero their group's rows past its r heads (whatever the slot)
        @pl.when((h >= nh) & (h < nh + kvh))
        def _():
            for i in range(r, pad):
                q_ref[b, h - nh, i, :, :] = jnp.zeros((rows, half), q_ref.dtype)

    @pl.when((h >= nh) & (h < nh + kvh) & ok)
    def _():
        kh = h - nh
        w = kn_ref[ki, :, :].astype(jnp.float32)
        y = norm_rope(head(nh * 2 * hd + kh * hd), w)
        ko_ref[layer, page, off, kh, :, :] = y.astype(ko_ref.dtype)

    @pl.when((h >= nh + kvh) & ok)
    def _():
        vh = h - nh - kvh
        vo_ref[layer, page, off, vh, :, :] = head(nh * 2 * hd + kvh * hd + vh * hd).astype(
            vo_ref.dtype)


def attn_prep(cfg, qkv, qn, kn, pool, table, positions, valid, layer, slot_offset: int = 0,
              qn_index=None, kn_index=None, *, interpret: bool | None = None,
              num_warps: int = 2, pad: int = 0):
    """`prep_ref` as one kernel. qn/kn: [hd], or stacks [*d, hd] read at qn_index/kn_index
    (int32 [d]); positions [B, 1], valid [B, 1]; layer: the pool's layer index. Returns (q,
    the pool), the pool's K/V updated in place (aliased). pad: q as [B, kvh, pad, hd] with
    zero rows past each group's heads (the paged decode kernel's tile, `paged_decode._ROWS`;
    XLA's pad then goes), else [B, 1, nh, hd]."""
    if pad and pad < cfg.num_heads // cfg.num_kv_heads:
        raise ValueError(f"attn_prep: pad ({pad}) must hold a group's "
                         f"{cfg.num_heads // cfg.num_kv_heads} heads")
    from engine.kernels.norm_sums import _stack

    qs, qi = _stack(qn, qn_index)
    ks, ki = _stack(kn, kn_index)
    at = jnp.concatenate([jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), qi, ki])
    return _prep(cfg, qkv, qs, ks, pool, table, positions, valid, at, slot_offset=int(slot_offset),
                 interpret=resolve_interpret(interpret), num_warps=num_warps, pad=int(pad))


@functools.partial(jax.jit, static_argnames=("cfg", "slot_offset", "interpret", "num_warps",
                                             "pad"))
def _prep(cfg, qkv, qs, ks, pool, table, positions, valid, at, *, slot_offset, interpret,
          num_warps, pad=0):
    from engine.ops.attention import inv_freq
    from engine.ops.paged_kv import KVPool

    b = qkv.shape[0]
    nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    half = cfg.rotary_dim // 2
    rows = hd // half
    width = nh * 2 * hd + 2 * kvh * hd
    if qkv.shape[-1] != width:
        raise ValueError(f"attn_prep: qkv has {qkv.shape[-1]} columns, expected {width}")
    L, n, p = pool.k.shape[:3]
    shape6 = (L, n, p, kvh, rows, half)
    kern = functools.partial(_kernel, nh=nh, kvh=kvh, rows=rows, half=half,
                             eps=float(cfg.rms_norm_eps), mp=table.shape[1], n=n, page_size=p,
                             offset=slot_offset, pad=pad)
    q_shape = (b, kvh, pad, rows, half) if pad else (b, nh, rows, half)
    q, kd, vd = pl.pallas_call(
        kern, grid=(b, nh + 2 * kvh),
        out_shape=(jax.ShapeDtypeStruct(q_shape, qkv.dtype),
                   jax.ShapeDtypeStruct(shape6, pool.k.dtype),
                   jax.ShapeDtypeStruct(shape6, pool.v.dtype)),
        input_output_aliases={8: 1, 9: 2}, interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, 1),
        name="attn_prep")(
            at, positions.reshape(b).astype(jnp.int32), valid.reshape(b).astype(jnp.int32),
            table.astype(jnp.int32), jnp.asarray(inv_freq(cfg)),
            qkv.reshape(b, width // half, half), qs.reshape(qs.shape[0], rows, half),
            ks.reshape(ks.shape[0], rows, half), pool.k.reshape(shape6),
            pool.v.reshape(shape6))
    return (q.reshape(b, kvh, pad, hd) if pad else q.reshape(b, 1, nh, hd),
            KVPool(kd.reshape(pool.k.shape), vd.reshape(pool.v.shape), None, None))
