"""A small driver for profiling the int4 GEMV kernels with Nsight Compute on the GPU machine:
the int4_g64 matrices of the 27B decode step (lm_head 248320 x 5120, 0.7 GB: far past the L2;
a layer's in_proj, q|k|v and gate|up at K = 5120, down and out_proj), the wide tensor-core
kernel as the model calls it (warps by the call's tiles, registers capped) and with 4 and 8
warps to a tile, called a few times at M = 1, plus a plain device copy of the lm_head bytes for
comparison. The questions: what holds each shape under the copy rate (stall reasons, issue
use, achieved occupancy, waves), and does the warps' choice move it.

    ncu --clock-control none --kernel-name regex:'int4_gemv' \
        --launch-skip 0 --launch-count 48 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section SchedulerStats --section WarpStateStats --section LaunchStats --csv \
        python3 bench/ncu_gemv.py > ncu_gemv.csv

(--clock-control none: leave the clocks alone, METHOD.md; --shapes and --warps narrow the
run; --mlp adds the MLP op as the step calls it, its two launches, at the 27B's sizes; the CUDA
ops are built for --plan's cuda_arch and cuda_flags, default the h200 preset's, engine/plan.py,
and the plan's XLA flags are set.)
Without ncu it prints each variant's time and bytes/s, so it doubles as a quick check.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.bench_27b import _random_qtensor  # noqa: E402
from bench.plan_args import add_plan_args, cuda_ops_status, plan_from_args  # noqa: E402
from engine.kernels import cuda_ops, qgemv  # noqa: E402
from engine.plan import apply_process_settings  # noqa: E402

SHAPES = [("lm_head", 248320, 5120), ("gate|up", 34816, 5120), ("down", 5120, 17408),
          ("in_proj", 16480, 5120), ("q|k|v", 14336, 5120), ("out_proj", 5120, 6144)]
REPS = 2
WARPS = cuda_ops.WIDE_WARPS  # the warps to a tile each shape also runs with


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(s for s, _, _ in SHAPES),
                    help="comma-separated names from SHAPES")
    ap.add_argument("--warps", default="4,8", help="warps a tile to run beside the default "
                    f"(of {WARPS}; lm_head runs the default only)")
    ap.add_argument("--mlp", action="store_true", help="also the MLP op (`cuda_ops.int4_mlp`, "
                    "two launches: gate|up 34816 x 5120 with SwiGLU, down 5120 x 17408) at M = 1")
    add_plan_args(ap, "h200", "whose CUDA ops' build (cuda_arch, cuda_flags) "
                  "and XLA flags this process takes")
    args = ap.parse_args()
    plan = plan_from_args(args)
    apply_process_settings(plan)  # before JAX starts its backend
    available, why = cuda_ops_status(plan)
    shapes = args.shapes.split(",")
    warps = [int(w) for w in args.warps.split(",") if w]
    if bad := set(warps) - set(WARPS):
        ap.error(f"--warps: {sorted(bad)} not among {WARPS}")
    x_of = {}
    for shape, n, k in SHAPES:
        if shape not in shapes:
            continue
        w = _random_qtensor(jax.random.key(n), (n, k), "int4_g64")
        nbytes = w.data.size + w.scale.size * 4
        x = x_of.setdefault(k, jax.random.normal(jax.random.key(k), (1, k), jnp.bfloat16))
        # the default (warps by the call's tiles) and each warp count: which of them waits on
        # what
        variants = {"default": jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="wide"))}
        for wp in warps if shape != "lm_head" else ():
            variants[f"w{wp}"] = jax.jit(
                lambda x, w, wp=wp: cuda_ops.int4_gemv(x, w, variant="wide", warps=wp))
        if shape == "lm_head":
            variants["pallas"] = jax.jit(
                lambda x, w: qgemv.qmatmul(x, w, config=qgemv.default_config(w, 1)))
            variants["copy"] = jax.jit(lambda x, w: w.data + jnp.uint8(1))
        for name, fn in variants.items():
            if name not in ("pallas", "copy") and not available:
                print(f"{name}: CUDA op unavailable ({why})")
                continue
            t = per_call(fn, x, w)
            moved = 2 * w.data.size if name == "copy" else nbytes
            print(f"{shape:>8} {name:>8}: {t * 1e6:8.1f} us  {moved / t / 1e12:5.2f} TB/s",
                  flush=True)
        del w
    if args.mlp:
        time_mlp(available, why)


def per_call(fn, *args) -> float:
    """Seconds a call of fn(*args), over REPS calls after a first (the launches ncu sees)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(REPS):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / REPS


def time_mlp(available: bool, why: str) -> None:
    """The MLP op at the 27B's sizes, M = 1, as the decode step calls it (its two launches),
    REPS calls after a first."""
    if not available:
        print(f"mlp: CUDA op unavailable ({why})")
        return
    d, n1 = 5120, 17408
    gate, up, down = (_random_qtensor(jax.random.key(s), shape, "int4_g64")
                      for s, shape in ((1, (n1, d)), (2, (n1, d)), (3, (d, n1))))
    x = jax.random.normal(jax.random.key(4), (1, d), jnp.bfloat16)
    h = jax.random.normal(jax.random.key(5), (1, d), jnp.bfloat16)
    fn = jax.jit(cuda_ops.int4_mlp)
    t = per_call(fn, x, h, gate, up, down)
    nbytes = sum(w.data.size + w.scale.size * 4 for w in (gate, up, down))
    print(f"     mlp   op(2): {t * 1e6:8.1f} us  {nbytes / t / 1e12:5.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
