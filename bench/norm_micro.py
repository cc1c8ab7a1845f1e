"""The fused decode norms (engine/kernels/norm_sums.py) against what XLA makes of the same
work, in a loop of back-to-back calls inside one jit (each call's time with the launch gap, as
in a decode step's graph), at the 27B's shapes:

  rms_add   s = x + h, rms_norm(s, w[layer]), group sums   (the post-mixer norm)
  rms       rms_norm(x, w[layer]), group sums               (a mixer's input norm)
  gated     the GDN output's gated norm, group sums

    python3 bench/norm_micro.py --rows 1,2 --tiles 16,16 8,8 4,8 --out $OUT/norm_micro.json

--tiles: "rms,gated" groups (rms) and heads (gated) a program, set in `norm_sums.TILES` for
that run (the kernels' default is 4,4). The process takes --plan's XLA flags (engine/plan.py;
default h200: XLA's CUDA graphs, as the engine's decode step runs under them).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from bench.plan_args import add_plan_args, plan_from_args  # noqa: E402
from engine.kernels import norm_sums as N  # noqa: E402
from engine.plan import apply_process_settings  # noqa: E402

H, HV, DV, Z_AT, P, LAYERS = 5120, 48, 128, 10240, 16480, 64


def _loop(step, carry, n):
    """n calls unrolled in one jit (a device loop would sync with the host every iteration);
    the layer index traced (base + i), as the decode step's scan has it."""
    def run(c, base):
        for i in range(n):
            c = step(base + i, c)
        return c
    return jax.jit(run)


def cases(m, fused: bool):
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (m, 1, H), jnp.bfloat16)
    w = jax.random.normal(key, (LAYERS, H), jnp.bfloat16) * 0.1
    wg = jax.random.normal(key, (LAYERS, DV), jnp.bfloat16)
    out = jax.random.normal(key, (m, 1, HV, DV), jnp.float32)
    proj = jax.random.normal(key, (m, 1, P), jnp.bfloat16)

    def rms_add(i, c):
        x, h = c
        idx = jnp.reshape(i % LAYERS, (1,))
        if fused:
            s, y, sums = N.rms_norm_sums(x, w, 1e-6, h, index=idx)
        else:
            s, y, sums = N.rms_norm_sums_ref(x, lax.dynamic_index_in_dim(w, i % LAYERS, 0, False),
                                             1e-6, h)
        return s, (y + sums[..., :1].astype(y.dtype) * 0)

    def rms(i, c):
        idx = jnp.reshape(i % LAYERS, (1,))
        if fused:
            _, y, sums = N.rms_norm_sums(c, w, 1e-6, index=idx)
        else:
            _, y, sums = N.rms_norm_sums_ref(c, lax.dynamic_index_in_dim(w, i % LAYERS, 0, False),
                                             1e-6)
        return y + sums[..., :1].astype(y.dtype) * 0

    def gated(i, c):
        o, p = c
        idx = jnp.reshape(i % LAYERS, (1,))
        if fused:
            y, sums = N.gated_norm_sums(o, p, Z_AT, wg, 1e-6, index=idx)
        else:
            z = p[:, :, Z_AT:Z_AT + HV * DV].reshape(m, 1, HV, DV)
            y, sums = N.gated_norm_sums_ref(o, z, lax.dynamic_index_in_dim(wg, i % LAYERS, 0,
                                                                           False), 1e-6)
        return o + y.astype(o.dtype) * 1e-3 + sums[..., :1, None] * 0, p

    return {"rms_add": (rms_add, (x, x)), "rms": (rms, x), "gated": (gated, (out, proj))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--tiles", nargs="*", default=["4,4", "16,16"])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default="norm_micro.json")
    add_plan_args(ap, "h200", "whose XLA flags this process takes")
    a = ap.parse_args()
    apply_process_settings(plan_from_args(a))  # before JAX starts its backend
    res = {"device": str(jax.devices()[0]), "jax": jax.__version__,
           "date": time.strftime("%Y-%m-%d"), "calls": a.calls, "rows": []}
    default_tiles = dict(N.TILES)
    for m in (int(r) for r in a.rows.split(",")):
        for setting in ["xla"] + a.tiles:
            N.TILES.update(default_tiles)
            if setting != "xla":  # read by the kernels' wrappers when a loop is traced
                rms, gated = (int(v) for v in setting.split(","))
                N.TILES.update(rms=rms, gated=gated)
            for name, (step, carry) in cases(m, setting != "xla").items():
                fn = _loop(step, carry, a.calls)
                base = jnp.int32(3)
                jax.block_until_ready(fn(carry, base))
                best = 1e9
                for _ in range(5):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(carry, base))
                    best = min(best, time.perf_counter() - t0)
                us = best / a.calls * 1e6
                res["rows"].append({"m": m, "impl": setting, "case": name, "us_per_call": us})
                print(f"M={m} {setting:>6} {name:8s} {us:7.2f} us a call", flush=True)
    N.TILES.update(default_tiles)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
