"""The CUDA int4_g64 GEMV (engine/kernels/cuda_ops.py) against the Pallas one, at every matrix
shape of a qwen3.8-27b decode step, on one GPU: achieved bytes/s of int4 codes + scales over the
measured copy bandwidth, per rows of x (M) and CUDA kernel ("fma", "mma", and "wide" at the
warps a tile `wide_warps` picks or at 4 or 8). Weights are stacks of 4 layers
read in place through the layer index (the model's access), so the 60 MB L2 cannot hold them.
Also checks each CUDA result against the reference (`linear`) before timing it. The CUDA
op is built for --plan's cuda_arch and cuda_flags (engine/plan.py; default h200) and the plan's
XLA flags are set, as the engine would.

  python bench/cuda_gemv_micro.py --out cuda_gemv_micro.json
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
from bench.kernels_micro import LAYERS, call_loop, per_call, traced_kernels  # noqa: E402
from bench.plan_args import add_plan_args, cuda_ops_status, plan_from_args  # noqa: E402
from engine.kernels import cuda_ops, qgemv  # noqa: E402
from engine.kernels.stacked import Stacked  # noqa: E402
from engine.model.linear import linear  # noqa: E402
from engine.plan import apply_process_settings  # noqa: E402

# (name, N, K) of one decode step's matrices (GDN layers x48, attention x16, lm_head x1), and
# the concatenations the step launches
SHAPES = [("gdn in_proj_qkv", 10240, 5120), ("gdn in_proj_z", 6144, 5120),
          ("gdn out_proj", 5120, 6144), ("mlp gate/up", 17408, 5120),
          ("mlp down", 5120, 17408), ("attn q(+gate)", 12288, 5120), ("attn k/v", 1024, 5120),
          ("attn o_proj", 5120, 6144), ("gdn in_proj_b/a", 48, 5120), ("lm_head", 248320, 5120),
          # as the step launches them: a layer's projections of one input in one call
          ("gdn in_proj qkv|z|b|a", 16480, 5120), ("mlp gate|up", 34816, 5120),
          ("attn q|k|v", 14336, 5120)]


def kernel_us(one, x, w, layers: int) -> float | None:
    """Microseconds a launch of the int4 GEMV kernel takes inside per_call's loop, from a
    profiler trace of two runs of the loop."""
    rows = traced_kernels(call_loop(one, x, w, layers=layers), x, w)
    hits = [r for r in rows if "int4_gemv" in r["kernel"]]
    calls = sum(r["calls"] for r in hits)
    return sum(r["us"] for r in hits) / calls if calls else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--kernels", default="fma,mma,wide", help="the CUDA kernels to time "
                    "(comma-separated of fma, mma, wide; '' for none); wide only at M <= 4")
    ap.add_argument("--wide-warps", default="auto", help="warps to a 16-row tile of the wide "
                    "kernel, comma-separated of auto (`wide_warps`, by the shape: the model's), "
                    "4 and 8")
    ap.add_argument("--no-pallas", action="store_true", help="leave out the Pallas kernel")
    ap.add_argument("--shapes", default="", help="comma-separated indices into SHAPES")
    ap.add_argument("--layers", type=int, default=LAYERS, help="stacked layers the calls cycle "
                    "over (1: every call reads the same layer, which the L2 holds where it "
                    "fits: the kernel's time without the HBM's latency)")
    ap.add_argument("--kernel-times", action="store_true", help="also the GEMV kernel's own "
                    "time a launch, from a profiler trace of the timed loop (per_call's time "
                    "includes the loop's and the dispatch's)")
    ap.add_argument("--nk", default="", help="matrices N x K to time in place of SHAPES, e.g. "
                    "4224x5120,8448x5120: a sweep of N at one K separates a call's fixed cost "
                    "(ramp, tail) from its rate and shows the waves of 16-row tiles")
    ap.add_argument("--out", default="cuda_gemv_micro.json")
    add_plan_args(ap, "h200", "whose CUDA op's build (cuda_arch, cuda_flags) "
                  "and XLA flags this process takes")
    args = ap.parse_args()
    if bad := {v for v in args.kernels.split(",") if v} - set(cuda_ops.VARIANTS):
        ap.error(f"--kernels: {sorted(bad)} not among {cuda_ops.VARIANTS}")
    if bad := {v for v in args.wide_warps.split(",") if v} - {"auto", "4", "8"}:
        ap.error(f"--wide-warps: {sorted(bad)} not among auto, 4, 8")
    plan = plan_from_args(args)
    apply_process_settings(plan)  # before JAX starts its backend
    peaks = torch_peaks()
    available, why = cuda_ops_status(plan)
    res = {"date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0].device_kind),
           "jax": jax.__version__, "python": platform.python_version(), "argv": sys.argv[1:],
           "plan": plan.describe(), "peaks": peaks, "cuda_available": available,
           "why_unavailable": why, "rows": []}
    copy = peaks.get("torch_copy_bytes_per_s", 1.0)
    print(f"copy {copy / 1e12:.2f} TB/s; CUDA op available: {res['cuda_available']} "
          f"{res['why_unavailable']}", flush=True)
    picks = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    if args.nk:
        picks = [(f"{n}x{k}", int(n), int(k))
                 for n, k in (v.split("x") for v in args.nk.split(",") if v)]
    for name, n, k in picks:
        layers = args.layers if n * k < 1e9 else 1
        w = _random_qtensor(jax.random.key(n + k), (layers, n, k), "int4_g64")
        nbytes = (w.data.size + w.scale.size * 4) / layers
        for m in [int(r) for r in args.rows.split(",")]:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            ref = linear(x, Stacked(w, jnp.array([layers - 1], jnp.int32)).materialize())
            variants = {} if args.no_pallas else {"pallas": None}
            kernels = [v for v in args.kernels.split(",") if v]
            variants.update({v: (v, None) for v in kernels if v in ("fma", "mma")})
            if "wide" in kernels and m <= cuda_ops.WIDE_MAX_M:
                variants.update({"wide" if wp == "auto" else f"wide_w{wp}":
                                 ("wide", None if wp == "auto" else int(wp))
                                 for wp in args.wide_warps.split(",") if wp})
            for impl, spec in variants.items():
                if spec is not None and not res["cuda_available"]:
                    continue

                def one(x, w, idx, spec=spec):
                    if spec is None:
                        return qgemv.qmatmul(x, w, idx, config=qgemv.default_config(w, m))
                    return cuda_ops.int4_gemv(x, w, idx, variant=spec[0], warps=spec[1])

                try:
                    got = jax.jit(one)(x, w, jnp.array([layers - 1], jnp.int32))
                    err = float(jnp.linalg.norm((got - ref).astype(jnp.float32))
                                / jnp.linalg.norm(ref.astype(jnp.float32)))
                    t = per_call(one, x, w, layers=layers, reps=7)
                except Exception as e:  # noqa: BLE001  (a failing variant is a result)
                    print(f"{name:>16} {n:>6}x{k:<5} M{m} {impl:>8}: {type(e).__name__} "
                          f"{str(e)[:200]}", flush=True)
                    continue
                kern = kernel_us(one, x, w, layers) if args.kernel_times else None
                row = {"matrix": name, "n": n, "k": k, "rows": m, "impl": impl, "layers": layers,
                       "us": t * 1e6,
                       "bytes_per_s": nbytes / t, "fraction_of_copy": nbytes / t / copy,
                       "rel_err_vs_reference": err}
                if kern:
                    row.update(kernel_us=kern, kernel_bytes_per_s=nbytes / (kern * 1e-6))
                    print(f"{name:>16} {n:>6}x{k:<5} M{m} {impl:>8}: kernel {kern:8.2f} us "
                          f"{nbytes / kern / 1e6:5.2f} TB/s a launch (layers {layers})",
                          flush=True)
                res["rows"].append(row)
                print(f"{name:>16} {n:>6}x{k:<5} M{m} {impl:>8}: {t * 1e6:8.1f} us "
                      f"{nbytes / t / 1e12:5.2f} TB/s ({row['fraction_of_copy'] * 100:4.0f}% of "
                      f"copy) err {err:.1e}", flush=True)
                Path(args.out).write_text(json.dumps(res, indent=2))
        del w
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
