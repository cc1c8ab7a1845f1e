"""CUDA ops called through the XLA FFI, for what the Pallas kernels cannot reach.

`int4_gemv` (engine/kernels/cuda/int4_gemv.cu): the int4_g64 weight-only GEMV of decode. The
Triton version is instruction-bound near 1.1 TB/s (docs/benchmarks/README.md, v3); the CUDA one
dequantizes with one logic op per code. Same signature and result as `qgemv.qmatmul` for int4
weights (x [..., K], a QTensor or a stack of them read at `index`), checked against the same
reference (`quant.linear`) by the GPU tests.

The shared library is compiled from the source with the machine's `nvcc` (`NVCC`, else the
PATH's, else /usr/local/cuda/bin/nvcc) for the kernel plan's architecture and flags
(engine/plan.py `cuda_arch`, `cuda_flags`), into a cache named by a digest of the source, the
FFI headers, the compiler, the architecture and the flags (`NINFER_CUDA_CACHE`, default
~/.cache/ninfer/cuda), and published atomically, so concurrent processes never load a
half-written file. `require(plan)` builds and registers it before a plan that names the op
runs, and raises `CudaUnavailable` with the reason where it cannot (no GPU, another GPU
architecture, no nvcc, a failed build): a plan is never served by another kernel.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.quant import GROUP, INT4_G64, QTensor

log = logging.getLogger("ninfer.cuda_ops")

SOURCE_DIR = Path(__file__).resolve().parent / "cuda"
INT4_SOURCE = SOURCE_DIR / "int4_gemv.cu"
INT4_TARGET = "ninfer_int4_gemv"
INT4_MMA_TARGET = "ninfer_int4_gemv_mma"
INT4_WIDE_TARGET = "ninfer_int4_gemv_wide"
INT4_MLP_TARGET = "ninfer_int4_mlp"
WIDE_MAX_M = 4  # the wide kernel's B columns: 2 per row of x
VARIANTS = ("fma", "mma", "wide")  # `int4_gemv`'s kernels
# Within a group of 64 inputs, lane t of the MMA kernel multiplies its 16 codes in this order
# (see the kernel's comment): x is permuted to match.
_MMA_ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15])
MAX_ROWS = 8
MAX_MATS = 4  # weights one call can take (the kernel's kMaxMats)


class CudaUnavailable(RuntimeError):
    """The CUDA ops a plan names cannot run on this machine; the message says why."""


def cache_dir() -> Path:
    return Path(os.environ.get("NINFER_CUDA_CACHE")
                or Path.home() / ".cache" / "ninfer" / "cuda")


def _nvcc() -> str | None:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file():
            return cand
    return None


def _arch() -> str | None:
    """The first GPU's compute capability as nvcc spells it ("90"), or None."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return None
    cc = getattr(dev, "compute_capability", None)
    return cc.replace(".", "") if cc else None


def library_path(source: Path, arch: str, nvcc: str,
                 flags: tuple[str, ...] = ("-O3", "-std=c++17")) -> Path:
    """Where the build of `source` for `arch` with nvcc `flags` lives: named by a digest of
    everything that goes into it."""
    h = hashlib.sha256()
    h.update(source.read_bytes())
    inc = Path(jax.ffi.include_dir())
    for hdr in sorted((inc / "xla" / "ffi" / "api").glob("*.h")):
        h.update(hdr.read_bytes())
    ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    h.update(ver.encode())
    h.update(arch.encode())
    h.update(json.dumps(list(flags)).encode())
    return cache_dir() / f"{source.stem}-sm{arch}-{h.hexdigest()[:16]}.so"


def build(source: Path, arch: str, nvcc: str,
          flags: tuple[str, ...] = ("-O3", "-std=c++17")) -> Path:
    """Compile `source` into the cache (nothing to do when it is there). Returns the path."""
    out = library_path(source, arch, nvcc, flags)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        cmd = [nvcc, *flags, "--shared", "-Xcompiler", "-fPIC",
               f"-gencode=arch=compute_{arch},code=sm_{arch}",
               f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed ({res.returncode}): {res.stderr[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)  # atomic: a reader sees the old state or the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_LOCK = threading.Lock()
_LOADED: dict[tuple, Path] = {}  # (arch, flags) -> the library registered in this process


def _register(lib) -> None:
    for target, symbol in ((INT4_TARGET, lib.NinferInt4Gemv),
                           (INT4_MMA_TARGET, lib.NinferInt4GemvMma),
                           (INT4_WIDE_TARGET, lib.NinferInt4GemvWide),
                           (INT4_MLP_TARGET, lib.NinferInt4Mlp)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="CUDA")


def require(plan) -> Path:
    """Build (or find in the cache) and register the CUDA ops for `plan` (its cuda_arch and
    cuda_flags) in this process; returns the library's path. Raises CudaUnavailable with the
    reason where this machine cannot: no GPU backend, a GPU of another architecture than the
    plan's, no nvcc, a failed build or load. One build and registration per process and
    (arch, flags); a second plan with other build settings in the same process is refused
    (the FFI targets are process-wide)."""
    key = (plan.cuda_arch, tuple(plan.cuda_flags))
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
        if _LOADED:
            raise CudaUnavailable(f"this process already registered the CUDA ops built for "
                                  f"{next(iter(_LOADED))}; a plan built for {key} needs a "
                                  f"process of its own")
        if not any(d.platform == "gpu" for d in jax.devices()):
            raise CudaUnavailable("the plan runs the CUDA ops, and this machine has no GPU "
                                  "backend")
        arch, nvcc = _arch(), _nvcc()
        if arch != plan.cuda_arch:
            raise CudaUnavailable(f"the plan's CUDA ops are built for sm_{plan.cuda_arch}; "
                                  f"this GPU is sm_{arch}")
        if nvcc is None:
            raise CudaUnavailable("the plan runs the CUDA ops, and no nvcc was found (NVCC, "
                                  "PATH, /usr/local/cuda/bin/nvcc)")
        try:
            path = build(INT4_SOURCE, arch, nvcc, tuple(plan.cuda_flags))
            _register(ctypes.cdll.LoadLibrary(str(path)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            raise CudaUnavailable(f"the CUDA ops' build or load failed: {e}") from None
        _LOADED[key] = path
        log.info("CUDA ops for sm_%s registered from %s", arch, path)
        return path


def library_digest(plan) -> str | None:
    """The registered library's name (its digest of source, headers, compiler, arch and
    flags) for `plan`, or None where `require` has not registered it."""
    path = _LOADED.get((plan.cuda_arch, tuple(plan.cuda_flags)))
    return path.name if path else None


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
    """The one decision `qgemv.qmatmul` and `quant.linear_multi` share: x @ each of `mats`
    (int4_g64, `lead` stack dims) runs here, in one launch: shapes supported and enough rows
    to be faster (a property of the shapes; whether the op runs at all is the plan's)."""
    return (1 <= len(mats) <= MAX_MATS and all(supported(x, w, lead) for w in mats)
            and worthwhile(mats))


def default_rows_per_warp(m: int) -> int:
    return 2 if m <= 4 else 1


# Measured on the H200 (docs/benchmarks/README.md, v4, v6 and v9): below this many output rows
# the kernels' blocks cannot fill the GPU and the Pallas kernel (which splits K) is as fast or
# faster. For bf16 x with up to WIDE_MAX_M rows the wide tensor-core kernel is the fastest (v9:
# lm_head 248 us at M = 1 against 314 us for "fma" and 325 us for "mma"; a whole decode step
# C1 97.3 tok/s, C2 187.5 tok/s, against 92.4 and 151.2 with "fma" for C1 and "mma" for C2);
# "mma" takes 5..8 rows, "fma" fp32 x.
MIN_ROWS = 2048
FMA_MAX_M = 1  # "fma" for bf16 x of this many rows when "wide" does not apply (K % 128 != 0)


WIDE_WARPS = (2, 4, 8, 10, 16)
WIDE_AUTO_CHOICES = (4, 8)  # "auto" picks from these (2 and 16 measured slower, v12)
WIDE_AUTO_WARPS = 2048  # "auto": about 16 warps on each of the H200's 132 SMs


WIDE_XPERM_WARPS = (4, 8, 10)  # the warps the kernel taking x_perm is built for


def group_sums(xb):
    """x [..., K] -> [..., K/64] fp32: the group sums the wide kernels take the codes'
    offset with (136 x each, inside the kernel: an XLA multiply after the sums would be a
    kernel of its own, 4 a layer); also the reference of the fused norms' sums
    (engine/kernels/norm_sums.py)."""
    return xb.astype(jnp.float32).reshape(*xb.shape[:-1], -1, GROUP).sum(-1)


def x_perm(x):
    """x [M, K] with each 8 inputs in the order 0, 4, 1, 5, 2, 6, 3, 7: its 32-bit words are
    then the pairs (r, r + 4) that the wide kernel's MMA B registers hold, so the kernel takes
    them as they load (`xperm`) in place of 16 byte permutations a pair of groups. The group
    sums of x do not change (a permutation inside each group)."""
    m, k = x.shape
    return x.reshape(m, k // 8, 2, 4).swapaxes(-1, -2).reshape(m, k)


def wide_warps(n: int, setting: str = "auto") -> int:
    """Warps to a 16-row tile of the wide kernel for N output rows: the setting (one of
    WIDE_WARPS), or with "auto" (the default) the fewer of WIDE_AUTO_CHOICES that still gives
    the call WIDE_AUTO_WARPS warps in all: 4 where there are many tiles (lm_head, mlp gate|up,
    the GDN and attention input projections: 896 tiles and more), 8 where there are few (down
    and out_proj: 320-384 tiles). "auto:4,10" picks the same way from the choices it names
    (10 warps for down and out_proj: as fast in the decode step as 8, v13). A choice by shape
    only, so a call's result does not depend on the batch. Measured on the H200 (v12,
    docs/benchmarks/README.md): each shape's fastest of 2, 4 and 8 warps is the one "auto"
    picks, but for attention q|k|v (4, within 7%)."""
    name, _, listed = setting.partition(":")
    if name != "auto":
        w = int(setting)
        if w not in WIDE_WARPS:
            raise ValueError(f"wide kernel warps must be one of {WIDE_WARPS} or 'auto', "
                             f"got {setting!r}")
        return w
    choices = WIDE_AUTO_CHOICES
    if listed:
        choices = tuple(sorted(int(c) for c in listed.split(",")))
        if not set(choices) <= set(WIDE_WARPS):
            raise ValueError(f"wide kernel warps must be among {WIDE_WARPS}, got {setting!r}")
    tiles = -(-n // 16)
    return next((w for w in choices if tiles * w >= WIDE_AUTO_WARPS), choices[-1])


def default_variant(x) -> str:
    """"wide" (bf16 tensor cores, 16-byte loads) for bf16 x of M <= WIDE_MAX_M rows (it falls
    back to "mma" where K is not a multiple of 128), "mma" for bf16 x of more rows, "fma"
    (fp32 FMAs, exact dequantization) for fp32 x. Each is batch-invariant on its own, and an
    engine runs its decode step at a fixed batch, so it always uses the same one."""
    m = int(np.prod(x.shape[:-1], dtype=np.int64))
    if x.dtype != jnp.bfloat16:
        return "fma"
    return "wide" if m <= WIDE_MAX_M else "mma"


def int4_gemv(x, w: QTensor, index=None, *, rows_per_warp: int | None = None,
              variant: str | None = None, stages: int | None = None,
              prefetch: int | None = None, warps: int | None = None, bias: int | None = None,
              occupancy: int | None = None, xperm: bool | None = None, corr=None):
    """x [..., K] (M = prod of leading dims <= 8) @ w.T for an int4_g64 QTensor w [N, K] or a
    stack [*d, N, K] read at `index` (int32 [d]). Returns [..., N] in x.dtype (fp32 sums).
    variant "mma": bf16 tensor-core kernel (x rounded to bf16, a no-op for bf16 x);
    "wide": the tensor-core kernel with 16-byte loads of a row per lane, two groups per MMA
    (M <= 4 and K a multiple of 128, else "fma"/"mma"); "fma": fp32 kernel; another name
    is a ValueError. None picks by x (`default_variant`). The tile parameters default to what
    the H200 measured fastest (docs/benchmarks): rows_per_warp (fma: 2 up to 4 rows, else 1);
    stages (mma: the copy pipeline's depth, 4; wide: 0, the register ring, as fast as the
    shared-memory rings of 4 or 8); prefetch (mma: 0, the shared-memory copy ring; wide: 2
    pairs in flight); warps (wide: 4 or 8 to a 16-row tile by the call's tiles, `wide_warps`);
    bias (wide: 0, the codes' offset taken off with x's group sums, faster than MMAs in the
    kernel); occupancy (wide: 32 resident warps an SM, 64 registers a lane, where built: prefetch
    2, bias 0, stages 0); xperm (wide: x permuted by `x_perm` so the kernel skips its byte
    permutations, the same bits; off, no faster in the decode step). The kernel tests call the
    other values."""
    return int4_gemv_multi(x, [w], index, rows_per_warp=rows_per_warp, variant=variant,
                           stages=stages, prefetch=prefetch, warps=warps, bias=bias,
                           occupancy=occupancy, xperm=xperm, corr=corr)[0]


def int4_gemv_multi(x, ws, index=None, *, rows_per_warp: int | None = None,
                    variant: str | None = None, stages: int | None = None,
                    prefetch: int | None = None, warps: int | None = None,
                    bias: int | None = None, occupancy: int | None = None,
                    xperm: bool | None = None, concat: bool = False, corr=None):
    """`int4_gemv` of one x by up to MAX_MATS weights that share K and stack dims (a layer's
    projections of one input), in one launch with one preparation of x. Returns the list of
    [..., N_j] results; each is what `int4_gemv(x, ws[j], index)` gives, bit for bit (a row's
    sum does not depend on the other rows). concat=True: one [..., sum N_j] array instead.
    corr: x's group sums [..., K / 64] fp32 where the caller has them (`group_sums`, or the
    fused norm kernel's, engine/kernels/norm_sums.py), for the wide kernel: no XLA reduction
    of its own; other kernels ignore it."""
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
    if variant == "wide" and not (m <= WIDE_MAX_M and k % (2 * GROUP) == 0):
        variant = "fma" if m <= FMA_MAX_M else "mma"
    if variant == "wide":
        xb = x.reshape(m, k).astype(jnp.bfloat16)  # the kernel permutes it (or x_perm below)
        bias = 0 if bias is None else int(bias)
        if bias:  # the kernel's MMAs take 136 * sum(x) off: nothing to prepare (slower, v10)
            corr = jnp.zeros((m, 0), jnp.float32)
        elif corr is None:
            corr = group_sums(xb)
        else:
            corr = jnp.asarray(corr, jnp.float32).reshape(m, k // GROUP)
        prefetch = prefetch or 2
        warps = warps or wide_warps(n)
        if stages is None:
            stages = 0
        if occupancy is None:  # 32 where it is built: the register ring of 2 pairs, bias 0
            occupancy = 32 if prefetch == 2 and not bias and not stages else 0
        if xperm is None:
            xperm = False
        if xperm:
            xb = x_perm(xb)
        call = jax.ffi.ffi_call(INT4_WIDE_TARGET, jax.ShapeDtypeStruct((m, n), out_dtype))
        y = call(xb, corr, idx, *pairs, prefetch=np.int64(prefetch), warps=np.int64(warps),
                 bias=np.int64(bias), occupancy=np.int64(occupancy), stages=np.int64(stages),
                 xperm=np.int64(bool(xperm)))
    elif variant == "mma":
        g = k // GROUP
        xb = jnp.pad(x.reshape(m, k).astype(jnp.bfloat16), ((0, 8 - m), (0, 0)))
        xg = xb.reshape(8, g, 4, 16)[..., _MMA_ORDER].transpose(1, 0, 2, 3)  # [G, 8, 4, 16]
        corr = 136.0 * xb.astype(jnp.float32).reshape(8, g, GROUP).sum(-1).T  # [G, 8]
        call = jax.ffi.ffi_call(INT4_MMA_TARGET, jax.ShapeDtypeStruct((m, n), out_dtype))
        y = call(xg, corr, idx, *pairs,
                 stages=np.int64(stages or 4),
                 prefetch=np.int64(0 if prefetch is None else prefetch))
    else:
        xf = x.reshape(m, k).astype(jnp.float32)
        kp = -(-k // 1024) * 1024  # whole 1024-input iterations (32 lanes x 32 codes)
        xf = jnp.pad(xf, ((0, 0), (0, kp - k)))
        # [M, K/1024, lane, word, half, 4] -> [M, K/1024, word, half, lane, 4]: warp-wide
        # loads of x are contiguous (see the kernel's comment)
        xf = xf.reshape(m, kp // 1024, 32, 4, 2, 4).transpose(0, 1, 3, 4, 2, 5)
        rpw = rows_per_warp or default_rows_per_warp(m)
        call = jax.ffi.ffi_call(INT4_TARGET, jax.ShapeDtypeStruct((m, n), out_dtype))
        y = call(xf, idx, *pairs, rows_per_warp=np.int64(rpw))
    y = y.astype(x.dtype)
    if concat:  # the results side by side, as the kernel writes them
        return y.reshape(*lead, n)
    outs, at = [], 0
    for nj in ns:
        outs.append(y[:, at:at + nj].reshape(*lead, nj))
        at += nj
    return outs


MLP_WARPS = (4, 8)
MLP_OCCUPANCY = (24, 32)
# `int4_mlp`'s launches: 1 the persistent kernel (grid barrier), 2 gate|up then down chained by
# programmatic dependent launch (the model's default, v14f), 3 the same two launches in plain
# stream order; and the (warps, occupancy) each takes when not given (v14: the persistent
# kernel's best, and for two launches 8 warps a gate|up tile with registers for 32 warps an
# SM, the fastest of 4/24, 4/32 and 8/32 in the decode step).
MLP_LAUNCHES = (1, 2, 3)
MLP_DEFAULTS = {1: (8, 24), 2: (8, 32), 3: (8, 32)}


def _mlp_setting(op: str, launches: int, warps, occupancy) -> tuple[int, int]:
    """(warps, occupancy) for an MLP call with that many launches: MLP_DEFAULTS where None,
    checked against what the kernels are built for."""
    dw, do = MLP_DEFAULTS[launches]
    warps, occupancy = dw if warps is None else warps, do if occupancy is None else occupancy
    if warps not in MLP_WARPS or occupancy not in MLP_OCCUPANCY:
        raise ValueError(f"{op}: warps {MLP_WARPS}, occupancy {MLP_OCCUPANCY}")
    return warps, occupancy


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


def int4_mlp(x, h, gate: QTensor, up: QTensor, down: QTensor, index=None, *,
             warps: int | None = None, occupancy: int | None = None, launches: int = 2,
             corr=None):
    """h + down(silu(gate(x)) * up(x)) for a decode step's rows (x, h [..., K1] / [..., N2]
    bf16, M = prod of leading dims <= 4; int4_g64 gate and up [*d, N1, K1], down [*d, N2,
    N1], or stacks read at `index`) in one call of the CUDA op (engine/kernels/cuda/
    int4_gemv.cu): gate|up and down as the wide GEMV computes them, SwiGLU between, the
    residual added. launches (MLP_LAUNCHES): 1, one launch of the persistent kernel
    (`int4_mlp_persistent`, a grid barrier between the GEMVs, down's first codes in flight
    across it); 2, `int4_mlp_gate_up` then `int4_mlp_down` chained by programmatic dependent
    launch (down's blocks fill their rings while gate|up's last blocks run); 3, those two in
    plain stream order. Each op rounded to bf16 as the separate calls round them; down's
    group sums of the activations come from per-tile sums (another order of the same fp32
    sums, so close to the separate calls, not bitwise). warps (4 or 8 a tile; gate|up's with
    2 launches, down's is 8), occupancy (resident warps an SM the registers are capped for:
    24 or 32); None: MLP_DEFAULTS. The model takes it through `layers.mlp_residual` (a plan's
    mlp "cuda") with 2 launches (H200: the persistent kernel is slower than the separate calls,
    two launches with programmatic dependent launch faster). corr: x's group sums [..., K1 / 64] where the caller has them
    (as `int4_gemv_multi` takes them)."""
    if (err := mlp_shape_error(x, h, gate, up, down)) is not None:
        raise ValueError(err)
    if launches not in MLP_LAUNCHES:
        raise ValueError(f"int4_mlp: launches {MLP_LAUNCHES}, got {launches}")
    warps, occupancy = _mlp_setting("int4_mlp", launches, warps, occupancy)
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
                     warps=np.int64(warps), occupancy=np.int64(occupancy),
                     launches=np.int64(launches))
    return out.reshape(*lead, n2)

