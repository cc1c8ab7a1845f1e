"""A small driver for profiling the int4 GEMV kernels with Nsight Compute on the GPU machine:
int4_g64 matrices of the 27B decode step (lm_head 248320 x 5120, 0.7 GB: far past the L2; a
layer's gate|up 34816 x 5120 and down 5120 x 17408), each variant of the wide tensor-core
kernel (the default; its registers capped for 32 resident warps an SM, `occupancy=32`; two
warps to a tile; the shared-memory ring of 4 pairs, `stages=4`) called a few times at M = 1, plus a plain device copy of the lm_head bytes
for comparison. The questions: what holds the default at 2.2-2.9 TB/s (stall reasons, issue
use, achieved occupancy), and does either change move it.

    ncu --clock-control none --kernel-name regex:'int4_gemv' \
        --launch-skip 0 --launch-count 48 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section SchedulerStats --section WarpStateStats --csv \
        python3 bench/ncu_gemv.py > ncu_gemv.csv

(--clock-control none: leave the clocks alone, METHOD.md.) Without ncu it prints each
variant's time and bytes/s, so it doubles as a quick check.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.bench_27b import _random_qtensor  # noqa: E402
from engine.kernels import cuda_ops, qgemv  # noqa: E402

SHAPES = [("lm_head", 248320, 5120), ("gate|up", 34816, 5120), ("down", 5120, 17408)]
REPS = 3


def main() -> None:
    x_of = {}
    for shape, n, k in SHAPES:
        w = _random_qtensor(jax.random.key(n), (n, k), "int4_g64")
        nbytes = w.data.size + w.scale.size * 4
        x = x_of.setdefault(k, jax.random.normal(jax.random.key(k), (1, k), jnp.bfloat16))
        variants = {
            "wide": jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="wide", bias=0,
                                                            warps=8, occupancy=0)),
            "wide_o32": jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="wide", bias=0,
                                                                warps=8, occupancy=32)),
            "wide_w2": jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="wide", bias=0,
                                                               warps=2, occupancy=0)),
            "wide_ring4": jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="wide", bias=0,
                                                                  warps=8, stages=4)),
        }
        if shape == "lm_head":
            variants["pallas"] = jax.jit(
                lambda x, w: qgemv.qmatmul(x, w, config=qgemv.default_config(w, 1)))
            variants["copy"] = jax.jit(lambda x, w: w.data + jnp.uint8(1))
        for name, fn in variants.items():
            if name not in ("pallas", "copy") and not cuda_ops.available():
                print(f"{name}: CUDA op unavailable ({cuda_ops.why_unavailable()})")
                continue
            jax.block_until_ready(fn(x, w))
            t0 = time.perf_counter()
            for _ in range(REPS):
                out = fn(x, w)
            jax.block_until_ready(out)
            t = (time.perf_counter() - t0) / REPS
            moved = 2 * w.data.size if name == "copy" else nbytes
            print(f"{shape:>8} {name:>8}: {t * 1e6:8.1f} us  {moved / t / 1e12:5.2f} TB/s",
                  flush=True)
        del w


if __name__ == "__main__":
    main()
