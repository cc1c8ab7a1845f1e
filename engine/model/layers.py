"""Decoder layers of the hybrid model: the Gated DeltaNet mixer, SwiGLU MLP, and the pre-norm
residual wrapper shared by GDN and attention layers. Parameters are nested dicts mirroring the
canonical names (`linear_attn.in_proj_qkv` -> p["linear_attn"]["in_proj_qkv"])."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from engine.model.attention import attention_mixer, kv_write_attend
from engine.model.config import ModelConfig
from engine.model.gdn import select_rule
from engine.model.linear import linear, linear_multi
from engine.model.paged_kv import paged_write_attend
from engine.ops.gdn import gdn_core
from engine.ops.norms import rms_norm
from engine.ops.paged_kv import PagedKV
from engine.plan import REFERENCE, KernelPlan


def mlp(p, x, plan: KernelPlan = REFERENCE, corr=None):
    """SwiGLU: down(silu(gate(x)) * up(x)). x: [B, T, H]; corr: x's group sums or None."""
    gate, up = linear_multi(x, [p["gate_proj"], p["up_proj"]], plan, corr=corr)
    return linear(jax.nn.silu(gate) * up, p["down_proj"], plan)


def _mlp_stacks(p):
    """((gate, up, down) QTensor stacks, their layer index) where the MLP's weights are
    `Stacked` views (the scans with block_loop "views"), else None."""
    from engine.kernels.stacked import Stacked

    ws = [p["gate_proj"], p["up_proj"], p["down_proj"]]
    if not all(isinstance(w, Stacked) for w in ws):
        return None
    return tuple(w.w for w in ws), ws[0].index


def mlp_residual(p, x, h, plan: KernelPlan = REFERENCE, corr=None):
    """h + mlp(p, x). With the plan's mlp "cuda" and a decode step's rows (M <= 4 bf16,
    int4_g64 layer views of stacks): the MLP's two GEMVs, the SwiGLU and the residual in one
    call of `cuda_ops.int4_mlp` (two launches chained by programmatic dependent launch).
    corr: x's group sums where the norm before gave them (`norm_in`)."""
    if plan.mlp == "cuda":
        from engine.kernels import cuda_ops

        if (st := _mlp_stacks(p)) and cuda_ops.mlp_shape_error(x, h, *st[0]) is None:
            return cuda_ops.int4_mlp(x, h, *st[0], st[1], corr=corr)
    return h + mlp(p, x, plan, corr)


class StackedStates(NamedTuple):
    """Every GDN layer's states as the cache stacks them (conv [*L, B, conv_dim, W - 1], rec
    [*L, B, Hv, Dk, Dv]), the flat int32 index of the layer at hand, and the parameters the
    fused decode kernel reads (`gdn_decode_fused.KERNEL_PARAMS`, stacked [*L, ...] like the
    states). Passed as a layer's conv_state (rec_state None) on the in-place decode path
    (the plan's gdn_decode "fused"): the fused decode kernel reads the layer's states and
    parameters in place and writes its recurrent state back in place, so the scans carry the
    stacks and slice or copy no state. conv_out (the plan's gdn_conv_write "swap"): a second
    stack the kernel writes each layer's new conv state into, in place, while
    `conv` is only read; the caller takes conv_out as the step's new conv stack."""
    conv: jax.Array
    rec: jax.Array
    layer: jax.Array
    params: dict
    conv_out: jax.Array | None = None  # gdn_conv_write "swap": the stack written


def gdn_mixer(p, cfg: ModelConfig, x, conv_state, rec_state, lengths, valid, mode: str,
              plan: KernelPlan = REFERENCE, corr=None):
    """Gated DeltaNet token mixer. p: the layer's `linear_attn` params; x: [B, T, H] (normed).

    conv_state: [B, conv_dim, W-1]; rec_state: [B, Hv, Dk, Dv] fp32; lengths: [B] int32 valid
    steps per row; valid: [B, T] bool. Invalid steps get g = 0, beta = 0 so the recurrent state
    skips them. plan: the KernelPlan. corr: x's group sums for the projections' GEMV, or
    None.
    Returns (out [B, T, H], conv_state, rec_state).
    """
    b, t, _ = x.shape
    mats = [p["in_proj_qkv"], p["in_proj_z"], p["in_proj_b"], p["in_proj_a"]]
    if isinstance(conv_state, StackedStates):
        from engine.kernels.gdn_decode_fused import gdn_decode_fused_rows

        st = conv_state
        # the four projections side by side, as the one GEMV launch writes them
        proj = linear_multi(x, mats, plan, concat=True, corr=corr)
        out, conv_l, rec, out_sums = gdn_decode_fused_rows(
            st.params, cfg, proj, st.conv, st.rec, st.layer, lengths, x.dtype,
            sums=norm_fused(x, plan), conv_out=st.conv_out)
        y = linear(out.reshape(b, t, -1), p["out_proj"], plan, out_sums)
        if st.conv_out is not None:  # written in place into the step's second stack
            return y, st._replace(conv_out=conv_l, rec=rec), None
        lead = st.conv.shape[:-3]
        # a plain dynamic update (the index is always in range): `.at[].set` drops an
        # out-of-range index, which costs a bounds-check kernel a layer on the GPU (in the HLO)
        conv = jax.lax.dynamic_update_index_in_dim(
            st.conv.reshape(-1, *st.conv.shape[-3:]), conv_l, st.layer, 0).reshape(
                *lead, *st.conv.shape[-3:])
        return y, st._replace(conv=conv, rec=rec), None
    qkv, z, b_in, a_in = linear_multi(x, mats, plan, corr=corr)
    rule = select_rule(mode, plan, t)
    out, conv_state, rec_state = gdn_core(p, cfg, qkv, z, b_in, a_in, conv_state, rec_state,
                                          lengths, valid, rule, x.dtype)
    return linear(out.reshape(b, t, -1), p["out_proj"], plan), conv_state, rec_state


def norm_fused(x, plan: KernelPlan) -> bool:
    """Whether the decode step's norms go through the fused norm kernels
    (engine/kernels/norm_sums.py): the plan's norms "fused", and bf16 rows of a decode step
    (at most `norm_sums.MAX_ROWS`, T == 1). The group sums they give are what the CUDA GEMV
    takes; the Pallas GEMV makes its own."""
    from engine.kernels import norm_sums

    return (plan.norms == "fused" and x.dtype == jnp.bfloat16 and x.ndim == 3
            and x.shape[1] == 1 and x.shape[0] <= norm_sums.MAX_ROWS
            and x.shape[-1] % norm_sums.GROUP == 0)


def norm_in(x, w, eps: float, plan: KernelPlan, h=None):
    """(s, rms_norm(s, w), its group sums or None) with s = x + h or x: the pre-norm of a
    mixer or an MLP. With the fused norms (`norm_fused`) and w a layer view, one kernel
    computes all three (`norm_sums.rms_norm_sums`); otherwise the plain ops, and no sums (each
    GEMV makes its own)."""
    from engine.kernels import norm_sums
    from engine.kernels.stacked import Stacked, plain

    if isinstance(w, Stacked) and norm_fused(x, plan):
        return norm_sums.rms_norm_sums(x, w.w, eps, h, index=w.index)
    s = x if h is None else x + h
    return s, rms_norm(s, plain(w), eps), None


def gdn_layer(p, cfg: ModelConfig, x, conv_state, rec_state, lengths, valid, mode: str,
              plan: KernelPlan = REFERENCE):
    """One GDN decoder layer (pre-norm residual mixer + MLP). x: [B, T, H].
    Returns (x, conv_state, rec_state)."""
    eps = cfg.rms_norm_eps
    _, xn, corr = norm_in(x, p["input_layernorm"], eps, plan)
    h, conv_state, rec_state = gdn_mixer(p["linear_attn"], cfg, xn, conv_state, rec_state,
                                         lengths, valid, mode, plan, corr)
    x, xn, corr = norm_in(x, p["post_attention_layernorm"], eps, plan, h)
    x = mlp_residual(p["mlp"], xn, x, plan, corr)
    return x, conv_state, rec_state


def attention_layer(p, cfg: ModelConfig, x, kv, layer, positions, valid,
                    plan: KernelPlan = REFERENCE):
    """One gated-attention decoder layer. x: [B, T, H]; kv: the contiguous (k, v) of
    `attention.kv_write_attend` or a `paged_kv.PagedKV`; layer/positions/valid as there.
    Returns (x, kv) with kv of the same kind."""
    write_attend = paged_write_attend if isinstance(kv, PagedKV) else kv_write_attend
    eps = cfg.rms_norm_eps
    _, xn, corr = norm_in(x, p["input_layernorm"], eps, plan)
    h, kv = attention_mixer(p["self_attn"], cfg, xn, kv, layer, positions, valid, write_attend,
                            plan, corr)
    x, xn, corr = norm_in(x, p["post_attention_layernorm"], eps, plan, h)
    x = mlp_residual(p["mlp"], xn, x, plan, corr)
    return x, kv
