"""Gated full attention: the mixer (projections, q/k norms, RoPE, the KV write/attend step,
output gate) and its kernel dispatch by the plan.

The KV cache of all attention layers is one contiguous array per K and V,
[layers, B, max_len, kv_heads, head_dim]; `kv_write_attend` is the only code that knows that layout.
The paged pool replaces that one function with `paged_write_attend` (engine/model/paged_kv.py);
`layers.attention_layer` picks one by the type of the kv it is given. Both share `attend`, the
layout-free softmax core (engine/ops/attention.py, with RoPE).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from engine.model.config import ModelConfig
from engine.model.linear import linear, linear_multi
from engine.ops.attention import apply_rope, attend, rope_tables
from engine.ops.norms import rms_norm


def kv_write_attend(kv, layer, q, k, v, positions, valid, plan=None):
    """Write this step's K/V into the cache, then causal softmax attention over the cache.

    kv: (k_cache, v_cache), each [L, B, S, kv_heads, head_dim]; layer: int32 scalar (which L);
    q: [B, T, heads, head_dim]; k, v: [B, T, kv_heads, head_dim]; positions: [B, T] int32 absolute
    positions; valid: [B, T] bool. Invalid steps are not written (their slot is out of range and
    dropped, as is anything at or past S). Query i of row b sees cache slots <= positions[b, i];
    slots past a row's position hold stale data from rolled-back steps and are never read.
    plan: prefill_attention "flash" sends prefill-sized T to the flash kernel
    (engine/kernels/flash_prefill.py), decode_attention "paged" a decode step to the
    paged-decode kernel over the cache viewed as 64-token pages.
    Returns (out [B, T, heads, head_dim] in q.dtype, new kv).
    """
    k_cache, v_cache = kv
    b = q.shape[0]
    s = k_cache.shape[2]
    slot = jnp.where(valid, positions, s)
    rows = jnp.arange(b)[:, None]
    k_cache = k_cache.at[layer, rows, slot].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[layer, rows, slot].set(v.astype(v_cache.dtype), mode="drop")
    if plan is not None:
        out = _kernel_attend(k_cache, v_cache, layer, q, positions, plan)
        if out is not None:
            return out, (k_cache, v_cache)
    keys = k_cache[layer].astype(jnp.float32)  # [B, S, kvh, hd]
    vals = v_cache[layer].astype(jnp.float32)
    visible = jnp.arange(s)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    return attend(q, keys, vals, visible), (k_cache, v_cache)


def _kernel_attend(k_cache, v_cache, layer, q, positions, plan):
    """The plan's kernel path of `kv_write_attend` after the write, or None where it names no
    kernel or none fits."""
    from engine.kernels import flash_prefill, paged_decode
    from engine.ops.paged_kv import KVPool

    nl, b, s, kvh, hd = k_cache.shape
    if plan.prefill_attention == "flash" and flash_prefill.supported(k_cache, q):
        return flash_prefill.flash_attend(k_cache, v_cache, layer, q, positions)
    page = 64
    if plan.decode_attention == "paged" and q.shape[1] == 1 and s % page == 0:
        # [L, B, S, ...] is [L, B * S/64, 64, ...] pages; row b owns pages b*S/64 .. in order.
        as_pages = lambda a: a.reshape(nl, b * (s // page), page, kvh, hd)  # noqa: E731
        pool = KVPool(as_pages(k_cache), as_pages(v_cache), None, None)
        table = jnp.arange(b * (s // page), dtype=jnp.int32).reshape(b, s // page)
        return paged_decode.paged_attend(pool, table, layer, q, positions[:, 0],
                                         merge=plan.paged_merge)
    return None


def _prep_decode(cfg: ModelConfig, x, kv, plan):
    """`model.paged_kv.paged_prep_attend` where a decode step's layer takes it (the paged pool,
    the plan's attn_prep and the kernel's shapes: `attn_prep.takes`), with `gated` set where
    the plan's attention tail kernel takes the rest (`attn_merge`), else None."""
    from engine.kernels import attn_merge, attn_prep
    from engine.model.paged_kv import paged_prep_attend
    from engine.ops.paged_kv import PagedKV

    if isinstance(kv, PagedKV) and plan.attn_prep and attn_prep.takes(cfg, kv.pool, x):
        return functools.partial(paged_prep_attend, cfg=cfg, merge=plan.paged_merge,
                                 gated=plan.attn_merge and attn_merge.takes(cfg))
    return None


def attention_mixer(p, cfg: ModelConfig, x, kv, layer, positions, valid,
                    write_attend=kv_write_attend, plan=None, corr=None):
    """Gated attention token mixer. p: the layer's `self_attn` params; x: [B, T, H] (normed).

    q_proj rows are grouped per head as [q (head_dim) | gate (head_dim)]. `write_attend` is
    `kv_write_attend` or `model.paged_kv.paged_write_attend`, matching the kind of `kv`. plan: the
    KernelPlan (engine/plan.py; None: the references), passed to the projections and to
    `write_attend`; corr: x's group sums for the projections' GEMV (`linear`). Returns
    (out [B, T, H], new kv).
    """
    b, t, _ = x.shape
    nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    mats = [p["q_proj"], p["k_proj"], p["v_proj"]]
    if plan is not None and (fused := _prep_decode(cfg, x, kv, plan)) is not None:
        # the norms, RoPE and the K/V write in one kernel after the projections' one launch
        qkv = linear_multi(x, mats, plan, concat=True, corr=corr)
        out, kv = fused(kv, layer, qkv, p["q_norm"], p["k_norm"], positions, valid)
        if fused.keywords["gated"]:  # the splits' merge, the gate, o_proj's sums: one kernel
            y, sums = out
            return linear(y, p["o_proj"], plan, corr=sums), kv
        gate = qkv[..., :nh * 2 * hd].reshape(b, t, nh, 2 * hd)[..., hd:].reshape(b, t, nh * hd)
    else:
        from engine.kernels.stacked import plain

        qg, k, v = linear_multi(x, mats, plan, corr=corr)
        qg = qg.reshape(b, t, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(b, t, nh * hd)
        q = rms_norm(q, plain(p["q_norm"]), cfg.rms_norm_eps)
        k = rms_norm(k.reshape(b, t, kvh, hd), plain(p["k_norm"]), cfg.rms_norm_eps)
        v = v.reshape(b, t, kvh, hd)
        cos, sin = rope_tables(cfg, positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if plan is None or (plan.prefill_attention == "xla"
                            and plan.decode_attention == "xla"):
            # the plain call: write_attend may be any reference
            out, kv = write_attend(kv, layer, q, k, v, positions, valid)
        else:
            out, kv = write_attend(kv, layer, q, k, v, positions, valid, plan=plan)
    out = out.reshape(b, t, nh * hd) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype)
    return linear(out, p["o_proj"], plan), kv
