"""A decode step's RMSNorms fused with what the int4 GEMV after them needs, one kernel a norm.

Every int4 GEMV of a decode step takes x with its group sums (`cuda_ops.group_sums`: the sum
of each 64 inputs, which the wide kernel multiplies by the codes' +8 offset). Before each
GEMV the model normalizes x, and before the MLP it also adds the mixer's output to the
residual stream. XLA fuses all of that into one kernel for one row, but for two rows it
emits the norm as a Triton fusion and the group sums, the residual add and the slice of the
layer's norm weight out of its stack as separate kernels: ~8 small kernels a GDN layer where
one row has 3 (on the H200 a C2 step spent 0.44 ms longer in XLA's small kernels than a C1
step).
Here each norm is one Pallas (Triton) call for any number of rows, which reads its weight
from the layer stack at the layer's index and writes:

  `rms_norm_sums`   s = x (+ h), rms_norm(s, w) and its group sums     (`rms_norm_sums_ref`)
  `gated_norm_sums` the GDN output's gated norm per head and its group sums
                    (`gated_norm_sums_ref`)

A program owns a tile of one row, [G, 64] (G groups of 64 inputs; for the gated norm G heads
of Dv): each of a row's programs reads the whole row for its sum of squares (a few KB from
L2) and writes its own tile, so a row's norm is spread over several SMs. The sums add in a
fixed order that does not depend on the other rows (batch invariant); the results match the
references up to the order of fp32 sums.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from engine.kernels import resolve_interpret, triton_params
from engine.kernels.cuda_ops import group_sums
from engine.ops.norms import gated_rms_norm, rms_norm
from engine.ops.quant import GROUP

MAX_ROWS = 4  # a decode step's rows (the wide GEMV's limit)


# Groups (rms) or heads (gated) a program (powers of two; the kernel tests and
# bench/norm_micro.py pass others).
TILES = {"rms": 4, "gated": 4}


def tile_setting(kind: str) -> int:
    return TILES[kind]


def _tile(groups: int, most: int = 16) -> int:
    """Groups a tile: the largest power of two <= most that divides `groups`."""
    g = 1
    while 2 * g <= most and groups % (2 * g) == 0:
        g *= 2
    return g


# ---- references ---------------------------------------------------------------------------

def rms_norm_sums_ref(x, w, eps: float, h=None):
    """(s, rms_norm(s, w), group sums of it), s = x + h (in x's dtype) or x."""
    s = x if h is None else x + h
    y = rms_norm(s, w, eps)
    return s, y, group_sums(y)


def gated_norm_sums_ref(out, z, w, eps: float, out_dtype=jnp.bfloat16):
    """out, z [..., Hv, Dv]; w [Dv]: (gated_rms_norm(out, z, w) in out_dtype, its group sums
    [..., Hv Dv / 64] over the heads side by side)."""
    y = gated_rms_norm(out, z, w, eps).astype(out_dtype)
    flat = y.reshape(*y.shape[:-2], -1)
    return y, group_sums(flat)


# ---- kernels ------------------------------------------------------------------------------

def _rms_kernel(idx_ref, x_ref, *rest, tiles, g, k, eps, add):
    # program (b, t): the sum of squares over all of row b (its tiles loaded at once, squared
    # and added elementwise, then one reduction), then tile t normalized, written and summed
    # by group; every program of a row computes the same sum in the same order
    if add:
        h_ref, w_ref, s_ref, y_ref, c_ref = rest
    else:
        w_ref, y_ref, c_ref = rest
    b, mine = pl.program_id(0), pl.program_id(1)
    at = idx_ref[0]

    def tile(t):
        v = x_ref[b, pl.ds(t * g, g), :]
        if add:
            v = (v.astype(jnp.float32) + h_ref[b, pl.ds(t * g, g), :].astype(jnp.float32)
                 ).astype(x_ref.dtype)
        return v.astype(jnp.float32)

    vs = [tile(t) for t in range(tiles)]
    sq = vs[0] * vs[0]
    for v in vs[1:]:
        sq = sq + v * v
    r = lax.rsqrt(jnp.sum(sq) / k + eps)
    v = tile(mine)
    if add:
        s_ref[b, pl.ds(mine * g, g), :] = v.astype(s_ref.dtype)
    wt = 1.0 + w_ref[at, pl.ds(mine * g, g), :].astype(jnp.float32)
    y = (v * r * wt).astype(y_ref.dtype)
    y_ref[b, pl.ds(mine * g, g), :] = y
    c_ref[b, pl.ds(mine * g, g)] = jnp.sum(y.astype(jnp.float32), axis=1)


def _gated_kernel(idx_ref, o_ref, p_ref, w_ref, y_ref, c_ref, *, g, dv, z_at, eps):
    # program (b, t): heads [t g, (t + 1) g) of row b (g Dv contiguous values, and of z)
    b, t = pl.program_id(0), pl.program_id(1)
    at = idx_ref[0]
    wt = w_ref[at, :].astype(jnp.float32)[None, :]
    n = g * dv
    v = o_ref[b, pl.ds(t * n, n)].astype(jnp.float32).reshape(g, dv)
    z = p_ref[b, pl.ds(z_at + t * n, n)].astype(jnp.float32).reshape(g, dv)
    r = lax.rsqrt(jnp.sum(v * v, axis=1) / dv + eps)[:, None]
    y = (v * r * wt * (z / (1.0 + jnp.exp(-z)))).astype(y_ref.dtype)
    y_ref[b, pl.ds(t * n, n)] = y.reshape(n)
    c_ref[b, pl.ds(t * (n // GROUP), n // GROUP)] = jnp.sum(
        y.astype(jnp.float32).reshape(n // GROUP, GROUP), axis=1)


def _stack(w, index):
    """(w as [L, ...], int32 [1] index) from a [...] weight or a [*d, ...] stack at index."""
    if index is None:
        return w[None], jnp.zeros((1,), jnp.int32)
    index = jnp.asarray(index, jnp.int32).reshape(-1)
    lead = int(index.shape[0])
    dims = w.shape[:lead]
    flat = index[0]
    for d in range(1, lead):
        flat = flat * dims[d] + index[d]
    return w.reshape(-1, *w.shape[lead:]), flat.reshape(1)


def rms_norm_sums(x, w, eps: float, h=None, index=None, *, interpret: bool | None = None,
                  num_warps: int = 4):
    """`rms_norm_sums_ref` as one kernel. x (and h) [..., K] with K a multiple of 64; w [K],
    or a stack [*d, K] read at `index` (int32 [d]) in place. Returns (s, y, sums)."""
    if index is None and w.ndim != 1:
        raise ValueError(f"rms_norm_sums: w must be [K] without an index, got {w.shape}")
    ws, idx = _stack(w, index)
    return _rms(x, h, ws, idx, eps=float(eps), interpret=resolve_interpret(interpret),
                num_warps=num_warps, most=tile_setting("rms"))


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps", "most"))
def _rms(x, h, ws, idx, *, eps, interpret, num_warps, most=16):
    lead, k = x.shape[:-1], x.shape[-1]
    if k % GROUP:
        raise ValueError(f"rms_norm_sums: K = {k} is not a multiple of {GROUP}")
    if ws.shape[-1] != k or (h is not None and h.shape != x.shape):
        raise ValueError(f"rms_norm_sums: x {x.shape}, h {None if h is None else h.shape}, "
                         f"w {ws.shape[1:]} do not match")
    m, groups = 1, k // GROUP
    for d in lead:
        m *= d
    g = _tile(groups, most)
    add = h is not None
    x3 = x.reshape(m, groups, GROUP)
    ins = [idx, x3] + ([h.reshape(m, groups, GROUP).astype(x.dtype)] if add else [])
    ins.append(ws.reshape(ws.shape[0], groups, GROUP))
    shapes = ([jax.ShapeDtypeStruct(x3.shape, x.dtype)] if add else []) + [
        jax.ShapeDtypeStruct(x3.shape, x.dtype), jax.ShapeDtypeStruct((m, groups), jnp.float32)]
    outs = pl.pallas_call(
        functools.partial(_rms_kernel, tiles=groups // g, g=g, k=k, eps=eps, add=add),
        grid=(m, groups // g), out_shape=tuple(shapes), interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, 1),
        name="rms_norm_sums")(*ins)
    y, sums = outs[-2].reshape(x.shape), outs[-1].reshape(*lead, groups)
    s = outs[0].reshape(x.shape) if add else x
    return s, y, sums


def gated_norm_sums(out, proj, z_at: int, w, eps: float, index=None, *,
                    out_dtype=jnp.bfloat16, interpret: bool | None = None,
                    num_warps: int = 4):
    """`gated_norm_sums_ref` as one kernel, with z read from the layer's projections as the
    GEMV writes them: out [B, 1, Hv, Dv] (fp32, the fused GDN kernel's), proj [B, 1, P] with
    z at columns [z_at, z_at + Hv Dv); w [Dv] or a stack [*d, Dv] at `index`. Dv a multiple of
    64. Returns (y [B, 1, Hv, Dv] out_dtype, sums [B, 1, Hv Dv / 64])."""
    ws, idx = _stack(w, index)
    return _gated(out, proj, ws, idx, z_at=int(z_at), eps=float(eps), out_dtype=out_dtype,
                  interpret=resolve_interpret(interpret), num_warps=num_warps,
                  most=tile_setting("gated"))


@functools.partial(jax.jit, static_argnames=("z_at", "eps", "out_dtype", "interpret",
                                             "num_warps", "most"))
def _gated(out, proj, ws, idx, *, z_at, eps, out_dtype, interpret, num_warps, most=16):
    *lead, hv, dv = out.shape
    if dv % GROUP or ws.shape[-1] != dv:
        raise ValueError(f"gated_norm_sums: Dv = {dv} must be a multiple of {GROUP} and match "
                         f"w {ws.shape[1:]}")
    if proj.shape[-1] < z_at + hv * dv:
        raise ValueError(f"gated_norm_sums: z at {z_at} ({hv} x {dv}) must fit in proj's "
                         f"{proj.shape[-1]} columns")
    m = 1
    for d in lead:
        m *= d
    g = _tile(hv, most) if dv & (dv - 1) == 0 else 1
    y, sums = pl.pallas_call(
        functools.partial(_gated_kernel, g=g, dv=dv, z_at=z_at, eps=eps),
        grid=(m, hv // g), out_shape=(jax.ShapeDtypeStruct((m, hv * dv), out_dtype),
                              jax.ShapeDtypeStruct((m, hv * dv // GROUP), jnp.float32)),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, 1),
        name="gated_norm_sums")(idx, out.reshape(m, hv * dv), proj.reshape(m, -1), ws)
    return y.reshape(out.shape), sums.reshape(*lead, hv * dv // GROUP)
