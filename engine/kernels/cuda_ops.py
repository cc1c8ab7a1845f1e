"""CUDA ops called through the XLA FFI, for what the Pallas kernels cannot reach.

`int4_gemv` (engine/kernels/cuda/int4_gemv.cu): the int4_g64 weight-only GEMV of decode. The
Triton version is instruction-bound near 1.1 TB/s (docs/benchmarks/README.md); the CUDA one
dequantizes with one logic op per code. Same signature and result as `qgemv.qmatmul` for int4
weights (x [..., K], a QTensor or a stack of them read at `index`), checked against the same
reference (`ops.quant.linear_ref`) by the GPU tests. `int4_mlp`: a decode step's whole MLP.
`int4_gemm_multi`: the same product for a prefill piece of up to 64 rows of bf16 x (a short
new turn), each weight byte read once for all the rows.

The ops call the FFI targets of the shared library that engine/kernels/cuda_build.py builds and
registers; `require(plan)` (re-exported here with the build's other entry points) must have
registered it before a plan that names the ops runs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from engine.kernels.cuda_build import (  # noqa: F401 (re-export: the build's entry points)
    INT4_GEMM_TARGET, INT4_MLP_TARGET, INT4_MMA_TARGET, INT4_SOURCE, INT4_TARGET,
    INT4_WIDE_TARGET,
    CudaUnavailable, _nvcc, build, library_digest, library_path, require)
from engine.ops.quant import GROUP, INT4_G64, QTensor

WIDE_MAX_M = 4  # the wide kernel's B columns: 2 per row of x
VARIANTS = ("fma", "mma", "wide")  # `int4_gemv`'s kernels
# Within a group of 64 inputs, lane t of the MMA kernel multiplies its 16 codes in this order
# (see the kernel's comment): x is permuted to match.
_MMA_ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15])
MAX_ROWS = 8
MAX_MATS = 4  # weights one call can take (the kernel's kMaxMats)


def supported(x, w, lead: int = 0) -> bool:
    """Shapes the op takes: M = prod(x.shape[:-1]) in 1..8, an int4_g64 QTensor of rank
    lead + 2 (lead <= 3), K a multiple of 64. `worthwhile` says where it is also faster."""
    m = int(np.prod(x.shape[:-1], dtype=np.int64))
    return (isinstance(w, QTensor) and w.fmt == INT4_G64 and 1 <= m <= MAX_ROWS
            and 0 <= lead <= 3 and jnp.ndim(w.data) == lead + 2
            and x.shape[-1] % GROUP == 0 and x.shape[-1] == w.shape[1])


def worthwhile(mats) -> bool:
    """Whether weights with these many output rows in all are worth the CUDA op (MIN_ROWS)."""
    return sum(w.shape[0] for w in mats) >= MIN_ROWS


def takes(x, mats, lead: int = 0) -> bool:
    """The one decision `qgemv.qmatmul` and `model.linear.linear_multi` share: x @ each of `mats`
    (int4_g64, `lead` stack dims) runs here, in one launch: shapes supported and enough rows
    to be faster (a property of the shapes; whether the op runs at all is the plan's)."""
    return (1 <= len(mats) <= MAX_MATS and all(supported(x, w, lead) for w in mats)
            and worthwhile(mats))


def default_rows_per_warp(m: int) -> int:
    """The FMA kernel's output rows a warp for M rows of x, the one it is built for: 2 up to
    4 rows of x (where the registers allow it without spilling), else 1."""
    return 2 if m <= 4 else 1


# Measured on the H200 (docs/benchmarks/README.md): below this many output rows the kernels'
# blocks cannot fill the GPU and the Pallas kernel (which splits K) is as fast or faster. For
# bf16 x with up to WIDE_MAX_M rows the wide tensor-core kernel is the fastest (lm_head 248 us
# at M = 1 against 314 us for "fma" and 325 us for "mma"; a whole decode step C1 97.3 tok/s,
# C2 187.5 tok/s, against 92.4 and 151.2 with "fma" for C1 and "mma" for C2); "mma" takes
# 5..8 rows, "fma" fp32 x.
MIN_ROWS = 2048
FMA_MAX_M = 1  # "fma" for bf16 x of this many rows when "wide" does not apply (K % 128 != 0)


WIDE_WARPS = (4, 8)  # the wide kernel's builds: warps to a 16-row tile
WIDE_AUTO_WARPS = 2048  # `wide_warps`: about 16 warps on each of the H200's 132 SMs

# The FFI attributes of each build, fixed (engine/kernels/cuda/int4_gemv.cu takes these values
# only, and says so for others): the wide kernel's 2 pairs of groups in flight a warp, the
# codes' offset taken off with x's group sums (bias 0), registers capped for 32 resident warps
# an SM, the register ring (stages 0), x permuted in the kernel (xperm 0); the mma kernel's
# 4-stage copy ring (prefetch 0); the MLP op's two launches chained by programmatic dependent
# launch, 8 warps a tile, registers capped for 32 warps an SM.
_WIDE_BUILD = {"prefetch": 2, "bias": 0, "occupancy": 32, "stages": 0, "xperm": 0}
_MMA_BUILD = {"stages": 4, "prefetch": 0}
_MLP_BUILD = {"launches": 2, "warps": 8, "occupancy": 32}


def _attrs(fixed: dict) -> dict:
    return {name: np.int64(value) for name, value in fixed.items()}


def group_sums(xb):
    """x [..., K] -> [..., K/64] fp32: the group sums the wide kernels take the codes'
    offset with (136 x each, inside the kernel: an XLA multiply after the sums would be a
    kernel of its own, 4 a layer); also the reference of the fused norms' sums
    (engine/kernels/norm_sums.py)."""
    return xb.astype(jnp.float32).reshape(*xb.shape[:-1], -1, GROUP).sum(-1)


def wide_warps(n: int) -> int:
    """Warps to a 16-row tile of the wide kernel for N output rows: the fewer of WIDE_WARPS
    that still gives the call WIDE_AUTO_WARPS warps in all: 4 where there are many tiles
    (lm_head, mlp gate|up, the GDN and attention input projections: 896 tiles and more), 8
    where there are few (down and out_proj: 320-384 tiles). A choice by shape only, so a
    call's result does not depend on the batch. Measured on the H200 (docs/benchmarks/
    README.md): each shape's fastest of 2, 4 and 8 warps is the one picked, but for attention
    q|k|v (4, within 7%); 16 warps were slower than 8 everywhere, and 10 for down and
    out_proj no faster in the decode step than 8."""
    tiles = -(-n // 16)
    return next((w for w in WIDE_WARPS if tiles * w >= WIDE_AUTO_WARPS), WIDE_WARPS[-1])


def default_variant(x) -> str:
    """"wide" (bf16 tensor cores, 16-byte loads) for bf16 x of M <= WIDE_MAX_M rows (it falls
    back to "mma" where K is not a multiple of 128), "mma" for bf16 x of more rows, "fma"
    (fp32 FMAs, exact dequantization) for fp32 x. Each is batch-invariant on its own, and an
    engine runs its decode step at a fixed batch, so it always uses the same one."""
    m = int(np.prod(x.shape[:-1], dtype=np.int64))
    if x.dtype != jnp.bfloat16:
        return "fma"
    return "wide" if m <= WIDE_MAX_M else "mma"


def int4_gemv(x, w: QTensor, index=None, *, variant: str | None = None,
              warps: int | None = None, corr=None):
    """x [..., K] (M = prod of leading dims <= 8) @ w.T for an int4_g64 QTensor w [N, K] or a
    stack [*d, N, K] read at `index` (int32 [d]). Returns [..., N] in x.dtype (fp32 sums).
    variant (None: `default_variant`, by x; another name is a ValueError):
    - "wide": bf16 tensor cores, 16-byte loads of a row per lane, two groups of 64 per MMA
      (M <= 4 and K a multiple of 128, else "fma" for one row of x and "mma" for more): the
      codes' offset taken off with x's group sums (`corr`, else computed here), 2 pairs of
      groups in flight a warp, registers capped for 32 resident warps an SM, and at M = 1
      (K <= 20480) x staged in shared memory;
    - "mma": bf16 tensor cores (x rounded to bf16, a no-op for bf16 x), codes and scales
      streamed through a 4-stage cp.async ring in shared memory, any M <= 8;
    - "fma": fp32 FMAs with exact dequantization, 2 output rows a warp up to 4 rows of x,
      else 1.
    warps: the wide kernel's warps to a 16-row tile, 4 or 8 (None: `wide_warps`, by the call's
    rows; another value is a ValueError). The kernels' other settings are fixed at what the
    H200 measured fastest (docs/benchmarks/README.md and engine/kernels/cuda/int4_gemv.cu):
    for "wide" the register cap (C1 / C2 decode at 1K 119.6 / 227.6 tok/s against 110.8 /
    216.5 uncapped), 2 pairs in flight (4 pairs, or a shared-memory ring of 4 or 8, slower at
    the large calls), the offset by group sums (by MMAs in the kernel: lm_head at M = 1 378.6
    us against 303.7), x permuted in the kernel (permuted by XLA before the call: no faster);
    for "mma" 4 copy stages (6, 8 or 12, or codes loaded 2-8 groups ahead into registers, no
    faster)."""
    return int4_gemv_multi(x, [w], index, variant=variant, warps=warps, corr=corr)[0]


def int4_gemv_multi(x, ws, index=None, *, variant: str | None = None,
                    warps: int | None = None, concat: bool = False, corr=None):
    """`int4_gemv` of one x by up to MAX_MATS weights that share K and stack dims (a layer's
    projections of one input), in one launch with one preparation of x. Returns the list of
    [..., N_j] results; each is what `int4_gemv(x, ws[j], index)` gives, bit for bit (a row's
    sum does not depend on the other rows). concat=True: one [..., sum N_j] array instead.
    corr: x's group sums [..., K / 64] fp32 where the caller has them (`group_sums`, or the
    fused norm kernel's, engine/kernels/norm_sums.py), for the wide kernel: no XLA reduction
    of its own; other kernels ignore it. warps: the wide kernel's, as `int4_gemv` takes it
    (the sum of the weights' rows decides the default)."""
    if not 1 <= len(ws) <= MAX_MATS:
        raise ValueError(f"int4_gemv_multi takes 1..{MAX_MATS} weights, got {len(ws)}")
    lead, k = x.shape[:-1], x.shape[-1]
    m = int(np.prod(lead, dtype=np.int64))
    ns = [w.shape[0] for w in ws]
    n = sum(ns)
    idx = (jnp.zeros((1,), jnp.int32) if index is None
           else jnp.asarray(index, jnp.int32).reshape(-1))
    out_dtype = x.dtype if x.dtype in (jnp.bfloat16, jnp.float32) else jnp.float32
    pairs = [a for w in ws for a in (w.data, w.scale.astype(jnp.float32))]
    variant = variant or default_variant(x)
    if variant not in VARIANTS:
        raise ValueError(f"int4_gemv: variant must be one of {VARIANTS}, "
                         f"got {variant!r}")
    if warps is not None and warps not in WIDE_WARPS:
        raise ValueError(f"int4_gemv: the wide kernel's warps must be one of {WIDE_WARPS}, "
                         f"got {warps!r}")
    if variant == "wide" and not (m <= WIDE_MAX_M and k % (2 * GROUP) == 0):
        variant = "fma" if m <= FMA_MAX_M else "mma"
    if variant == "wide":
        xb = x.reshape(m, k).astype(jnp.bfloat16)  # the kernel permutes it
        corr = (group_sums(xb) if corr is None
                else jnp.asarray(corr, jnp.float32).reshape(m, k // GROUP))
        call = jax.ffi.ffi_call(INT4_WIDE_TARGET, jax.ShapeDtypeStruct((m, n), out_dtype))
        y = call(xb, corr, idx, *pairs, warps=np.int64(warps or wide_warps(n)),
                 **_attrs(_WIDE_BUILD))
    elif variant == "mma":
        g = k // GROUP
        xb = jnp.pad(x.reshape(m, k).astype(jnp.bfloat16), ((0, 8 - m), (0, 0)))
        xg = xb.reshape(8, g, 4, 16)[..., _MMA_ORDER].transpose(1, 0, 2, 3)  # [G, 8, 4, 16]
        corr = 136.0 * xb.astype(jnp.float32).reshape(8, g, GROUP).sum(-1).T  # [G, 8]
        call = jax.ffi.ffi_call(INT4_MMA_TARGET, jax.ShapeDtypeStruct((m, n), out_dtype))
        y = call(xg, corr, idx, *pairs, **_attrs(_MMA_BUILD))
    else:
        xf = x.reshape(m, k).astype(jnp.float32)
        kp = -(-k // 1024) * 1024  # whole 1024-input iterations (32 lanes x 32 codes)
        xf = jnp.pad(xf, ((0, 0), (0, kp - k)))
        # [M, K/1024, lane, word, half, 4] -> [M, K/1024, word, half, lane, 4]: warp-wide
        # loads of x are contiguous (see the kernel's comment)
        xf = xf.reshape(m, kp // 1024, 32, 4, 2, 4).transpose(0, 1, 3, 4, 2, 5)
        call = jax.ffi.ffi_call(INT4_TARGET, jax.ShapeDtypeStruct((m, n), out_dtype))
        y = call(xf, idx, *pairs, rows_per_warp=np.int64(default_rows_per_warp(m)))
    return _outputs(y.astype(x.dtype), lead, ns, concat)


def _outputs(y, lead, ns, concat):
    """A call's [M, sum N_j] result as the caller asked: side by side (concat, as the kernel
    writes it) or one [..., N_j] array a weight."""
    if concat:
        return y.reshape(*lead, sum(ns))
    outs, at = [], 0
    for nj in ns:
        outs.append(y[:, at:at + nj].reshape(*lead, nj))
        at += nj
    return outs


def mlp_shape_error(x, h, gate, up, down) -> str | None:
    """Why `int4_mlp` does not take these operands (None: it does): bf16 x and h of a decode
    step's rows (M <= 4), int4_g64 gate and up [*d, N1, K1] and down [*d, N2, N1] of the same
    stack dims, K1 and N1 multiples of 128."""
    m = int(np.prod(x.shape[:-1], dtype=np.int64))
    if not 1 <= m <= WIDE_MAX_M:
        return f"int4_mlp takes 1..{WIDE_MAX_M} rows, got {m}"
    if x.dtype != jnp.bfloat16 or h.dtype != jnp.bfloat16:
        return f"int4_mlp: x and h must be bf16, got {x.dtype} and {h.dtype}"
    ws = (gate, up, down)
    if not all(isinstance(w, QTensor) and w.fmt == INT4_G64 for w in ws):
        return "int4_mlp: gate, up and down must be int4_g64"
    n1, k1 = gate.shape
    lead = jnp.ndim(gate.data) - 2
    if (up.shape != gate.shape or down.shape[1] != n1 or x.shape[-1] != k1 or k1 % 128
            or n1 % 128 or any(jnp.ndim(w.data) != lead + 2 for w in ws)):
        return ("int4_mlp: gate and up [*d, N1, K1], down [*d, N2, N1], K1 and N1 multiples "
                f"of 128; got {gate.shape}, {up.shape}, {down.shape} for x [..., "
                f"{x.shape[-1]}]")
    if h.shape[:-1] != x.shape[:-1] or h.shape[-1] != down.shape[0]:
        return f"int4_mlp: h must be [..., {down.shape[0]}], got {h.shape}"
    return None


def int4_mlp(x, h, gate: QTensor, up: QTensor, down: QTensor, index=None, *, corr=None):
    """h + down(silu(gate(x)) * up(x)) for a decode step's rows (x, h [..., K1] / [..., N2]
    bf16, M = prod of leading dims <= 4; int4_g64 gate and up [*d, N1, K1], down [*d, N2,
    N1], or stacks read at `index`) in one call of the CUDA op (engine/kernels/cuda/
    int4_gemv.cu): gate|up and down as the wide GEMV computes them, SwiGLU between, the
    residual added, in two launches, `int4_mlp_gate_up` then `int4_mlp_down`, chained by
    programmatic dependent launch (down's blocks fill their rings with its first codes while
    gate|up's last blocks run), 8 warps a tile, registers capped for 32 resident warps an SM.
    Each op rounded to bf16 as the separate calls round them; down's group sums of the
    activations come from per-tile sums (another order of the same fp32 sums, so close to the
    separate calls, not bitwise). The model takes it through `layers.mlp_residual` (a plan's
    mlp "cuda"). Measured on the H200 (docs/benchmarks/README.md): C1 +1.1 to +1.9% and C2
    +2.6 to +4.7% decode at 1K against the separate calls; the programmatic dependent launch
    worth ~1-9 us a call against the same launches in stream order; 8 warps a gate|up tile
    with 32 an SM the fastest of 8/32, 4/24 and 4/32 in the decode step; one persistent launch
    with a grid barrier between the GEMVs slower than the separate calls (C1 / C2 112.7 / 209.3
    tok/s against 122.4 / 234.3). corr: x's group sums [..., K1 / 64] where the caller has them
    (as `int4_gemv_multi` takes them)."""
    if (err := mlp_shape_error(x, h, gate, up, down)) is not None:
        raise ValueError(err)
    lead, k1 = x.shape[:-1], x.shape[-1]
    m = int(np.prod(lead, dtype=np.int64))
    n1, n2 = gate.shape[0], down.shape[0]
    idx = (jnp.zeros((1,), jnp.int32) if index is None
           else jnp.asarray(index, jnp.int32).reshape(-1))
    xb = x.reshape(m, k1).astype(jnp.bfloat16)
    corr = (group_sums(xb) if corr is None
            else jnp.asarray(corr, jnp.float32).reshape(m, k1 // GROUP))
    pairs = [a for w in (gate, up, down) for a in (w.data, w.scale.astype(jnp.float32))]
    call = jax.ffi.ffi_call(INT4_MLP_TARGET, (
        jax.ShapeDtypeStruct((m, n2), jnp.bfloat16),  # h + the MLP
        jax.ShapeDtypeStruct((m, n1), jnp.bfloat16),  # scratch: the activations
        jax.ShapeDtypeStruct((m, n1 // 16), jnp.float32)))  # scratch: their tile sums
    out, _, _ = call(xb, corr, h.reshape(m, n2).astype(jnp.bfloat16), idx, *pairs,
                     **_attrs(_MLP_BUILD))
    return out.reshape(*lead, n2)


GEMM_MAX_ROWS = 64
GEMM_TILE = 256   # output rows a block of the GEMM kernel
GEMM_STEP = 128   # inputs a stage
GEMM_BLOCKS = 132  # blocks a wave: one a streaming multiprocessor of the H200 (and H100)


def gemm_takes(x, mats, lead: int = 0) -> bool:
    """Whether `int4_gemm_multi` takes x [..., K] @ each of `mats`: bf16 x of 1..GEMM_MAX_ROWS
    rows, 1..MAX_MATS int4_g64 weights of rank lead + 2 (lead <= 3) sharing K, a multiple of
    128."""
    m = int(np.prod(x.shape[:-1], dtype=np.int64))
    k = x.shape[-1]
    return (x.dtype == jnp.bfloat16 and 1 <= m <= GEMM_MAX_ROWS and 1 <= len(mats) <= MAX_MATS
            and k % GEMM_STEP == 0 and 0 <= lead <= 3
            and all(isinstance(w, QTensor) and w.fmt == INT4_G64
                    and jnp.ndim(w.data) == lead + 2 and w.shape[1] == k for w in mats))


def gemm_splits(n: int, k: int, m: int = GEMM_MAX_ROWS) -> int:
    """The parts the GEMM splits K into for N output rows and M rows of x (a property of the
    shape only): the fewest stage-times on the busiest streaming multiprocessor, counting
    whole waves of GEMM_BLOCKS blocks (one a multiprocessor) and the fp32 partial sums each
    extra part writes and XLA reads back (at the weights' rate); each part at least 4
    stages."""
    tiles, steps = -(-n // GEMM_TILE), k // GEMM_STEP
    stage_bytes = GEMM_BLOCKS * (GEMM_TILE * GEMM_STEP // 2 + GEMM_TILE * 8)

    def cost(s):
        waves = -(-tiles * s // GEMM_BLOCKS)
        return waves * -(-steps // s) + (2 * s * m * n * 4 / stage_bytes if s > 1 else 0)
    return min(range(1, max(1, steps // 4) + 1), key=lambda s: (cost(s), s))


def int4_gemm_multi(x, ws, index=None, *, concat: bool = False):
    """x [..., K] (bf16, M = prod of leading dims <= 64) @ w.T for each int4_g64 weight of `ws`
    (1..MAX_MATS sharing K and stack dims, read at `index`), in one launch of the GEMM kernel
    (engine/kernels/cuda/int4_gemv.cu `int4_gemm`): exact products of x and (code - 8), summed
    in fp32 a group at a time and scaled by the group's scale (the reference rounds each
    code * scale to bf16 first), K split into `gemm_splits` parts whose fp32 partials XLA
    adds. Returns the list of [..., N_j] bf16 results (concat=True: one
    [..., sum N_j] array)."""
    if not gemm_takes(x, ws, jnp.ndim(ws[0].data) - 2 if ws else 0):
        raise ValueError("int4_gemm takes bf16 x of 1..64 rows and 1..4 int4_g64 weights "
                         "sharing K (a multiple of 128)")
    lead, k = x.shape[:-1], x.shape[-1]
    m = int(np.prod(lead, dtype=np.int64))
    ns = [w.shape[0] for w in ws]
    n = sum(ns)
    mp = -(-m // 16) * 16  # the kernel's x: a multiple of 16 rows (an even count of n8 tiles)
    idx = (jnp.zeros((1,), jnp.int32) if index is None
           else jnp.asarray(index, jnp.int32).reshape(-1))
    xb = jnp.pad(x.reshape(m, k), ((0, mp - m), (0, 0)))
    pairs = [a for w in ws for a in (w.data, w.scale.astype(jnp.float32))]
    splits = gemm_splits(n, k, m)
    part = jax.ffi.ffi_call(INT4_GEMM_TARGET,
                            jax.ShapeDtypeStruct((splits, m, n), jnp.float32))(xb, idx, *pairs)
    y = (part[0] if splits == 1 else part.sum(0)).astype(x.dtype)
    return _outputs(y, lead, ns, concat)
