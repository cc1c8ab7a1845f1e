"""A decode step's MLP at the 27B's shapes (gate|up 34816 x 5120, down 5120 x 17408, int4_g64,
stacks of 4 layers read in place so that the L2 holds none of it): the CUDA MLP op
(`cuda_ops.int4_mlp`: two launches chained by programmatic dependent launch, a plan's mlp
"cuda") against the separate calls (the wide GEMV for gate|up, XLA's SwiGLU, the wide GEMV for
down, XLA's residual add: a plan's mlp "separate"). Per call: microseconds, bytes of codes
and scales per second over the measured copy rate, and the error against the first row (the
separate calls). The CUDA ops are built for --plan's cuda_arch and cuda_flags (engine/plan.py;
default h200) and the plan's XLA flags are set, as the engine would.

  python bench/mlp_micro.py --out mlp_micro.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.bench_27b import _random_qtensor, torch_peaks  # noqa: E402
from bench.kernels_micro import LAYERS, per_call  # noqa: E402
from bench.plan_args import add_plan_args, cuda_ops_status, plan_from_args  # noqa: E402
from engine.kernels import cuda_ops  # noqa: E402
from engine.plan import apply_process_settings  # noqa: E402

HIDDEN, INTER = 5120, 17408


def separate(x, h, gate, up, down, idx):
    g, u = cuda_ops.int4_gemv_multi(x, [gate, up], idx)
    return h + cuda_ops.int4_gemv(jax.nn.silu(g) * u, down, idx)


def run_impls(res, label, impls, args, idx, nbytes, copy, out):
    """Times each of impls (fn(*args, idx)) per call, with its error against the first one;
    a row each into res["rows"] (and `out`), printed as it comes."""
    want = None
    for name, fn in impls.items():
        try:
            got = jax.jit(fn)(*args, idx).astype(jnp.float32)
            want = got if want is None else want
            err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
            t = per_call(fn, *args, reps=7)
        except Exception as e:  # noqa: BLE001  (a failing variant is a result)
            print(f"{label} {name:>22}: {type(e).__name__} {str(e)[:300]}", flush=True)
            continue
        row = {"rows": args[0].shape[0], "impl": name, "us": t * 1e6,
               "bytes_per_s": nbytes / t, "fraction_of_copy": nbytes / t / copy,
               "rel_err_vs_first": err}
        res["rows"].append(row)
        print(f"{label} {name:>22}: {t * 1e6:8.1f} us {nbytes / t / 1e12:5.2f} TB/s "
              f"({row['fraction_of_copy'] * 100:4.0f}% of copy) err {err:.1e}", flush=True)
        Path(out).write_text(json.dumps(res, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--out", default="mlp_micro.json")
    add_plan_args(ap, "h200", "whose CUDA ops' build (cuda_arch, cuda_flags) "
                  "and XLA flags this process takes")
    args = ap.parse_args()
    plan = plan_from_args(args)
    apply_process_settings(plan)  # before JAX starts its backend
    peaks = torch_peaks()
    copy = peaks.get("torch_copy_bytes_per_s", 1.0)
    available, why = cuda_ops_status(plan)
    res = {"date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0].device_kind),
           "jax": jax.__version__, "python": platform.python_version(), "argv": sys.argv[1:],
           "plan": plan.describe(), "peaks": peaks, "cuda_available": available,
           "why_unavailable": why, "rows": []}
    if not res["cuda_available"]:
        print(f"CUDA op unavailable: {why}")
        Path(args.out).write_text(json.dumps(res, indent=2))
        return
    key = jax.random.key(0)
    gate, up, down = (_random_qtensor(jax.random.fold_in(key, i), (LAYERS, n, k), "int4_g64")
                      for i, (n, k) in enumerate(((INTER, HIDDEN), (INTER, HIDDEN),
                                                  (HIDDEN, INTER))))
    nbytes = sum(w.data.size + w.scale.size * 4 for w in (gate, up, down)) / LAYERS
    for m in [int(r) for r in args.rows.split(",")]:
        x = jax.random.normal(jax.random.key(m), (m, HIDDEN), jnp.bfloat16)
        h = jax.random.normal(jax.random.key(m + 10), (m, HIDDEN), jnp.bfloat16)
        idx = jnp.array([LAYERS - 1], jnp.int32)
        impls = {"separate": separate, "op": cuda_ops.int4_mlp}
        run_impls(res, f"M{m}", impls, (x, h, gate, up, down), idx, nbytes, copy, args.out)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
