"""The CUDA ops' shared library: built with nvcc, cached, registered with the XLA FFI.

The library is compiled from engine/kernels/cuda/ with the machine's `nvcc` (`NVCC`, else the
PATH's, else /usr/local/cuda/bin/nvcc) for the kernel plan's architecture and flags
(engine/plan.py `cuda_arch`, `cuda_flags`), into a cache named by a digest of the source, the
FFI headers, the compiler, the architecture and the flags (`NINFER_CUDA_CACHE`, default
~/.cache/ninfer/cuda), and published atomically, so concurrent processes never load a
half-written file. `require(plan)` builds and registers it before a plan that names the ops
runs, and raises `CudaUnavailable` with the reason where it cannot (no GPU, another GPU
architecture, no nvcc, a failed build): a plan is never served by another kernel. The calls
themselves are in engine/kernels/cuda_ops.py.
"""
from __future__ import annotations

import ctypes
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

log = logging.getLogger("ninfer.cuda_ops")

SOURCE_DIR = Path(__file__).resolve().parent / "cuda"
INT4_SOURCE = SOURCE_DIR / "int4_gemv.cu"
# the FFI targets the library registers (engine/kernels/cuda_ops.py calls them)
INT4_TARGET = "ninfer_int4_gemv"
INT4_MMA_TARGET = "ninfer_int4_gemv_mma"
INT4_WIDE_TARGET = "ninfer_int4_gemv_wide"
INT4_MLP_TARGET = "ninfer_int4_mlp"


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
