"""The int4_g64 GEMM for prefill pieces (engine/kernels/qgemm.py; with --cuda also the CUDA op's,
engine/kernels/cuda_ops.py `int4_gemm_multi`, config "cuda", for pieces of up to 64 rows)
against what a prefill piece ran before it (dequantize the layer's int4 weight to bf16, then
XLA's matmul), at the 27B's
prefill matrix shapes and piece widths M, on one GPU. Weights are stacks of 4 layers read
through the layer index (the model's access), so the L2 cannot hold them across calls. Each
kernel result is checked against the reference before it is timed.

Figures: ms a call; the int4 bytes (codes + scales) over the time as a fraction of the measured
copy bandwidth; 2 M N K over the time as a fraction of the measured bf16 matmul rate.

  python bench/gemm_micro.py --out gemm_micro.json [--configs 64,64,2,264,4,3;...] [--cuda]
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
import numpy as np  # noqa: E402

from bench.bench_27b import _random_qtensor, ceilings  # noqa: E402
from bench.kernels_micro import per_call  # noqa: E402
from engine.kernels import qgemm  # noqa: E402
from engine.kernels.stacked import Stacked  # noqa: E402
from engine.model.linear import linear  # noqa: E402
from engine.ops.quant import INT4_G64  # noqa: E402

LAYERS = 4
# (name, N, K): the int4 matrices a 27B prefill piece multiplies (GDN x48, MLP x64, attention
# x16; in_proj_b/a, N = 48, stay on the reference)
SHAPES = [("gdn in_proj_qkv", 10240, 5120), ("gdn in_proj_z", 6144, 5120),
          ("gdn out_proj", 5120, 6144), ("mlp gate/up", 17408, 5120),
          ("mlp down", 5120, 17408), ("attn q(+gate)", 12288, 5120), ("attn k/v", 1024, 5120)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,256,1024,2048", help="piece widths M")
    ap.add_argument("--shapes", default="", help="comma-separated indices into SHAPES")
    ap.add_argument("--configs", default="", help="';'-separated bm,bn,gb,programs,warps,"
                    "stages to time beside the default")
    ap.add_argument("--cuda", action="store_true", help="time the CUDA op's GEMM too (built "
                    "for the h200 plan)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="gemm_micro.json")
    a = ap.parse_args()
    peaks = ceilings()
    configs = [qgemm.DEFAULT] + [qgemm.GemmConfig(*(int(v) for v in c.split(",")))
                                 for c in a.configs.split(";") if c]
    if a.cuda:
        from engine.kernels import cuda_ops
        from engine.plan import H200
        cuda_ops.require(H200)
        configs.append("cuda")
    shapes = [SHAPES[int(i)] for i in a.shapes.split(",")] if a.shapes else SHAPES
    res = {"date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0]),
           "jax": jax.__version__, "host": platform.node(), "peaks": peaks, "rows": []}
    copy, mm = peaks.get("copy_bytes_per_s"), peaks.get("bf16_flops_per_s")
    print(f"peaks: {peaks}")
    print(f"{'shape':<16} {'M':>5} {'config':<22} {'ms':>8} {'ref ms':>8} {'x ref':>6} "
          f"{'bw':>5} {'mm':>5}")
    for name, n, k in shapes:
        w = _random_qtensor(jax.random.key(n + k), (LAYERS, n, k), INT4_G64)
        nbytes = (w.data.size + w.scale.size * 4) // LAYERS
        for m in (int(r) for r in a.rows.split(",") if r):
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)

            def ref(x, w, idx):
                return linear(x, Stacked(w, idx).materialize())
            t_ref = per_call(ref, x, w, layers=LAYERS, reps=a.reps)
            want = np.asarray(jax.jit(ref)(x, w, jnp.zeros((1,), jnp.int32)), np.float32)
            for cfg in configs:
                if cfg == "cuda":
                    if not cuda_ops.gemm_takes(x, [w], 1):
                        continue

                    def kern(x, w, idx):
                        return cuda_ops.int4_gemm_multi(x, [w], idx)[0]
                elif not qgemm.takes(x, w, 1, cfg):
                    continue
                else:
                    def kern(x, w, idx, cfg=cfg):
                        return qgemm.int4_matmul(x, w, idx, config=cfg)
                got = np.asarray(jax.jit(kern)(x, w, jnp.zeros((1,), jnp.int32)), np.float32)
                err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
                t = per_call(kern, x, w, layers=LAYERS, reps=a.reps)
                row = {"shape": name, "n": n, "k": k, "m": m,
                       "config": ["cuda"] if cfg == "cuda" else list(cfg.__dict__.values()),
                       "ms": t * 1e3,
                       "ref_ms": t_ref * 1e3, "speedup": t_ref / t, "rel_err": err,
                       "bw_fraction": nbytes / t / copy if copy else None,
                       "mm_fraction": 2 * m * n * k / t / mm if mm else None,
                       "ref_mm_fraction": 2 * m * n * k / t_ref / mm if mm else None}
                res["rows"].append(row)
                cs = ",".join(str(v) for v in row["config"])
                print(f"{name:<16} {m:>5} {cs:<22} {t * 1e3:8.3f} {t_ref * 1e3:8.3f} "
                      f"{t_ref / t:6.2f} {row['bw_fraction'] or 0:5.2f} "
                      f"{row['mm_fraction'] or 0:5.2f}  err {err:.1e}", flush=True)
                Path(a.out).write_text(json.dumps(res, indent=1))
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
