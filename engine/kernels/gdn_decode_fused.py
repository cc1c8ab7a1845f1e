"""A GDN layer's decode step between its input projections and out_proj, as one kernel.

On the H200 a decode step of the 27B model runs ~1,800 kernels, ~1,550 of them small XLA
fusions that together take ~3 ms of an 11 ms step (profiled). Each GDN layer spends about a
dozen of them on the work after its projections: the causal conv and its state shift, SiLU,
the q/k L2 norms, the gates, the recurrent step, the gated RMSNorm. Here all of it is one
Pallas call per layer: program (row, value head) reads its q/k (key head h // r) and v channels
with their conv windows, applies the conv, SiLU and norms in registers, steps its [Dk, Dv]
state once and writes the normed, gated output head.

Decode only (T == 1): the reference for any T is `engine.ops.gdn.gdn_core` with a reference
rule, which this matches (`gdn_decode_fused_ref`, with this kernel's signature, for the tests).
The conv state is not aliased: the r value-head programs of a key head all read its q/k window,
and the first of them writes the shifted one, so the new state goes to a fresh buffer (B x
conv_dim x (W - 1), a few hundred KB), or into a second stack of every layer's states at the
layer's index (`conv_out`: a plan's gdn_conv_write "swap"; copy or swap, the same bits). The
recurrent state is aliased: each program owns its head.

The kernel (`gdn_decode_fused_rows`) takes the layer's input projections as the one GEMV launch
writes them, side by side in one row, and its parameters and states as [L, ...] stacks read at
the layer's index, so the model's scan slices nothing for it (on the H200 the step went from
~1,950 to ~1,470 kernels).
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from engine.kernels import resolve_interpret, triton_params
from engine.ops.gdn import GDN_RULES, gdn_core
from engine.ops.norms import gated_rms_norm

if TYPE_CHECKING:
    from engine.model.config import ModelConfig


def gdn_decode_fused_ref(p, cfg: ModelConfig, qkv, z, b_in, a_in, conv_state, rec_state,
                         lengths, valid, mode: str, plan, out_dtype):
    """The reference: `ops.gdn.gdn_core` with the reference rule `mode` names; the arguments of
    `gdn_decode_fused` (plan is accepted for them: the reference takes no kernel)."""
    del plan
    return gdn_core(p, cfg, qkv, z, b_in, a_in, conv_state, rec_state, lengths, valid,
                    GDN_RULES[mode], out_dtype)


def _silu(x):
    return x / (1.0 + jnp.exp(-x))


def _kernel(idx_ref, len_ref, proj_ref, w_ref, cs_ref, alog_ref, dtb_ref, nw_ref, s_ref,
            *rest, r, dk, dv, key_dim, width, eps, scale, z_at, b_at, a_at, split, conv_out):
    if conv_out:  # the new conv state into the layer's slot of another stack (aliased)
        _, o_ref, cso_ref, so_ref = rest
    else:
        o_ref, cso_ref, so_ref = rest
    at = (idx_ref[0],)  # the layer's index in the stacks [L, ...] of states and parameters
    co = at if conv_out else ()
    b, h = pl.program_id(0), pl.program_id(1)
    # split > 1: program (b, h, c) owns columns [c dvs, (c + 1) dvs) of the head's state and
    # output (the other work of the head, a few hundred values, is done by each of them)
    c = pl.program_id(2) if split > 1 else 0
    dvs = dv // split
    valid = len_ref[b] > 0

    def conv(ch0, n):
        """SiLU(causal conv) of channels [ch0, ch0 + n) for this row, and a function that
        writes their shifted window (the new conv state)."""
        cols = pl.ds(ch0, n)
        x = proj_ref[b, cols].astype(jnp.float32)
        win = [cs_ref[(*at, b, cols, i)].astype(jnp.float32) for i in range(width - 1)]
        y = x * w_ref[(*at, cols, width - 1)].astype(jnp.float32)
        for i in range(width - 1):
            y = y + win[i] * w_ref[(*at, cols, i)].astype(jnp.float32)

        def write():
            shifted = win[1:] + [x]
            for i in range(width - 1):
                cso_ref[(*co, b, cols, i)] = jnp.where(valid, shifted[i], win[i]).astype(
                    cso_ref.dtype)
        return _silu(y), write

    hk = h // r
    q, write_q = conv(hk * dk, dk)
    k, write_k = conv(key_dim + hk * dk, dk)
    v, write_v = conv(2 * key_dim + h * dv + c * dvs, dvs)
    write_v()

    # the first value head of a key head (its first column block) writes the key head's window
    @pl.when(jnp.logical_and(h % r == 0, c == 0))
    def _():
        write_q()
        write_k()

    q = q * lax.rsqrt(jnp.sum(q * q) + 1e-6) * scale
    k = k * lax.rsqrt(jnp.sum(k * k) + 1e-6)
    beta = 1.0 / (1.0 + jnp.exp(-proj_ref[b, b_at + h].astype(jnp.float32)))
    a = proj_ref[b, a_at + h].astype(jnp.float32) + dtb_ref[(*at, h)].astype(jnp.float32)
    softplus = jnp.maximum(a, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(a)))
    g = -jnp.exp(alog_ref[(*at, h)].astype(jnp.float32)) * softplus
    g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)

    mine = (slice(None), pl.ds(c * dvs, dvs))
    state = s_ref[(*at, b, h, *mine)] * jnp.exp(g)                          # [Dk, dvs] fp32
    pred = jnp.sum(state * k[:, None], axis=0)                              # [dvs]
    state = state + k[:, None] * ((v - pred) * beta)[None, :]
    so_ref[(*at, b, h, *mine)] = state
    out = jnp.sum(state * q[:, None], axis=0)                               # [dvs]
    if split > 1:  # the output norm spans the head's Dv: the caller takes it (fp32 out)
        o_ref[b, pl.ds(h * dv + c * dvs, dvs)] = out
        return

    zc = pl.ds(h * dv, dv)
    out = out * lax.rsqrt(jnp.mean(out * out) + eps)
    z = proj_ref[b, pl.ds(z_at + h * dv, dv)].astype(jnp.float32)
    out = out * nw_ref[(*at, slice(None))].astype(jnp.float32) * _silu(z)
    o_ref[b, zc] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "plan", "out_dtype",
                                             "interpret", "num_warps", "split"))
def gdn_decode_fused(p, cfg: ModelConfig, qkv, z, b_in, a_in, conv_state, rec_state, lengths,
                     valid, mode: str, plan, out_dtype, *, interpret: bool | None = None,
                     num_warps: int = 8, split: int = 1):
    """`gdn_decode_fused_ref` (`engine.ops.gdn.gdn_core`) for T == 1 as one Pallas kernel; same
    arguments and result (mode/plan are accepted for the signature: one step is the recurrent
    rule either way).
    A program holds a whole [Dk, Dv] fp32 state (64 KB at the 27B heads): 8 warps keep it at
    64 values a thread. The one-layer case of `gdn_decode_fused_stacked`."""
    del mode, plan, valid  # T == 1: a row is valid iff its length is > 0
    out, conv_state, rec_state = gdn_decode_fused_stacked(
        p, cfg, qkv, z, b_in, a_in, conv_state[None], rec_state.astype(jnp.float32)[None],
        jnp.int32(0), lengths, out_dtype, interpret=interpret, num_warps=num_warps,
        split=split)
    return out, conv_state, rec_state[0]


# The layer parameters the kernel reads (p["conv1d"] [conv_dim, W], A_log/dt_bias [Hv], norm
# [Dv]); `gdn_decode_fused_rows` takes them stacked [*L, ...] like the states.
KERNEL_PARAMS = ("conv1d", "A_log", "dt_bias", "norm")


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "interpret", "num_warps",
                                             "split"))
def gdn_decode_fused_stacked(p, cfg: ModelConfig, qkv, z, b_in, a_in, conv_all, rec_all,
                             layer, lengths, out_dtype, *, interpret: bool | None = None,
                             num_warps: int = 8, split: int = 1):
    """`gdn_decode_fused` on the states of every GDN layer at once: conv_all [*L, B, conv_dim,
    W - 1] and rec_all [*L, B, Hv, Dk, Dv] fp32 (the cache's stacks), `layer` the int32 flat
    index of this layer among the L layers. The kernel reads this layer's states in place and
    writes the recurrent state back in place (the output aliases rec_all), so a scan that
    carries the stacks slices and copies no state. Returns (out [B, 1, Hv, Dv], this layer's
    new conv state [B, conv_dim, W - 1] (a fresh buffer: see the module docstring), rec_all
    updated)."""
    if qkv.shape[1] != 1:
        raise ValueError(f"gdn_decode_fused takes one step (T == 1), got T = {qkv.shape[1]}")
    proj = jnp.concatenate([qkv, z, b_in, a_in], axis=-1)
    # the kernel reads parameters and states at one index: one layer's parameters for each of
    # the state stacks' layers (a GPU read past a stack's end is not clamped)
    n = math.prod(rec_all.shape[:-4])
    params = {k: jnp.broadcast_to(p[k], (n, *p[k].shape)) for k in KERNEL_PARAMS}
    out, conv_state, rec_flat, _ = gdn_decode_fused_rows(
        params, cfg, proj, conv_all, rec_all, layer, lengths, out_dtype, interpret=interpret,
        num_warps=num_warps, split=split)
    return out, conv_state, rec_flat


# The in-place decode path's launch: each value head's state over 2 programs by its Dv columns
# (the gated output norm, which spans a head's Dv, in XLA after the kernel), 4 warps a program
# (a [Dk, Dv / 2] fp32 half-state is 64 values a thread). H200, 27B heads, one row (the
# kernel's own time a C1 step): 1 program of 8 warps (the
# default before) 398-400 us, 4 warps 307-310, 16 warps 417, 2 warps 2,825 (spills); split 2
# of 8 warps 261, of 4 warps 213; split 4 of 4 warps 207, of 2 warps 208; split 8 222-240.
# C1 1K decode: split 2 of 4 warps 133.0 / 131.3 tok/s against 127.4 / 125.4 for the old
# launch in the same process (the norm's XLA kernel a layer included).
DEFAULT_SPLIT = 2
DEFAULT_WARPS = 4


def gdn_decode_fused_rows(params, cfg: ModelConfig, proj, conv_all, rec_all, layer, lengths,
                          out_dtype, *, interpret: bool | None = None,
                          num_warps: int | None = None, split: int | None = None,
                          sums: bool = False, conv_out=None):
    """The kernel itself: proj [B, 1, conv_dim + Hv Dv + 2 Hv], the layer's input projections
    as one GEMV gives them (qkv, z, b, a side by side: no slices), `params` the KERNEL_PARAMS
    stacked [*L, ...] as the states are (the model's weight stacks), read at `layer` like the
    states, which are as `gdn_decode_fused_stacked` takes them. num_warps: DEFAULT_WARPS by
    default. split: DEFAULT_SPLIT by default; it must divide Dv. sums: also return the
    output's group sums for out_proj's GEMV, the gated norm (split > 1) and the sums then one
    kernel (`norm_sums.gated_norm_sums`); None where split is 1 or Dv is not a power of two
    times 64. conv_out: a stack shaped like conv_all that the new conv state is written into
    at `layer`, in place (aliased; a plan's gdn_conv_write "swap"): then the conv state returned is that
    stack, else this layer's new state alone. Returns (out, conv state, rec_all, sums or
    None)."""
    split = DEFAULT_SPLIT if split is None else int(split)
    dv = cfg.linear_value_head_dim
    sums = bool(sums) and split > 1 and dv % 64 == 0 and dv & (dv - 1) == 0
    if conv_out is not None and conv_out.shape != conv_all.shape:
        raise ValueError(f"conv_out {conv_out.shape} must be shaped as conv_all "
                         f"{conv_all.shape}")
    return _rows(params, cfg, proj, conv_all, rec_all, layer, lengths, out_dtype, conv_out,
                 interpret=resolve_interpret(interpret),
                 num_warps=DEFAULT_WARPS if num_warps is None else int(num_warps),
                 split=split, sums=sums)


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "interpret", "num_warps",
                                             "split", "sums"))
def _rows(params, cfg: ModelConfig, proj, conv_all, rec_all, layer, lengths, out_dtype,
          conv_out=None, *, interpret: bool, num_warps: int, split: int, sums: bool = False):
    bsz, t, width_in = proj.shape
    if t != 1:
        raise ValueError(f"gdn_decode_fused takes one step (T == 1), got T = {t}")
    n = math.prod(rec_all.shape[:-4])
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv_dim = cfg.conv_dim
    if width_in != conv_dim + hv * dv + 2 * hv:
        raise ValueError(f"proj has {width_in} columns, expected conv_dim + Hv Dv + 2 Hv = "
                         f"{conv_dim + hv * dv + 2 * hv}")
    if split < 1 or dv % split:
        raise ValueError(f"the state split ({split}) must divide Dv = {dv}")
    width = cfg.linear_conv_kernel
    kern = functools.partial(_kernel, r=hv // hk, dk=dk, dv=dv, key_dim=cfg.key_dim,
                             width=width, eps=cfg.rms_norm_eps, scale=dk ** -0.5,
                             z_at=conv_dim, b_at=conv_dim + hv * dv,
                             a_at=conv_dim + hv * dv + hv, split=split,
                             conv_out=conv_out is not None)
    conv_flat = conv_all.reshape(n, *conv_all.shape[-3:])
    rec_flat = rec_all.reshape(n, *rec_all.shape[-4:])
    flat = {k: params[k].reshape(-1, *params[k].shape[-(2 if k == "conv1d" else 1):])
            for k in KERNEL_PARAMS}
    ins = [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), lengths.astype(jnp.int32),
           proj[:, 0], flat["conv1d"], conv_flat, flat["A_log"], flat["dt_bias"], flat["norm"],
           rec_flat]
    conv_shape = conv_flat.shape[1:]
    aliases = {8: 2}
    if conv_out is not None:  # written in place at the layer: no copy into the stack after
        ins.append(conv_out.reshape(conv_flat.shape))
        conv_shape, aliases = conv_flat.shape, {8: 2, 9: 1}
    out, conv_state, rec_flat = pl.pallas_call(
        kern, grid=(bsz, hv) if split == 1 else (bsz, hv, split),
        out_shape=(jax.ShapeDtypeStruct((bsz, hv * dv), out_dtype if split == 1 else
                                        jnp.float32),
                   jax.ShapeDtypeStruct(conv_shape, conv_all.dtype),
                   jax.ShapeDtypeStruct(rec_flat.shape, jnp.float32)),
        input_output_aliases=aliases, interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, 1),
        name="gdn_decode_fused")(*ins)
    if conv_out is not None:
        conv_state = conv_state.reshape(conv_out.shape)
    out = out.reshape(bsz, 1, hv, dv)
    rec_flat = rec_flat.reshape(rec_all.shape)
    if sums:  # the gated norm and out_proj's group sums in one kernel
        from engine.kernels.norm_sums import gated_norm_sums

        out, out_sums = gated_norm_sums(out, proj, conv_dim, flat["norm"], cfg.rms_norm_eps,
                                        index=jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
                                        out_dtype=out_dtype, interpret=interpret)
        return out, conv_state, rec_flat, out_sums
    if split > 1:  # the gated output norm over each head's Dv, as the one-program kernel does
        z = proj[:, :, conv_dim:conv_dim + hv * dv].reshape(bsz, 1, hv, dv)
        norm_w = lax.dynamic_index_in_dim(flat["norm"], jnp.asarray(layer, jnp.int32),
                                          keepdims=False)
        out = gated_rms_norm(out, z, norm_w, cfg.rms_norm_eps).astype(out_dtype)
    return out, conv_state, rec_flat, None
