"""A decode step's MLP at the 27B's shapes (gate|up 34816 x 5120, down 5120 x 17408, int4_g64,
stacks of 4 layers read in place so that the L2 holds none of it): the CUDA MLP op
(`cuda_ops.int4_mlp`; launches 1: the persistent kernel, a grid barrier between the two
GEMVs; 2: two launches chained by programmatic dependent launch; 3: the two in stream order)
at several warps and register settings, against the separate calls (the wide GEMV for
gate|up, XLA's SwiGLU, the wide GEMV for down, XLA's residual add: NINFER_MLP_FUSED=0); then
the layer's whole second half (residual add, norm and MLP) as the block op
(`cuda_ops.int4_mlp_block`) against XLA's add and norm before the MLP, and the same with the
mixer's output projection (6144 -> 5120) first. Per call: microseconds,
bytes of codes and scales per second over the measured copy rate, and the error against the
first row of the same comparison.

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
from engine.kernels import cuda_ops  # noqa: E402
from engine.norms import rms_norm  # noqa: E402

HIDDEN, INTER = 5120, 17408
PROJ_IN = 6144  # the mixers' outputs before their projections (GDN value dim, attention heads)


def separate(x, h, gate, up, down, idx):
    g, u = cuda_ops.int4_gemv_multi(x, [gate, up], idx)
    return h + cuda_ops.int4_gemv(jax.nn.silu(g) * u, down, idx)


EPS = 1e-6


def block_impls(variants: str, proj: bool) -> dict:
    """A layer's second half (y = x + hm; y + MLP(rms_norm(y))), each fn(x, hm, w, gate, up,
    down, idx), or with `proj` the mixer's output projection first (y = x + wo a), each fn(x,
    a, w, gate, up, down, wo, idx): XLA's add and norm (after the wide GEMV for wo) before the
    separate calls or the two-launch MLP op, and the block op (`int4_mlp_block`, chained
    launches; `proj=wo`) at each "warps/occupancy[+l2]"."""
    def xla_norm(mlp_fn):
        def fn(x, hm, w, g, u, d, *rest):
            *wo, i = rest
            y = x + (cuda_ops.int4_gemv(hm, wo[0], i) if proj else hm)
            return mlp_fn(rms_norm(y, w, EPS), y, g, u, d, i)
        return fn

    pre = "proj+" if proj else ""
    impls = {f"{pre}norm+separate": xla_norm(separate),
             f"{pre}norm+pdl_w8o32": xla_norm(lambda *a: cuda_ops.int4_mlp(*a, launches=2))}
    for v in variants.split(","):
        setting, l2 = v.removesuffix("+l2"), v.endswith("+l2")
        wp, occ = (int(a) for a in setting.split("/"))

        def block(x, hm, w, g, u, d, *rest, wp=wp, occ=occ, l2=l2):
            *wo, i = rest
            return cuda_ops.int4_mlp_block(x, hm, w, EPS, g, u, d, i,
                                           proj=wo[0] if proj else None, warps=wp,
                                           occupancy=occ, l2_prefetch=l2)
        impls[f"block{'_proj' if proj else ''}_w{wp}o{occ}{'_l2' if l2 else ''}"] = block
    return impls


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
    ap.add_argument("--variants", default="1:8/24,2:8/32,2:8/32+l2,2:4/24,3:8/32,3:8/32+l2",
                    help="launches:warps/occupancy[+l2] of the MLP op (launches 1: the "
                         "persistent kernel; 2: two launches chained by programmatic dependent "
                         "launch; 3: the two in stream order; +l2: down's tiles asked into L2 "
                         "before the wait)")
    ap.add_argument("--blocks", default="8/32,8/32+l2,4/24",
                    help="warps/occupancy[+l2] of the MLP block op (the residual add and norm "
                         "too), against XLA's add and norm before the MLP")
    ap.add_argument("--out", default="mlp_micro.json")
    args = ap.parse_args()
    peaks = torch_peaks()
    copy = peaks.get("torch_copy_bytes_per_s", 1.0)
    res = {"date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0].device_kind),
           "jax": jax.__version__, "python": platform.python_version(), "argv": sys.argv[1:],
           "peaks": peaks, "cuda_available": cuda_ops.available(), "rows": []}
    if not res["cuda_available"]:
        print(f"CUDA op unavailable: {cuda_ops.why_unavailable()}")
        Path(args.out).write_text(json.dumps(res, indent=2))
        return
    key = jax.random.key(0)
    gate, up, down = (_random_qtensor(jax.random.fold_in(key, i), (LAYERS, n, k), "int4_g64")
                      for i, (n, k) in enumerate(((INTER, HIDDEN), (INTER, HIDDEN),
                                                  (HIDDEN, INTER))))
    nbytes = sum(w.data.size + w.scale.size * 4 for w in (gate, up, down)) / LAYERS
    wo = _random_qtensor(jax.random.fold_in(key, 3), (LAYERS, HIDDEN, PROJ_IN), "int4_g64")
    for m in [int(r) for r in args.rows.split(",")]:
        x = jax.random.normal(jax.random.key(m), (m, HIDDEN), jnp.bfloat16)
        h = jax.random.normal(jax.random.key(m + 10), (m, HIDDEN), jnp.bfloat16)
        idx = jnp.array([LAYERS - 1], jnp.int32)
        impls = {"separate": separate}
        for v in args.variants.split(","):
            n, setting = v.split(":")
            setting, l2 = setting.removesuffix("+l2"), setting.endswith("+l2")
            wp, occ = (int(a) for a in setting.split("/"))
            name = {"1": "persistent", "2": "pdl", "3": "two"}[n]
            impls[f"{name}_w{wp}o{occ}{'_l2' if l2 else ''}"] = (
                lambda x, h, g, u, d, i, n=int(n), wp=wp, occ=occ, l2=l2: cuda_ops.int4_mlp(
                    x, h, g, u, d, i, warps=wp, occupancy=occ, launches=n, l2_prefetch=l2))
        run_impls(res, f"M{m}", impls, (x, h, gate, up, down), idx, nbytes, copy, args.out)
        if args.blocks:
            hm = jax.random.normal(jax.random.key(m + 20), (m, HIDDEN), jnp.bfloat16)
            w = 0.1 * jax.random.normal(jax.random.key(m + 30), (HIDDEN,), jnp.float32)
            run_impls(res, f"M{m} block", block_impls(args.blocks, False),
                      (x, hm, w, gate, up, down), idx, nbytes, copy, args.out)
            a = jax.random.normal(jax.random.key(m + 40), (m, PROJ_IN), jnp.bfloat16)
            run_impls(res, f"M{m} proj", block_impls(args.blocks, True),
                      (x, a, w, gate, up, down, wo), idx,
                      nbytes + (wo.data.size + wo.scale.size * 4) / LAYERS, copy, args.out)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
