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
INT4_GEMM_TARGET = "ninfer_int4_gemm"
# every FFI target the library registers, with its handler's symbol
_SYMBOLS = {INT4_TARGET: "NinferInt4Gemv", INT4_MMA_TARGET: "NinferInt4GemvMma",
            INT4_WIDE_TARGET: "NinferInt4GemvWide", INT4_MLP_TARGET: "NinferInt4Mlp",
            INT4_GEMM_TARGET: "NinferInt4Gemm"}
FFI_TARGETS = tuple(_SYMBOLS)


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
    h.update(nvcc_version(nvcc).encode())
    h.update(arch.encode())
    h.update(json.dumps(list(flags)).encode())
    return cache_dir() / f"{source.stem}-sm{arch}-{h.hexdigest()[:16]}.so"


def build(source: Path, arch: str, nvcc: str,
          flags: tuple[str, ...] = ("-O3", "-std=c++17"), out: Path | None = None) -> Path:
    """Compile `source` for sm_`arch` into the cache (nothing to do when it is there), or into
    `out`. Returns the path. The build is byte-reproducible: nvcc names its intermediate files
    after its process id and embeds those names, so it runs in a build directory of its own
    with its intermediates kept there under fixed names (`--keep --keep-dir .`)."""
    out = out or library_path(source, arch, nvcc, flags)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    work = tempfile.mkdtemp(dir=out.parent, prefix=".build-")
    try:
        cmd = [nvcc, *flags, "--shared", "-Xcompiler", "-fPIC", "--keep", "--keep-dir", ".",
               f"-gencode=arch=compute_{arch},code=sm_{arch}",
               f"-I{jax.ffi.include_dir()}", str(Path(source).resolve()), "-o", "lib.so"]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed ({res.returncode}): {res.stderr[-2000:]}")
        os.chmod(Path(work) / "lib.so", 0o755)
        os.replace(Path(work) / "lib.so", out)  # atomic: readers see nothing or all of it
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def nvcc_version(nvcc: str) -> str:
    """The compiler's release line ("Cuda compilation tools, release 13.0, V13.0.88")."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-2] if len(out.strip().splitlines()) > 1 else out.strip()


def fatbin_archs(library: Path) -> dict[str, set[int]]:
    """What the library's embedded fatbinary holds: {"sm": {86, ...}} for compiled code (ELF
    entries) and {"ptx": {...}} for PTX, read from its ELF `.nv_fatbin` section (the fatbinary
    container: magic 0xBA55ED50, then entries of kind 1 PTX / 2 ELF, each with its arch)."""
    import struct

    data = Path(library).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{library}: not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i):
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)

    names = section(shstrndx)[4]
    found = {"sm": set(), "ptx": set()}
    for i in range(shnum):
        sec = section(i)
        name = data[names + sec[0]:data.index(b"\0", names + sec[0])]
        if name != b".nv_fatbin":
            continue
        pos, stop = sec[4], sec[4] + sec[5]
        while pos + 16 <= stop:
            magic, _, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
            if magic != 0xBA55ED50:
                break
            p, end = pos + hsize, pos + hsize + fsize
            while p < end:
                kind, _, ehsize, esize = struct.unpack_from("<HHIQ", data, p)
                arch, = struct.unpack_from("<I", data, p + 28)
                found["ptx" if kind == 1 else "sm"].add(arch)
                p += ehsize + esize
            pos = end
    return found


_LOCK = threading.Lock()
_LOADED: dict[tuple, Path] = {}  # (arch, flags) -> the library registered in this process


def _register(lib) -> None:
    for target, symbol in _SYMBOLS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="CUDA")


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
