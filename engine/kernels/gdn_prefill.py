"""Chunked (WY/UT) gated delta rule with the fp32 state in and out: the GDN prefill kernel.

The chunked form of `gdn.chunk_gated_delta_rule` (REFERENCE section 2), in three steps:
1. XLA prepares every term that does not depend on the state, for all chunks at once
   (`gdn.chunk_intra`, batched matmuls): the UT transform u = T diag(beta) V,
   w = T diag(beta e^gamma) K with T = (I + A)^-1, A = strict_lower(diag(beta)(K K^T o Gamma)),
   q decayed from its chunk's start, k decayed to its chunk's end, the causal decayed q k^T
   and each chunk's decay. Products of q and k alone are taken once a key head.
2. The inverse's diagonal 16 x 16 blocks come from one Pallas launch a layer
   (engine/kernels/gdn_inverse.py) instead of XLA's 16 substitution steps of small kernels
   (a 27B prefill of 8K tokens on the H200: 0.761 s against 0.767 s); XLA merges the blocks
   into the chunk's inverse.
3. `_lean_scan_kernel`, grid (row, value head, V / bv): walks the chunks in order with a
   [K, bv] slice of the state in registers (columns of S evolve independently given u and w),
   so one head's scan is spread over V / bv programs. Per chunk four dots with the state:
   V_new = u - w S; O = q_in S + qk V_new; S <- e^{gamma_C} S + k_out^T V_new.
On the H200 (a 27B prefill of 8K tokens, before the inverse kernel) this split was the
fastest: 0.772 s, against 0.839 s with XLA's UT transform alone feeding a scan kernel that
built the other chunk terms itself, slower still with the UT transform in a Pallas kernel too
(forward substitution over the chunk's rows in registers), and 0.981 s with the reference's
scan in XLA.

Dots: fp32 inputs use IEEE fp32 dots (Triton's default for fp32 is TF32, ~1e-3 off) and fp32
products in XLA; any bf16 input makes the dots bf16 x bf16 -> fp32, as flash_prefill does, and
XLA's large products take bf16 operands with fp32 sums. The state, the inverse and the decays
stay fp32 either way. T is padded with identity steps (g = 0, beta = 0) to a whole number of
chunks; a sequence shorter than the chunk uses the next power of two >= 16 (the smallest
Triton dot), so the final state is exact.

`gdn_chunk` has `gdn.chunk_gated_delta_rule`'s signature and result.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from engine.kernels import resolve_interpret, triton_params
from engine.kernels.gdn_inverse import diag_inverse
from engine.ops.gdn import chunk_gated_delta_rule, chunk_intra

gdn_chunk_ref = chunk_gated_delta_rule

_MIN_TILE = 16  # smallest M/N/K of a Triton dot


def _dot(a, b, contract, cdt):
    """a . b contracting dims `contract` = (a_dim, b_dim), fp32 accumulation."""
    prec = lax.Precision.HIGHEST if cdt == jnp.float32 else None
    return lax.dot_general(a.astype(cdt), b.astype(cdt), ((contract[:1], contract[1:]), ((), ())),
                           precision=prec, preferred_element_type=jnp.float32)


def _lean_scan_kernel(u_ref, w_ref, qin_ref, kout_ref, qk_ref, end_ref, s_ref, o_ref, so_ref,
                      *, c, n_chunks, bv, cdt):
    """The state pass alone, on inputs XLA prepared (`gdn.chunk_intra`): per chunk four dots
    with the carried state and the chunk's corrections, nothing else."""
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * bv, bv)

    def chunk(n, s):  # s: [K, bv] fp32
        rows = pl.ds(pl.multiple_of(n * c, c), c)
        v_new = u_ref[b, h, rows, cols].astype(jnp.float32) - _dot(w_ref[b, h, rows, :], s,
                                                                   (1, 0), cdt)  # [C, bv]
        o_ref[b, rows, h, cols] = (_dot(qin_ref[b, h, rows, :], s, (1, 0), cdt)
                                   + _dot(qk_ref[b, h, rows, :], v_new, (1, 0), cdt))
        return s * end_ref[b, h, n] + _dot(kout_ref[b, h, rows, :], v_new, (0, 0), cdt)

    so_ref[b, h, :, cols] = lax.fori_loop(0, n_chunks, chunk, s_ref[b, h, :, cols])


def _pow2(x: int) -> bool:
    return x >= _MIN_TILE and (x & (x - 1)) == 0


def supported(q, v, chunk_size: int = 64) -> bool:
    """Head dims and the chunk must be Triton tiles (powers of two >= 16)."""
    return _pow2(q.shape[-1]) and _pow2(v.shape[-1]) and _pow2(chunk_size)


def chunk_len(t: int, chunk_size: int = 64) -> int:
    """The chunk used for T steps: chunk_size, or the next power of two >= max(T, 16)."""
    return chunk_size if t >= chunk_size else max(_MIN_TILE, 1 << max(0, t - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("chunk_size", "scale", "interpret", "bv",
                                             "num_warps", "num_stages"))
def gdn_chunk(q, k, v, g, beta, initial_state=None, chunk_size: int = 64,
              scale: float | None = None, *, interpret: bool | None = None, bv: int = 64,
              num_warps: int = 4, num_stages: int = 1):
    """q, k: [B, T, Hk, K] (L2-normalised); v: [B, T, Hv, V]; g (log decay), beta: [B, T, Hv];
    initial_state [B, Hv, K, V] or None. Returns (out [B, T, Hv, V] fp32, final state
    [B, Hv, K, V] fp32). XLA prepares every term that does not depend on the state
    (`gdn.chunk_intra`, bf16 products for bf16 inputs), the diagonal blocks of the chunks'
    inverses from engine/kernels/gdn_inverse.py, and the lean scan kernel only multiplies by
    the state: four dots a chunk. bv: the state's value columns a program; num_warps,
    num_stages: the scan kernel's launch. Shapes the kernels cannot tile take the
    reference."""
    if not supported(q, v, chunk_size):
        return gdn_chunk_ref(q, k, v, g, beta, initial_state, chunk_size, scale)
    interpret = resolve_interpret(interpret)
    b, t, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    f32 = jnp.float32
    cdt = f32 if all(x.dtype == f32 for x in (q, k, v)) else jnp.bfloat16
    if initial_state is None:
        initial_state = jnp.zeros((b, hv, dk, dv), f32)
    c = chunk_len(t, chunk_size)
    pad = (-t) % c
    q, k, v = (jnp.pad(x.astype(cdt), ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    g, beta = (jnp.pad(x.astype(f32), ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    tp, n = t + pad, (t + pad) // c
    bv = min(bv, dv)
    params = None if interpret else triton_params(num_warps, num_stages)
    sc = dk ** -0.5 if scale is None else scale
    *parts, end = chunk_intra(q, k, v, g, beta, c, sc, "bf16" if cdt != f32 else "fp32",
                              functools.partial(diag_inverse, interpret=interpret))
    out, state = pl.pallas_call(
        functools.partial(_lean_scan_kernel, c=c, n_chunks=n, bv=bv, cdt=cdt),
        grid=(b, hv, dv // bv),
        out_shape=(jax.ShapeDtypeStruct((b, tp, hv, dv), f32),
                   jax.ShapeDtypeStruct((b, hv, dk, dv), f32)),
        input_output_aliases={6: 1}, interpret=interpret, compiler_params=params,
        name="gdn_chunk_scan_lean")(*(x.astype(cdt) for x in parts), end,
                                    initial_state.astype(f32))
    return out[:, :t], state


def gdn_chunk_bf16_operands(q, k, v, g, beta, initial_state=None, chunk_size: int = 64,
                            scale: float | None = None):
    """`gdn_chunk` as the model's prefill rule (`model.gdn.select_rule`): it carries the mark
    that tells a bf16 model's GDN step to hand it bf16 q, k, v (engine/ops/gdn.py `gdn_core`).
    The scan kernel with value tiles of 64 columns, 4 warps and 2 pipeline stages (the fastest
    of 8/1, 8/2, 8/3 and 4/2 at 8K and 32K tokens, H200 docs/benchmarks)."""
    return gdn_chunk(q, k, v, g, beta, initial_state, chunk_size, scale, bv=64,
                     num_warps=4, num_stages=2)


gdn_chunk_bf16_operands.bf16_operands = True
