"""Weight-only int4_g64 GEMM for prefill pieces: y [M, N] = x [M, K] @ w.T, M from 9 to a few
thousand rows, reading the packed codes in place.

Without it a prefill piece dequantizes every int4 weight into a bf16 copy and then runs a bf16
matmul over that copy: ~2.5 bytes written and ~4.5 bytes moved per weight, whatever the width.
On the 27B that is ~30 ms a forward call (H200, a 64-token piece: 41 ms, of which 16 ms
dequantizing and 15 ms GEMMs over bf16 weights), so a short piece, such as the last few tokens
of an agent's new turn, costs five decode steps. This kernel reads the half byte a weight once
per M tile and never writes a copy.

Layout: x is split into its even and odd inputs [2, M, K/2], so that the packed bytes
[N, K/2] meet them in place (a byte's low nibble is input 2j, its high one 2j + 1). A loop step
takes `gb` groups of 64 inputs: the codes (made floats exactly) times their groups' scales,
rounded to x's dtype, go into two tensor-core dots of depth 32 gb, [bm, 32 gb] x [32 gb, bn].
Programs tile N by `bn`, M by `bm` and split K where that is needed to fill the GPU; XLA adds
the splits' fp32 partials.

The reference is `ops.quant.linear_ref` (dequantize to x's dtype, then an XLA matmul). Both round
code x scale to x's dtype; the results differ by the order of the fp32 sums. `takes` says
which calls it serves; the model's `linear` (engine/model/linear.py) sends int4 prefill
matmuls here on a GPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from engine.kernels import resolve_interpret, triton_params
# the GEMV's nibble-to-float constants, its dot and its K split
from engine.kernels.qgemv import _MAGIC, _MAGIC_OFF, _dot, _split
from engine.ops.quant import GROUP, INT4_G64, QTensor, linear_ref

MIN_ROWS = 9                 # fewer rows: the decode GEMV (qgemv / cuda_ops, M <= 8)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """bm / bn: x rows / output columns a program; gb: groups (64 inputs each) a loop step;
    programs: the least number of programs wanted (sets the K split)."""
    bm: int = 64
    bn: int = 128   # H200, M = 64: 128 columns 1.40x the reference on in_proj_qkv, 64 1.23x
    gb: int = 4
    programs: int = 264
    num_warps: int = 4
    num_stages: int = 3


DEFAULT = GemmConfig()


def takes(x, w, lead: int = 0, config: GemmConfig | None = None) -> bool:
    """Whether `int4_matmul` can run x [..., K] against w (an int4_g64 QTensor of rank
    lead + 2): M = prod(x.shape[:-1]) >= MIN_ROWS, and the tiles divide N and K (N = 48,
    GDN's in_proj_b / in_proj_a, is not a power-of-two tile: the reference takes it)."""
    if not (isinstance(w, QTensor) and w.fmt == INT4_G64 and jnp.ndim(w.data) == lead + 2):
        return False
    cfg = config or DEFAULT
    m = 1
    for d in x.shape[:-1]:
        m *= d
    n, k = w.shape[0], x.shape[-1]
    bn = min(cfg.bn, n)
    return (m >= MIN_ROWS and k == w.shape[1] and k % GROUP == 0 and n % bn == 0
            and bn >= 16 and bn & (bn - 1) == 0)  # Triton's tiles: powers of two


def _kernel(idx_ref, x_ref, w_ref, s_ref, o_ref, *, bm, bn, gb, iters, lead):
    """x [2, Mp, K/2] (x's even and odd inputs, x's dtype), w [*stack, N, K/2] uint8 (two
    codes a byte, +8 offset: the low nibble is input 2j, the high one 2j + 1), s [*stack, N, G]
    f32 -> o [split, Mp, N] f32. A loop step takes `gb` groups: the codes times their groups'
    scales, rounded to x's dtype (as the reference rounds each weight), in two dots of depth
    32 gb (low nibbles with the even inputs, high with the odd)."""
    i, mi, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, xrows = pl.ds(i * bn, bn), pl.ds(mi * bm, bm)
    at = tuple(idx_ref[d] for d in range(lead))
    half = gb * (GROUP // 2)

    def body(j, acc):
        g0 = (s * iters + j) * gb
        cols = pl.ds(pl.multiple_of(g0 * (GROUP // 2), half), half)
        w = w_ref[(*at, rows, cols)].astype(jnp.int32)                       # [bn, half]
        sc = s_ref[(*at, rows, pl.ds(g0, gb))]                               # [bn, gb]
        sc = jnp.broadcast_to(sc[:, :, None], (bn, gb, GROUP // 2)).reshape(bn, half)
        xe, xo = x_ref[0, xrows, cols], x_ref[1, xrows, cols]                # [bm, half]
        # nibble -> exact float without an int->float conversion: OR the code into the
        # mantissa of 2^23, subtract 2^23 + 8
        lo = lax.bitcast_convert_type((w & 15) | _MAGIC, jnp.float32) - _MAGIC_OFF
        hi = lax.bitcast_convert_type((w >> 4) | _MAGIC, jnp.float32) - _MAGIC_OFF
        return (acc + _dot(xe, (lo * sc).astype(xe.dtype))
                + _dot(xo, (hi * sc).astype(xo.dtype)))

    o_ref[s, xrows, rows] = lax.fori_loop(0, iters, body, jnp.zeros((bm, bn), jnp.float32))


def plan(m: int, n: int, k: int, cfg: GemmConfig) -> tuple[int, int, int, int, int]:
    """(bm, bn, gb, split, loop steps a program) for x [m, k] and w [n, k]: gb the largest
    power of two <= cfg.gb dividing the K / 64 groups."""
    bm = max(16, min(cfg.bm, 1 << (m - 1).bit_length()))  # a small M: one tile, >= 16 rows
    bn = min(cfg.bn, n)
    gb = 1
    while gb * 2 <= cfg.gb and (k // GROUP) % (gb * 2) == 0:
        gb *= 2
    steps = k // (GROUP * gb)
    tiles = (n // bn) * -(-m // bm)
    split = _split(steps, -(-cfg.programs // tiles))
    return bm, bn, gb, split, steps // split


def int4_matmul(x, w: QTensor, index=None, *, interpret: bool | None = None,
                config: GemmConfig | None = None):
    """x [..., K] @ w.T with w an int4_g64 QTensor [N, K], or with `index` (int32 [d]) a
    stack [*d dims, N, K] read at that layer in place. Returns [..., N] in x.dtype,
    accumulated in fp32. Shapes `takes` refuses go to the reference (`linear_ref`)."""
    config = config or DEFAULT
    nlead = 0 if index is None else int(index.shape[0])
    if not takes(x, w, nlead, config):
        if index is not None:
            from engine.kernels.stacked import Stacked

            w = Stacked(w, index).materialize()
        return linear_ref(x, w)
    return _int4_matmul(x, w, jnp.zeros((1,), jnp.int32) if index is None
                        else jnp.asarray(index, jnp.int32),
                        interpret=resolve_interpret(interpret), config=config, lead=nlead)


@functools.partial(jax.jit, static_argnames=("interpret", "config", "lead"))
def _int4_matmul(x, w, idx, *, interpret: bool, config: GemmConfig, lead: int):
    shape, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    xf = x.reshape(-1, k)
    m = xf.shape[0]
    bm, bn, gb, split, iters = plan(m, n, k, config)
    mp = -(-m // bm) * bm
    cdt = x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
    xs = xf.astype(cdt).reshape(m, k // 2, 2).transpose(2, 0, 1)            # [2, M, K/2]
    if mp != m:
        xs = jnp.pad(xs, ((0, 0), (0, mp - m), (0, 0)))
    data = w.data
    kern = functools.partial(_kernel, bm=bm, bn=bn, gb=gb, iters=iters, lead=lead)
    parts = pl.pallas_call(
        kern, grid=(n // bn, mp // bm, split),
        out_shape=jax.ShapeDtypeStruct((split, mp, n), jnp.float32), interpret=interpret,
        compiler_params=None if interpret else triton_params(config.num_warps,
                                                             config.num_stages),
        name="qgemm_int4")(idx, xs, data, w.scale)
    out = parts[0] if split == 1 else parts.sum(axis=0)
    return out[:m].astype(x.dtype).reshape(*shape, n)
