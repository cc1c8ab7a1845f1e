"""Decode and prefill of the qwen3.8-27b shapes with synthetic weights, on one GPU.

Builds random bf16 weights directly on the device (no download, nothing on the host), then times
the engine's own jitted forward: decode steps at several context lengths and a prefill. Every
figure is reported with its fraction of the physical limit measured in the same run:

  decode bytes  = every weight byte read once + KV read at that context + GDN state read+written
  prefill FLOPs = 2 x params used per token x T + attention (causal: 2 x 2 x T^2/2 x heads x hd
                  per attention layer)

  python bench/bench_27b.py --contexts 1024,32768 --prefill 8192 --out results.json
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

from engine import model as M  # noqa: E402
from engine.config import QWEN38_27B, preset  # noqa: E402


def timed(fn, *args, reps: int, warmup: int = 2):
    out = None
    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def peaks() -> dict:
    n = 1 << 30  # 2 GiB of bf16
    x = jax.random.normal(jax.random.key(1), (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * jnp.bfloat16(1.0009765625))
    timed(copy, x, reps=20, warmup=5)  # let the clocks ramp up from idle first
    t, _ = timed(copy, x, reps=20)
    bw = 2 * n * 2 / t
    del x
    a = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(3), (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    t, _ = timed(mm, a, b, reps=10)
    return {"copy_bytes_per_s": bw, "bf16_flops_per_s": 2 * 8192 ** 3 / t}


def random_params(cfg, dtype):
    """The stacked parameter tree with random values, created on the device leaf by leaf."""
    specs = cfg.tensor_specs()
    flat = {n: jax.ShapeDtypeStruct(s, dtype) for n, s in specs.items()}
    shapes = jax.eval_shape(lambda f: M.stack_params(f, cfg), flat)
    leaves, tree = jax.tree.flatten(shapes)
    out = []
    for i, leaf in enumerate(leaves):
        fan_in = leaf.shape[-1]
        scale = 1.0 / np.sqrt(fan_in) if len(leaf.shape) >= 2 else 0.1
        make = jax.jit(lambda k, s=leaf.shape, sc=scale: (
            jax.random.normal(k, s, jnp.float32) * sc).astype(dtype))
        out.append(make(jax.random.key(100 + i)))
    return jax.tree.unflatten(tree, out)


def random_cache(cfg, ctx: int, dtype, batch: int = 1):
    """A cache whose first ctx positions hold random K/V and random GDN state (never zeros)."""
    c = M.init_cache(cfg, batch, ctx + 16, dtype)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(7), 4)
    return c._replace(
        k=jax.random.normal(k1, c.k.shape, dtype), v=jax.random.normal(k2, c.v.shape, dtype),
        conv=jax.random.normal(k3, c.conv.shape, dtype) * 0.1,
        rec=jax.random.normal(k4, c.rec.shape, jnp.float32) * 0.01,
        pos=jnp.full((batch,), ctx, jnp.int32))


def random_paged_cache(cfg, ctx: int, dtype, batch: int = 1):
    """A paged cache: each row owns consecutive pages holding ctx random K/V tokens."""
    from engine import paged_kv as pk

    per_row = pk.kv_pages_needed(ctx + 16)
    pool = pk.init_kv_pool(cfg, batch * per_row, pk.PAGE_SIZE, dtype)
    k1, k2 = jax.random.split(jax.random.key(8))
    pool = pool._replace(k=jax.random.normal(k1, pool.k.shape, dtype),
                         v=jax.random.normal(k2, pool.v.shape, dtype))
    table = np.arange(batch * per_row, dtype=np.int32).reshape(batch, per_row)
    c = M.init_paged_cache(cfg, pool, table, dtype)
    k3, k4 = jax.random.split(jax.random.key(9))
    return c._replace(conv=jax.random.normal(k3, c.conv.shape, dtype) * 0.1,
                      rec=jax.random.normal(k4, c.rec.shape, jnp.float32) * 0.01,
                      pos=jnp.full((batch,), ctx, jnp.int32))


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--prefill", default="8192")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", default="1", help="decode batch sizes, e.g. 1,2")
    ap.add_argument("--out", default="bench_27b.json")
    ap.add_argument("--preset", default=QWEN38_27B.name, help="model preset (tiny ones for a "
                    "CPU smoke run)")
    ap.add_argument("--skip-peaks", action="store_true")
    ap.add_argument("--unroll", action="store_true", help="unroll the scan over blocks")
    ap.add_argument("--paged", action="store_true", help="decode over the paged KV pool")
    args = ap.parse_args()
    cfg, dt = preset(args.preset), jnp.bfloat16
    res = {"date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0].device_kind),
           "jax": jax.__version__, "python": platform.python_version(), "model": cfg.name,
           "weights": "bf16 synthetic", "argv": sys.argv[1:]}
    res["peaks"] = pk = ({"copy_bytes_per_s": 1.0, "bf16_flops_per_s": 1.0} if args.skip_peaks
                         else peaks())
    print(f"copy {pk['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{pk['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    t0 = time.perf_counter()
    params = random_params(cfg, dt)
    jax.block_until_ready(params)
    wbytes = nbytes(params) - (nbytes(params.get("mtp", {})) if "mtp" in params else 0)
    res["weights_bytes_used"] = wbytes
    print(f"params built in {time.perf_counter() - t0:.1f}s, {wbytes / 1e9:.1f} GB used per "
          "token (MTP excluded)", flush=True)
    fwd = M.jit_forward()
    step = lambda p, t, c: fwd(p, cfg, t, c, last_only=True, unroll=args.unroll)  # noqa: E731
    res["unroll"] = args.unroll
    res["paged"] = args.paged
    state_bytes = 2 * cfg.num_blocks * cfg.gdn_per_block * cfg.linear_num_value_heads * \
        cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    kv_per_tok = cfg.num_blocks * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    res["decode"] = []
    runs = [(int(b), int(c)) for b in args.batches.split(",") for c in args.contexts.split(",")]
    for batch, ctx in runs:
        cache = (random_paged_cache if args.paged else random_cache)(cfg, ctx, dt, batch)
        tok = jnp.ones((batch, 1), jnp.int32)
        t0 = time.perf_counter()
        _, _, cache = step(params, tok, cache)
        jax.block_until_ready(cache)
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(args.steps):
            cache = cache._replace(pos=jnp.full((batch,), ctx, jnp.int32))
            t0 = time.perf_counter()
            logits, _, cache = step(params, tok, cache)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - t0)
        t = float(np.median(times))
        moved = wbytes + batch * (ctx * kv_per_tok + state_bytes)
        row = {"context": ctx, "batch": batch, "ms_per_step": t * 1e3,
               "tokens_per_s": batch / t,
               "bytes": moved, "fraction_of_copy_bw": moved / t / pk["copy_bytes_per_s"],
               "first_call_s": compile_s}
        res["decode"].append(row)
        print(f"decode C{batch} ctx {ctx:>6}: {t * 1e3:7.2f} ms/step {batch / t:6.1f} tok/s "
              f"{row['fraction_of_copy_bw'] * 100:5.1f}% of copy BW (first call "
              f"{compile_s:.1f}s)", flush=True)
        del cache
    res["prefill"] = []
    n_params = wbytes / 2 - cfg.vocab_size * cfg.hidden_size  # embedding is a lookup, not a matmul
    for T in [int(c) for c in args.prefill.split(",") if c]:
        cache = M.init_cache(cfg, 1, T + 16, dt)
        toks = jax.random.randint(jax.random.key(5), (1, T), 0, cfg.vocab_size, jnp.int32)
        fresh = lambda: M.init_cache(cfg, 1, T + 16, dt)  # noqa: E731
        t0 = time.perf_counter()
        out = step(params, toks, cache)
        jax.block_until_ready(out)
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(3):
            c = fresh()
            jax.block_until_ready(c)
            t0 = time.perf_counter()
            out = step(params, toks, c)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t0)
        t = float(np.median(times))
        attn = cfg.num_blocks * 2 * 2 * (T * T / 2) * cfg.num_heads * cfg.head_dim
        flops = 2 * n_params * T + attn
        row = {"tokens": T, "seconds": t, "tokens_per_s": T / t, "flops": flops,
               "fraction_of_bf16_peak": flops / t / pk["bf16_flops_per_s"],
               "first_call_s": compile_s}
        res["prefill"].append(row)
        print(f"prefill {T:>6}: {t:7.3f} s {T / t:8.0f} tok/s "
              f"{row['fraction_of_bf16_peak'] * 100:5.1f}% of bf16 peak (first call "
              f"{compile_s:.1f}s)", flush=True)
        del out
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
