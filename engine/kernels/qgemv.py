"""Weight-only GEMV for decode: y [M, N] = x [M, K] @ w.T for a few rows M (decode batch).

Decode reads every weight once per step, so the step time is the weight bytes over the memory
bandwidth: the kernel streams the stored format (int4 nibbles, int8/fp8 codes, or bf16) and
dequantizes in registers, never writing a dequantized copy. Each program owns `bn` output rows
and one of `split` slices of the input dim; the `split` partial sums (fp32) are added by XLA
afterwards. Splitting K gives enough programs to keep ~130 SMs' memory pipes busy even for
N = 5120.

int4_g64: the packed bytes [N, K/2] are viewed as [N, K/64, 32] (one group of 64 inputs = 32
bytes, no copy) and x as its even/odd inputs [M, 2, K/64, 32], so a tile [bn, gb, 32] holds gb
whole groups: low nibbles meet even inputs, high nibbles odd ones, and the group scale multiplies
each group's partial sum once.

With `cuda=True` (a plan's gemv "cuda"), int4_g64 weights go to the CUDA op of
engine/kernels/cuda_ops.py (same signature and result, one logic op per code where this kernel
is instruction-bound) where their shapes fit it.

`qmatmul(x, w)` has `ops.quant.linear_ref`'s signature and result (fp32 accumulation, output
in x.dtype); `qmatmul_ref` is `linear_ref` itself. Shapes the kernel cannot tile, and
M > MAX_ROWS (prefill: compute-bound, better served by a dequantize + matmul), fall back to the
reference.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from engine.kernels import resolve_interpret, triton_params
from engine.ops.quant import FP8_ROW, GROUP, INT4_G64, INT8_ROW, QTensor, linear_ref

MAX_ROWS = 8
_MAGIC = 0x4B000000          # the bits of 2.0 ** 23 in fp32
_MAGIC_OFF = 8388608.0 + 8   # 2^23 + the int4 offset
_DOT_ROWS = 16               # the dot variants pad x to Triton's minimum dot M


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Tile parameters (the bench sweeps them). bn: output rows per program; bk: inputs per loop
    step (int4: bk/64 groups); programs: target number of programs (sets the K split)."""
    bn: int = 16
    bk: int = 512
    programs: int = 2048
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False


DEFAULT = GemvConfig()
# Measured on the H200 (bench/kernels_micro.py, docs/benchmarks/): the best variant per format.
# dense: fp32 FMAs for one row, tensor-core dots from two rows on; int8/fp8: dots.
_BEST = {
    ("dense", 1): GemvConfig(bn=16, bk=256, programs=2048, num_warps=4, num_stages=4),
    ("dense", 2): GemvConfig(dot=True, bn=64, bk=256, programs=1024, num_stages=4),
    ("row8", 1): GemvConfig(dot=True, bn=64, bk=256, programs=1024, num_stages=4),
    ("int4", 1): GemvConfig(),
}


def default_config(w, rows: int) -> GemvConfig:
    """The tuned config for weight `w` (dense or QTensor) and `rows` rows of x."""
    fmt = "dense" if not isinstance(w, QTensor) else "int4" if w.fmt == INT4_G64 else "row8"
    return _BEST.get((fmt, min(rows, 2)), _BEST.get((fmt, 1), DEFAULT))


def qmatmul_ref(x, w, **_):
    """The reference: `ops.quant.linear_ref` (dequantize, then an XLA matmul)."""
    return linear_ref(x, w)


def _pow2_divisor(n: int, target: int) -> int:
    """Largest power of two <= target that divides n (1 at worst)."""
    d = 1
    while d * 2 <= target and n % (d * 2) == 0:
        d *= 2
    return d


def _split(steps: int, want: int) -> int:
    """The divisor of `steps` closest to `want` (from below if possible)."""
    best = 1
    for d in range(1, steps + 1):
        if steps % d == 0 and d <= max(want, 1):
            best = d
    return best


def _plan(n: int, k_units: int, unit: int, cfg: GemvConfig):
    """(bn, units per step, split, steps per program) for N = n and K = k_units * unit."""
    bn = _pow2_divisor(n, cfg.bn)
    per = _pow2_divisor(k_units, max(cfg.bk // unit, 1))
    steps = k_units // per
    split = _split(steps, -(-cfg.programs // (n // bn)))
    return bn, per, split, steps // split


def _row_kernel(idx_ref, x_ref, w_ref, s_ref, o_ref, *, m, bn, bk, iters, scaled, lead):
    """w [*stack, N, K] (int8/fp8/bf16/f32), x [M, K] f32, s [*stack, N] f32 ->
    o [split, M, N] f32; idx_ref holds the `lead` stack indices of the layer to read."""
    i, s = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * bn, bn)
    at = tuple(idx_ref[d] for d in range(lead))

    def body(j, accs):
        k0 = pl.multiple_of((s * iters + j) * bk, bk)
        w = w_ref[(*at, rows, pl.ds(k0, bk))].astype(jnp.float32)    # [bn, bk]
        # Elementwise accumulation: one reduction at the end instead of one per step.
        return tuple(acc + w * x_ref[r, pl.ds(k0, bk)][None, :] for r, acc in enumerate(accs))

    accs = lax.fori_loop(0, iters, body,
                         tuple(jnp.zeros((bn, bk), jnp.float32) for _ in range(m)))
    scale = s_ref[(*at, rows)] if scaled else None
    for r in range(m):
        y = jnp.sum(accs[r], axis=1)
        o_ref[s, r, rows] = y * scale if scaled else y


def _int4_kernel(idx_ref, x_ref, w_ref, s_ref, o_ref, *, m, bn, gb, iters, lead):
    """w [*stack, N, G, 32] uint8 (two codes a byte, +8 offset), x [M, 2, G, 32] f32 (even /
    odd inputs of each group), s [*stack, N, G] f32 -> o [split, M, N] f32."""
    i, s = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * bn, bn)
    at = tuple(idx_ref[d] for d in range(lead))

    def body(j, accs):
        g0 = pl.multiple_of((s * iters + j) * gb, gb)
        groups = pl.ds(g0, gb)
        w = w_ref[(*at, rows, groups, slice(None))].astype(jnp.int32)  # [bn, gb, 32]
        # Nibble -> fp32 without an int->float conversion (a slow unit on the GPU): OR the
        # code into the mantissa of 2^23, then subtract 2^23 + 8 (exact).
        lo = lax.bitcast_convert_type((w & 15) | _MAGIC, jnp.float32) - _MAGIC_OFF
        hi = lax.bitcast_convert_type((w >> 4) | _MAGIC, jnp.float32) - _MAGIC_OFF
        scale = s_ref[(*at, rows, groups)][:, :, None]                # [bn, gb, 1]
        out = []
        for r, acc in enumerate(accs):
            xe = x_ref[r, 0, groups, :][None]                        # [1, gb, 32]
            xo = x_ref[r, 1, groups, :][None]
            out.append(acc + (lo * xe + hi * xo) * scale)             # reduced once, at the end
        return tuple(out)

    accs = lax.fori_loop(0, iters, body,
                         tuple(jnp.zeros((bn, gb, GROUP // 2), jnp.float32) for _ in range(m)))
    for r in range(m):
        o_ref[s, r, rows] = jnp.sum(jnp.sum(accs[r], axis=2), axis=1)


def _dot(a, b):
    """a [m, k] . b [n, k]^T -> [m, n] fp32 (a tensor-core dot; Triton takes m >= 16)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _row_dot_kernel(idx_ref, x_ref, w_ref, s_ref, o_ref, *, bn, bk, iters, scaled, lead):
    """Tensor-core variant of `_row_kernel`: x [16, K] in the compute dtype (rows >= M zero),
    w tiles converted to it (int8 and fp8 codes are exact in bf16) -> o [split, 16, N]."""
    i, s = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * bn, bn)
    at = tuple(idx_ref[d] for d in range(lead))

    def body(j, acc):
        k0 = pl.multiple_of((s * iters + j) * bk, bk)
        x = x_ref[:, pl.ds(k0, bk)]                                   # [16, bk]
        w = w_ref[(*at, rows, pl.ds(k0, bk))].astype(x.dtype)        # [bn, bk]
        return acc + _dot(x, w)

    acc = lax.fori_loop(0, iters, body, jnp.zeros((_DOT_ROWS, bn), jnp.float32))
    o_ref[s, :, rows] = acc * s_ref[(*at, rows)][None, :] if scaled else acc


def _int4_dot_kernel(idx_ref, x_ref, w_ref, s_ref, o_ref, *, bn, gb, iters, lead):
    """Tensor-core variant of `_int4_kernel`: per group, two [16, 32] x [32, bn] dots (low
    nibbles with the even inputs, high with the odd), scaled by the group's scales.
    x [16, 2, G, 32] in the compute dtype (rows >= M zero) -> o [split, 16, N]."""
    i, s = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * bn, bn)
    at = tuple(idx_ref[d] for d in range(lead))

    def body(j, acc):
        g0 = (s * iters + j) * gb
        for gi in range(gb):
            g = g0 + gi
            w = w_ref[(*at, rows, g, slice(None))].astype(jnp.int32)      # [bn, 32]
            xe, xo = x_ref[:, 0, g, :], x_ref[:, 1, g, :]                 # [16, 32]
            lo = (lax.bitcast_convert_type((w & 15) | _MAGIC, jnp.float32) - _MAGIC_OFF)
            hi = (lax.bitcast_convert_type((w >> 4) | _MAGIC, jnp.float32) - _MAGIC_OFF)
            part = _dot(xe, lo.astype(xe.dtype)) + _dot(xo, hi.astype(xo.dtype))
            acc = acc + part * s_ref[(*at, rows, g)][None, :]
        return acc

    o_ref[s, :, rows] = lax.fori_loop(0, iters, body, jnp.zeros((_DOT_ROWS, bn), jnp.float32))


def supported(x, w, lead: int = 0) -> bool:
    """Whether `qmatmul` runs the kernel for this x and w with `lead` stack dims (else it
    calls the reference)."""
    m = 1
    for d in x.shape[:-1]:
        m *= d
    if m > MAX_ROWS or m == 0:
        return False
    if isinstance(w, QTensor):
        return w.fmt in (INT4_G64, INT8_ROW, FP8_ROW) and jnp.ndim(w.data) == lead + 2
    return jnp.ndim(w) == lead + 2


@functools.partial(jax.jit, static_argnames=("interpret", "config", "cuda"))
def qmatmul(x, w, index=None, *, interpret: bool | None = None,
            config: GemvConfig | None = None, corr=None, cuda: bool = False):
    """x: [..., K] (M = prod of the leading dims <= MAX_ROWS); w: [N, K] dense array or QTensor,
    or with `index` (int32 [d]) a stack [*d dims, N, K] read at that layer in place.
    Returns [..., N] in x.dtype, accumulated in fp32. Same result as `linear_ref` up to the
    order of the fp32 sums (and bf16 rounding of the weights, which the reference does and the
    kernel does not). cuda: int4_g64 weights through the CUDA op where it takes the shapes
    (`cuda_ops.takes`). corr: x's group sums for the CUDA op (`cuda_ops.int4_gemv_multi`);
    ignored elsewhere."""
    nlead = 0 if index is None else int(index.shape[0])
    if cuda and config is None and isinstance(w, QTensor) and w.fmt == INT4_G64:
        from engine.kernels import cuda_ops

        if cuda_ops.takes(x, [w], nlead):
            return cuda_ops.int4_gemv(x, w, index, corr=corr)
    if not supported(x, w, nlead):
        if index is not None:
            from engine.kernels.stacked import Stacked

            w = Stacked(w, index).materialize()
        return linear_ref(x, w)
    idx = jnp.zeros((1,), jnp.int32) if index is None else jnp.asarray(index, jnp.int32)
    interpret = resolve_interpret(interpret)
    lead, k = x.shape[:-1], x.shape[-1]
    xf = x.reshape(-1, k).astype(jnp.float32)
    m = xf.shape[0]
    config = default_config(w, m) if config is None else config
    params = dict(interpret=interpret,
                  compiler_params=None if interpret else triton_params(config.num_warps,
                                                                       config.num_stages))
    rows_out = _DOT_ROWS if config.dot else m
    cdt = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    if isinstance(w, QTensor) and w.fmt == INT4_G64:
        n = w.shape[0]
        g = k // GROUP
        bn, gb, split, iters = _plan(n, g, GROUP, config)
        data = w.data.reshape(*w.data.shape[:-1], g, GROUP // 2)
        xs = xf.reshape(m, g, GROUP // 2, 2).transpose(0, 3, 1, 2)      # [M, 2, G, 32]
        if config.dot:
            xs = jnp.pad(xs.astype(cdt), ((0, _DOT_ROWS - m), (0, 0), (0, 0), (0, 0)))
            kern = functools.partial(_int4_dot_kernel, bn=bn, gb=gb, iters=iters, lead=nlead)
        else:
            kern = functools.partial(_int4_kernel, m=m, bn=bn, gb=gb, iters=iters, lead=nlead)
        parts = pl.pallas_call(kern, grid=(n // bn, split),
                               out_shape=jax.ShapeDtypeStruct((split, rows_out, n),
                                                              jnp.float32),
                               name="qgemv_int4", **params)(idx, xs, data, w.scale)
    else:
        data = w.data if isinstance(w, QTensor) else w
        scale = w.scale if isinstance(w, QTensor) else jnp.ones((1,), jnp.float32)
        n = data.shape[-2]
        bn, bk, split, iters = _plan(n, k, 1, config)
        if config.dot:
            xs = jnp.pad(xf.astype(cdt), ((0, _DOT_ROWS - m), (0, 0)))
            kern = functools.partial(_row_dot_kernel, bn=bn, bk=bk, iters=iters,
                                     scaled=isinstance(w, QTensor), lead=nlead)
        else:
            xs = xf
            kern = functools.partial(_row_kernel, m=m, bn=bn, bk=bk, iters=iters,
                                     scaled=isinstance(w, QTensor), lead=nlead)
        parts = pl.pallas_call(kern, grid=(n // bn, split),
                               out_shape=jax.ShapeDtypeStruct((split, rows_out, n),
                                                              jnp.float32),
                               name="qgemv_row", **params)(idx, xs, data, scale)
    parts = parts[:, :m]
    return parts.sum(axis=0).astype(x.dtype).reshape(*lead, n)
