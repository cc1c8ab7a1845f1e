"""The one matmul entry point the model uses: `linear(x, w, plan)` and a layer's projections of
one input, `linear_multi`. The plan (engine/plan.py) sends shapes its kernels take to the
weight-only GEMV, the int4 GEMM or the CUDA op (engine/kernels/); everything else, and the
reference plan, is `engine.ops.quant.linear_ref` (dequantize, then an XLA matmul)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from engine.ops.quant import linear_ref


def linear(x: jax.Array, w, plan=None, corr=None) -> jax.Array:
    """x: [..., in] -> [..., out], with w: [out, in] (a dense array or a QTensor).

    A QTensor is dequantized to x.dtype first, then multiplied exactly like a dense weight: this is
    the reference path that fused low-precision kernels must match (`ops.quant.linear_ref`). plan
    (engine/plan.py; None: the reference): with gemv "pallas" or "cuda", decode-sized x (at most
    `qgemv.MAX_ROWS` rows) goes to the weight-only GEMV (engine/kernels/qgemv.py; int4_g64
    weights to the CUDA op with "cuda"), which reads the stored format directly; a prefill
    piece's x of `qgemm.MIN_ROWS` to the plan's int4_gemm_rows rows against int4_g64 weights to
    the int4 GEMM (engine/kernels/qgemm.py; bf16 x of up to 64 rows to the CUDA op's GEMM with
    the plan's gemm "cuda"), which does not write a dequantized copy. corr: x's group sums where
    the caller has them (engine/kernels/norm_sums.py), for the CUDA GEMV.
    """
    if plan is not None and plan.gemv != "xla":
        from engine.kernels import qgemm, qgemv
        from engine.kernels.stacked import Stacked

        stacked = isinstance(w, Stacked)
        mat, index = (w.w, w.index) if stacked else (w, None)
        lead = int(index.shape[0]) if stacked else 0
        cuda = plan.gemv == "cuda"
        if _cuda_gemm(x, [mat], lead, plan):
            from engine.kernels import cuda_ops
            return cuda_ops.int4_gemm_multi(x, [mat], index)[0]
        if (math.prod(x.shape[:-1]) <= plan.int4_gemm_rows
                and qgemm.takes(x, mat, lead)):  # takes: at least qgemm.MIN_ROWS rows
            return qgemm.int4_matmul(x, mat, index)
        if stacked:  # a layer of a stacked weight (engine/kernels/stacked.py)
            if qgemv.supported(x, w.w, lead):
                return qgemv.qmatmul(x, w.w, w.index, corr=corr, cuda=cuda)
            w = w.materialize()
        if qgemv.supported(x, w):
            return qgemv.qmatmul(x, w, corr=corr, cuda=cuda)
    return linear_ref(x, w)


def linear_multi(x: jax.Array, ws, plan=None, concat: bool = False, corr=None):
    """[linear(x, w, plan) for w in ws]: a layer's projections of one input. With the plan's
    gemv "cuda" (gemm "cuda" for a prefill piece), int4_g64 weights (layer views of one stack,
    or plain QTensors) go to the CUDA GEMV (GEMM) in one launch that prepares x once
    (engine/kernels/cuda_ops.py `int4_gemv_multi`: the same result per projection as separate
    calls). concat=True returns the projections side by
    side in one [..., sum of outs] array instead (from the one launch, no slices)."""
    ws = list(ws)
    if plan is not None and (plan.gemv == "cuda" or plan.gemm == "cuda") and len(ws) > 1:
        from engine.kernels import cuda_ops
        from engine.kernels.stacked import Stacked

        views = all(isinstance(w, Stacked) for w in ws)
        mats = [w.w for w in ws] if views else ws
        lead = int(ws[0].index.shape[0]) if views else 0
        index = ws[0].index if views else None
        if views or not any(isinstance(w, Stacked) for w in ws):
            if _cuda_gemm(x, mats, lead, plan):
                return cuda_ops.int4_gemm_multi(x, mats, index, concat=concat)
            if plan.gemv == "cuda" and cuda_ops.takes(x, mats, lead):
                return cuda_ops.int4_gemv_multi(x, mats, index, concat=concat, corr=corr)
    outs = [linear(x, w, plan, corr) for w in ws]
    return jnp.concatenate(outs, axis=-1) if concat else outs


def _cuda_gemm(x, mats, lead: int, plan) -> bool:
    """Whether x @ each of `mats` runs in the CUDA GEMM: the plan's gemm "cuda", a prefill
    piece (qgemm.MIN_ROWS to the plan's int4_gemm_rows rows) and shapes it takes (bf16 x of at
    most 64 rows, K a multiple of 128); other pieces take the Pallas GEMM or the GEMV."""
    from engine.kernels import cuda_ops, qgemm
    rows = math.prod(x.shape[:-1])
    return (plan.gemm == "cuda" and qgemm.MIN_ROWS <= rows <= plan.int4_gemm_rows
            and cuda_ops.gemm_takes(x, mats, lead))
