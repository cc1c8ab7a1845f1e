"""The paged KV pool's attention step as the model runs it: the write and the attention over a
row's pages, by the plan's kernels (engine/kernels/paged_decode.py, paged_prefill.py,
attn_prep.py, attn_merge.py) or the references (`write_pool`, `attend_blocks`) of the pool's
format (engine/ops/paged_kv.py, whose docstring has the layout and the slot rule)."""
from __future__ import annotations

import jax.numpy as jnp

from engine.model.config import ModelConfig
from engine.ops.paged_kv import KVPool, PagedKV, attend_blocks, write_pool


def _decode_attend(pool: KVPool, table, layer, q, slots, valid, slot_offset, gate=None,
                   heads=None, merge: str = "reduce"):
    """A decode step's attention (T = 1) by the paged-decode kernel. A row without a token
    this step (idle in a wider engine) sees its first slot only: its output is dropped, and it
    would otherwise read its whole stored context (at 128K, ~8.6 GB over the 27B's 16
    attention layers: ~1.5 ms a step on the H200). gate: (gate_src, gate_at, gate_stride) for
    `attn_merge.paged_attend_gated` (the gated output and its group sums), with q already
    the kernel's tile holding `heads` heads where heads is given. merge: how the kernel's
    splits are merged (a plan's paged_merge)."""
    from engine.kernels.paged_decode import paged_attend

    last = jnp.where(valid[:, 0], slots[:, 0], slot_offset)
    if gate is not None:
        from engine.kernels.attn_merge import paged_attend_gated

        return paged_attend_gated(pool, table, layer, q, last, *gate, slot_offset,
                                  heads=heads)
    return paged_attend(pool, table, layer, q, last, slot_offset, merge=merge)


def paged_write_attend(kv: PagedKV, layer, q, k, v, positions, valid, plan=None):
    """The paged replacement of `attention.kv_write_attend` (same signature and result).

    kv: PagedKV (pool, table [B, max_pages] int32, slot_offset); layer: int32 scalar index into
    the pool's L; q: [B, T, heads, head_dim]; k, v: [B, T, kv_heads, head_dim]; positions: [B, T]
    int32; valid: [B, T] bool. Step t of row b is written at slot s = positions + slot_offset,
    i.e. page table[b, s // P], offset s % P (quantized for int8 pools). Invalid steps, slots past
    the table and negative page ids write nothing. The caller (allocator) guarantees every page a
    step writes is owned by that row alone: two rows writing one slot in one step is undefined.
    Query t sees slots slot_offset..s of its own row. plan (engine/plan.py; None: the
    reference): with decode_attention "paged" a decode step (T = 1) attends with the
    paged-decode kernel (engine/kernels/paged_decode.py), which reads only the row's pages up
    to its position; with prefill_attention "flash" a prefill chunk (T > 1) with the
    paged-prefill kernel (engine/kernels/paged_prefill.py; shapes it cannot tile keep the
    gather).
    Returns (out [B, T, heads, head_dim] in q.dtype, new PagedKV).
    """
    pool, table, off0 = kv
    pool, slots = write_pool(pool, table, layer, positions, valid, off0, k, v)
    if plan is not None and plan.decode_attention == "paged" and q.shape[1] == 1:
        return (_decode_attend(pool, table, layer, q, slots, valid, off0,
                               merge=plan.paged_merge), kv._replace(pool=pool))
    if plan is not None and plan.prefill_attention == "flash" and q.shape[1] > 1:
        from engine.kernels import paged_prefill

        if paged_prefill.supported(pool, q):
            return (paged_prefill.paged_prefill_attend(pool, table, layer, q, slots, off0),
                    kv._replace(pool=pool))
    return attend_blocks(pool, table, layer, q, slots, valid, off0), kv._replace(pool=pool)


def paged_prep_attend(kv: PagedKV, layer, qkv, qn, kn, positions, valid, *, cfg: ModelConfig,
                      gated: bool = False, merge: str = "reduce"):
    """A decode step's attention from its projections' one output (qkv [B, 1, nh 2 hd + 2 kvh
    hd], as `linear_multi(concat=True)` gives it): the q/k norms, RoPE and this step's
    K/V write in one kernel (engine/kernels/attn_prep.py; qn/kn the norm weights, or their
    `Stacked` views read in place), then the paged decode kernel as `paged_write_attend` runs
    it. Returns (out [B, 1, nh, hd], new PagedKV); gated: ((out gated by the heads' gates in
    qkv [B, 1, nh hd], its group sums [B, 1, nh hd / 64]), new PagedKV), the splits' merge,
    the gate and the sums in one kernel (engine/kernels/attn_merge.py; `attn_merge.takes`
    must hold). merge: the paged kernel's (a plan's paged_merge; the gated tail merges the
    splits itself)."""
    from engine.kernels.attn_prep import attn_prep
    from engine.kernels.paged_decode import TILE_ROWS
    from engine.kernels.stacked import Stacked

    pool, table, off0 = kv
    (qw, qi), (kw, ki) = [(w.w, w.index) if isinstance(w, Stacked) else (w, None)
                          for w in (qn, kn)]
    # gated: q written as the paged kernel tiles it (no pad between the two kernels)
    q, pool = attn_prep(cfg, qkv, qw, kw, pool, table, positions, valid, layer, off0,
                        qn_index=qi, kn_index=ki, pad=TILE_ROWS if gated else 0)
    hd = cfg.head_dim
    gate = (qkv[:, 0], hd, 2 * hd) if gated else None
    return (_decode_attend(pool, table, layer, q, positions + off0, valid, off0, gate,
                           cfg.num_heads if gated else None, merge),
            kv._replace(pool=pool))
