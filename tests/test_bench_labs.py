"""The standalone CUDA labs under bench/ build with the toolkit's nvcc (they run on the GPU
machine only, bench/h200_session.sh part `chain`): a build break is caught here, not in the
device time."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)


@pytest.mark.skipif(_nvcc() is None, reason="needs the CUDA toolkit's nvcc")
def test_chain_lab_builds_and_refuses_unknown_arguments(tmp_path):
    out = tmp_path / "chain_lab"
    build = subprocess.run(
        [_nvcc(), "-O3", "-std=c++17", "-gencode", "arch=compute_90,code=sm_90",
         str(ROOT / "bench" / "chain_lab.cu"), "-o", str(out)],
        capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    # arguments are read before any CUDA call: a wrong one is a usage error on any machine
    bad = subprocess.run([str(out), "--layers", "4"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2
    assert "usage:" in bad.stderr and "--blocks" in bad.stderr and "--slice-kb" in bad.stderr
    # a malformed slice list and a flag without its value are usage errors too
    for args in (["--slice-kb", "6,x"], ["--slice-kb", "-4"], ["--reps"]):
        r = subprocess.run([str(out), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "usage:" in r.stderr, (args, r.returncode, r.stderr)


@pytest.mark.skipif(_nvcc() is None, reason="needs the CUDA toolkit's nvcc")
def test_gemm_arrangement_lab_builds_the_ops_source_and_refuses_unknown_arguments(tmp_path):
    """bench/lab/gemm_arrangement.cu includes engine/kernels/cuda/int4_gemv.cu whole and
    instantiates the GEMM under each warp arrangement it times."""
    import jax.ffi

    out = tmp_path / "gemm_arrangement"
    build = subprocess.run(
        [_nvcc(), "-O3", "-std=c++17", "-gencode", "arch=compute_90,code=sm_90",
         f"-I{jax.ffi.include_dir()}", str(ROOT / "bench" / "lab" / "gemm_arrangement.cu"),
         "-o", str(out)],
        capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    for args in (["--rows", "4"], ["--reps"], ["--json"]):
        r = subprocess.run([str(out), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "usage:" in r.stderr, (args, r.returncode, r.stderr)
