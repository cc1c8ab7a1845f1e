"""Decode and prefill of the qwen3.8-27b shapes with synthetic weights, on one GPU.

Builds random weights directly on the device (no download, nothing on the host): bf16, or a
quantized format (int4_g64, int8_row, fp8_row: random codes and scales, laid out as the
converter stores them: every layer matrix and lm_head quantized, the embedding bf16). Then it
times the engine's own jitted forward: decode steps at several context lengths and batch sizes,
and prefills. Every figure is reported with its fraction of the physical limit measured in the
same run:

  decode bytes  = every weight byte a token reads once (the layer matrices, norms, lm_head; not
                  the embedding table, of which a step reads one row, nor the MTP layer)
                  + KV read at that context + GDN state read and written, per sequence
  prefill FLOPs = 2 x matmul params x T + attention (causal: 2 x 2 x T^2/2 x heads x hd per
                  attention layer)

The ceilings: a device-to-device copy (bytes read + written) and an 8192^3 bf16 matmul, through
torch when it is installed (what REFERENCE section 7 quotes), else through JAX; both recorded.

The forward runs the kernel plan of --plan (a preset of engine/plan.py; default reference: the
plain-JAX references) with --set's fields over it; --variants times the decode rows once for
each of several plans (plan fields over --plan and --set) in one process.

  python bench/bench_27b.py --contexts 1024,32768 --prefill 8192 --out results.json
  python bench/bench_27b.py --plan h200 --paged --weights int4_g64,bf16 --batches 1,2 \
      --contexts 1024,32768,131072 --prefill 8192,32768,131072 --out v3.json
  python bench/bench_27b.py --plan h200 --paged --weights int4_g64 --contexts 1024 \
      --prefill "" --variants 'reduce chain:paged_merge=chain' --out merge.json
  .venv/bin/python bench/bench_27b.py --preset tiny --plan reference --skip-peaks \
      --contexts 256 --prefill 256 --steps 2 --prefill-reps 1 --out /tmp/b_tiny.json  # a CPU
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from engine.kernels.stacked import MATRICES  # noqa: E402
import engine.model.model as M  # noqa: E402
from engine.model.config import QWEN38_27B, preset  # noqa: E402
from engine.ops.quant import GROUP, INT4_G64, QTensor  # noqa: E402

from bench.plan_args import (add_plan_args, label, make_plan, parse_overrides,  # noqa: E402
                             parse_value, parse_variants, prepare)


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


def torch_peaks() -> dict:
    """Copy bandwidth and bf16 matmul rate through torch (before JAX takes the GPU memory)."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    n = 1 << 30
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

    def med(fn, reps):
        for _ in range(3):
            fn()
        ts = []
        for _ in range(reps):
            a, b = ev(), ev()
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        return float(np.median(ts))

    t = med(lambda: dst.copy_(src), 20)
    copy = 2 * n * 2 / t
    src = dst = None  # free before the matmul buffers
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = med(lambda: a @ b, 10)
    out = {"torch_copy_bytes_per_s": copy, "torch_bf16_flops_per_s": 2 * 8192 ** 3 / t}
    a = b = None
    torch.cuda.empty_cache()  # hand the memory back before JAX allocates its pool
    return out


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


def _random_qtensor(key, shape, fmt):
    """A stacked QTensor [*lead, out, in] of random codes with scales ~ 1/sqrt(in)/qmax."""
    *lead, out, inp = shape
    k1, k2 = jax.random.split(key)
    if fmt == INT4_G64:
        data = jax.random.bits(k1, (*lead, out, inp // 2), jnp.uint8)
        sshape, qmax = (*lead, out, inp // GROUP), 7.0
    elif fmt == "int8_row":
        data = jax.random.randint(k1, (*lead, out, inp), -127, 128, jnp.int32).astype(jnp.int8)
        sshape, qmax = (*lead, out), 127.0
    else:
        data = (jax.random.normal(k1, (*lead, out, inp), jnp.float32) * 100).astype(
            jnp.float8_e4m3fn)
        sshape, qmax = (*lead, out), 448.0
    scale = jax.random.uniform(k2, sshape, jnp.float32, 0.5, 1.5) * (2.0 / np.sqrt(inp) / qmax)
    return QTensor(data=data, scale=scale, fmt=fmt, shape=(out, inp))


def random_params(cfg, dtype, fmt: str = "bf16"):
    """The stacked parameter tree with random values, created on the device leaf by leaf;
    fmt != "bf16" stores the layer matrices and lm_head as random QTensors of that format."""
    specs = cfg.tensor_specs()
    flat = {n: jax.ShapeDtypeStruct(s, dtype) for n, s in specs.items()}
    shapes = jax.eval_shape(lambda f: M.stack_params(f, cfg), flat)
    paths, tree = jax.tree_util.tree_flatten_with_path(shapes)
    out = []
    for i, (path, leaf) in enumerate(paths):
        name = str(getattr(path[-1], "key", ""))
        key = jax.random.key(100 + i)
        if fmt != "bf16" and (name in MATRICES or name == "lm_head") and "mtp" not in str(path):
            out.append(jax.jit(_random_qtensor, static_argnums=(1, 2))(key, leaf.shape, fmt))
            continue
        fan_in = leaf.shape[-1]
        scale = 1.0 / np.sqrt(fan_in) if len(leaf.shape) >= 2 else 0.1
        make = jax.jit(lambda k, s=leaf.shape, sc=scale: (
            jax.random.normal(k, s, jnp.float32) * sc).astype(dtype))
        out.append(make(key))
    return jax.tree.unflatten(tree, out)


def random_cache(cfg, ctx: int, dtype, batch: int = 1):
    """A cache whose first ctx positions hold random K/V and random GDN state (never zeros)."""
    c = M.init_cache(cfg, batch, ctx + 64, dtype)  # whole 64-token pages for the kernels
    k1, k2, k3, k4 = jax.random.split(jax.random.key(7), 4)
    return c._replace(
        k=jax.random.normal(k1, c.k.shape, dtype), v=jax.random.normal(k2, c.v.shape, dtype),
        conv=jax.random.normal(k3, c.conv.shape, dtype) * 0.1,
        rec=jax.random.normal(k4, c.rec.shape, jnp.float32) * 0.01,
        pos=jnp.full((batch,), ctx, jnp.int32))


def random_paged_cache(cfg, ctx: int, dtype, batch: int = 1, kv: str = "bfloat16"):
    """A paged cache: each row owns consecutive pages holding ctx random K/V tokens, stored as
    `kv` (bfloat16, or int8 codes with per-row fp32 scales)."""
    from engine.ops import paged_kv as pk

    per_row = pk.kv_pages_needed(ctx + 16)
    kv_dtype = dtype if kv == "bfloat16" else kv
    pool = pk.init_kv_pool(cfg, batch * per_row, pk.PAGE_SIZE, kv_dtype)
    k1, k2, k5, k6 = jax.random.split(jax.random.key(8), 4)
    if pool.k_scale is None:
        pool = pool._replace(k=jax.random.normal(k1, pool.k.shape, pool.k.dtype),
                             v=jax.random.normal(k2, pool.v.shape, pool.v.dtype))
    else:  # int8 codes and the scales of rows of about unit size
        codes = lambda key: jax.random.randint(  # noqa: E731
            key, pool.k.shape, -127, 128, jnp.int32).astype(jnp.int8)
        scale = lambda key: jax.random.uniform(  # noqa: E731
            key, pool.k_scale.shape, jnp.float32, 0.5, 1.5) / 127.0
        pool = pool._replace(k=codes(k1), v=codes(k2), k_scale=scale(k5), v_scale=scale(k6))
    table = np.arange(batch * per_row, dtype=np.int32).reshape(batch, per_row)
    c = M.init_paged_cache(cfg, pool, table, dtype)
    k3, k4 = jax.random.split(jax.random.key(9))
    return c._replace(conv=jax.random.normal(k3, c.conv.shape, dtype) * 0.1,
                      rec=jax.random.normal(k4, c.rec.shape, jnp.float32) * 0.01,
                      pos=jnp.full((batch,), ctx, jnp.int32))


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def decode_weight_bytes(params) -> int:
    """Weight bytes one decode token reads: everything but the embedding table and MTP."""
    return nbytes({k: v for k, v in params.items() if k not in ("embed_tokens", "mtp")})


def run_decode(cfg, params, fmt, args, res, dt, plan, variant: dict | None = None):
    """Decode rows for each (batch, context) under kernel plan `plan`; `variant` ({"name",
    "rep", "overrides": the plan fields (and extra_kernels) it sets}) is recorded in each row,
    and only its first rep is profiled."""
    wbytes = decode_weight_bytes(params)
    res.setdefault("weights_bytes_per_token", {})[fmt] = wbytes
    # a variant's plan is a static argument (its own trace); extra_kernels is not, so a
    # variant's step is traced afresh
    fwd = M.jit_forward() if not variant else _fresh_jit()
    step = lambda p, t, c: fwd(p, cfg, t, c, last_only=True,  # noqa: E731
                               plan=plan)
    state_bytes = 2 * cfg.num_blocks * cfg.gdn_per_block * cfg.linear_num_value_heads * \
        cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    if args.paged:
        from engine.ops.paged_kv import kv_bytes_per_token

        kv_per_tok = kv_bytes_per_token(cfg, dt if args.kv == "bfloat16" else args.kv)
    else:
        kv_per_tok = cfg.num_blocks * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    runs = [(int(b), int(c)) for b in args.batches.split(",") for c in args.contexts.split(",")
            if b and c]
    for batch, ctx in runs:
        cache = (random_paged_cache(cfg, ctx, dt, batch, args.kv) if args.paged
                 else random_cache(cfg, ctx, dt, batch))
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
        # the same steps dispatched back to back, each taking the last one's cache, synced once
        # at the end: the device's own step time, without the per-step dispatch latency and
        # host sync that the timed steps above (and an engine that reads every token before
        # it dispatches the next step) pay
        cache = cache._replace(pos=jnp.full((batch,), ctx, jnp.int32))
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            logits, _, cache = step(params, tok, cache)
        jax.block_until_ready(logits)
        t_pipe = (time.perf_counter() - t0) / args.steps
        moved = wbytes + batch * (ctx * kv_per_tok + state_bytes)
        row = {"weights": fmt, "plan": label(plan), "context": ctx, "batch": batch,
               "kv": args.kv if args.paged else "bfloat16", "ms_per_step": t * 1e3,
               "tokens_per_s": batch / t, "bytes": moved,
               "ms_per_step_pipelined": t_pipe * 1e3,
               "tokens_per_s_pipelined": batch / t_pipe,
               "first_call_s": compile_s}
        if variant:
            row["variant"] = variant
        if args.profile and (not variant or (variant["rep"] == 0 and batch == 1)):
            row["profile"] = profile_steps(lambda c: step(params, tok, c), cache, args.profile,
                                           batch, ctx)
        res["decode"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=2))
        tag = f"[{variant['name']} #{variant['rep']}] " if variant else ""
        print(f"{tag}decode {fmt:>8} {label(plan)} C{batch} ctx {ctx:>6}: {t * 1e3:7.2f} ms/step "
              f"{batch / t:6.1f} tok/s first call {compile_s:.1f}s; back to back "
              f"{t_pipe * 1e3:7.2f} ms/step {batch / t_pipe:6.1f} tok/s", flush=True)
        del cache


# Extra XLA kernels a decoder layer (`install_extra_kernels`): --extra-kernels, or a variant's
# "extra_kernels"; read when the step is traced.
EXTRA_KERNELS = {"n": 0}


def install_extra_kernels() -> None:
    """A probe of what one small kernel on a decode step's path costs: with
    EXTRA_KERNELS["n"] = n (--extra-kernels, or a --variants entry's extra_kernels; read when
    the step is traced), every decoder layer adds z to its output n times, each add its own XLA
    kernel on the path from one layer to the next (an optimization barrier between them keeps
    XLA from fusing them; z is a zero that XLA cannot see to be one). The model's results do
    not change. The step time's slope against n over the layers is the cost of such a
    kernel."""
    import engine.model.model as model

    def with_extra(layer_fn):
        def wrapped(p, cfg, x, *rest, **kw):
            out = layer_fn(p, cfg, x, *rest, **kw)
            n = int(EXTRA_KERNELS["n"])
            if n <= 0:
                return out
            y = out[0]
            z = (jnp.sum(y[..., :1].astype(jnp.float32)) * 0.0).astype(y.dtype)
            for _ in range(n):
                y = jax.lax.optimization_barrier(y + z)
            return (y, *out[1:])
        return wrapped

    model.gdn_layer = with_extra(model.gdn_layer)
    model.attention_layer = with_extra(model.attention_layer)


def _fresh_jit():
    """M.jit_forward() over a new function object: JAX keeps the traces of one function
    across its jit wrappers, and a variant's extra_kernels is read when the step is traced
    (its plan is a static argument, a trace of its own anyway)."""
    f = M.forward
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__kwdefaults__ = f.__kwdefaults__
    return jax.jit(g, static_argnames=M.FORWARD_STATIC, donate_argnames=("cache",))


BENCH_KEYS = ("extra_kernels",)  # variant keys that are this script's, not plan fields


def variant_specs(args) -> list[tuple[str, dict, dict]]:
    """--variants as [(name, plan overrides, bench settings)]: JSON {name: {field: value}} or
    'NAME:field=value,... NAME2:...' (the values typed by the plan's fields); the keys of
    BENCH_KEYS are this script's settings, the others plan fields over --plan and --set."""
    text = args.variants.strip()
    if text.startswith("{"):
        items = [(name, {k: parse_value(k, v) for k, v in over.items()})
                 for name, over in json.loads(text).items()]
    else:
        items = parse_variants(text)
    out = []
    for name, over in items:
        bench = {k: over.pop(k) for k in BENCH_KEYS if k in over}
        out.append((name, over, bench))
    return out


def variant_plans(args) -> list:
    """Each variant's plan (a usage error names the variant whose fields do not fit)."""
    sets = parse_overrides(args.set)
    return [make_plan(args.plan, {**sets, **over}, where=f"--variants {name}")
            for name, over, _ in variant_specs(args)]


def run_variants(cfg, params, fmt, args, res, dt):
    """run_decode for each of --variants in turn, --variant-reps times (A, B, A, B: drift of
    the clocks or the host shows as a spread within a variant, not as a difference)."""
    specs = variant_specs(args)
    plans = variant_plans(args)
    try:
        for rep in range(args.variant_reps):
            for (name, over, bench), plan in zip(specs, plans):
                EXTRA_KERNELS["n"] = int(bench.get("extra_kernels", args.extra_kernels))
                run_decode(cfg, params, fmt, args, res, dt, plan,
                           {"name": name, "rep": rep, "overrides": {**over, **bench},
                            "plan_digest": plan.digest()})
    finally:
        EXTRA_KERNELS["n"] = args.extra_kernels
    by = {}
    for row in res["decode"]:
        if "variant" in row:
            by.setdefault((row["variant"]["name"], row["batch"], row["context"]),
                          []).append(row["tokens_per_s"])
    for (name, b, c), tps in by.items():
        print(f"variant {name:>12} C{b} ctx {c:>6}: " + " / ".join(f"{v:.1f}" for v in tps)
              + " tok/s", flush=True)


def profiled(run, n: int) -> dict:
    """Trace `run()` n times and sum the GPU time by kernel (bench/profile_summary.py)."""
    from bench import profile_summary

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(n):
                run()
        summary = profile_summary.summarize(profile_summary.newest_xplane(d), steps=n)
    print(profile_summary.table(summary), flush=True)
    summary["by_kernel"] = summary["by_kernel"][:40]
    return summary


def profile_steps(step, cache, n: int, batch: int, ctx: int) -> dict:
    """Trace n decode steps at context ctx."""
    box = [cache]

    def run():
        box[0] = box[0]._replace(pos=jnp.full((batch,), ctx, jnp.int32))
        logits, _, box[0] = step(box[0])
        jax.block_until_ready(logits)
    return profiled(run, n)


def decode_weight_params(params) -> int:
    """Parameters one token multiplies with (the weights of `decode_weight_bytes`), counted as
    logical elements whatever their storage: an int4 byte holds two."""
    tree = {k: v for k, v in params.items() if k not in ("embed_tokens", "mtp")}
    n = 0
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QTensor)):
        if isinstance(leaf, QTensor):
            n += leaf.data.size * (2 if leaf.fmt == INT4_G64 else 1)
        else:
            n += leaf.size
    return n


def run_prefill(cfg, params, fmt, args, res, dt, plan):
    fwd = M.jit_forward()
    step = lambda p, t, c: fwd(p, cfg, t, c, last_only=True,  # noqa: E731
                               plan=plan)
    n_params = decode_weight_params(params)  # the same FLOP count for every format
    for T in [int(c) for c in args.prefill.split(",") if c]:
        max_len = -(-T // 64) * 64  # whole 64-token tiles: the flash kernel's key tile
        toks = jax.random.randint(jax.random.key(5), (1, T), 0, cfg.vocab_size, jnp.int32)
        fresh = lambda: M.init_cache(cfg, 1, max_len, dt)  # noqa: E731
        try:
            t0 = time.perf_counter()
            out = step(params, toks, fresh())
            jax.block_until_ready(out)
            compile_s = time.perf_counter() - t0
            del out
            times = []
            for _ in range(args.prefill_reps):
                c = fresh()
                jax.block_until_ready(c)
                t0 = time.perf_counter()
                out = step(params, toks, c)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t0)
                del out, c
        except Exception as e:  # noqa: BLE001  (out of memory at 128K is a result too)
            print(f"prefill {T}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            res["prefill"].append({"tokens": T, "plan": label(plan), "weights": fmt,
                                   "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        t = float(np.median(times))
        attn = cfg.num_blocks * 2 * 2 * (T * T / 2) * cfg.num_heads * cfg.head_dim
        flops = 2 * n_params * T + attn
        row = {"tokens": T, "plan": label(plan), "weights": fmt, "seconds": t,
               "tokens_per_s": T / t,
               "flops": flops, "first_call_s": compile_s}
        if args.profile:
            row["profile"] = profiled(
                lambda: jax.block_until_ready(step(params, toks, fresh())), 1)
        res["prefill"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"prefill {label(plan)} {'' if fmt == 'bf16' else fmt + ' '}{T:>6}: "
              f"{t:7.3f} s {T / t:8.0f} tok/s "
              f"first call {compile_s:.1f}s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--prefill", default="8192")
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", default="1", help="decode batch sizes, e.g. 1,2")
    ap.add_argument("--weights", default="bf16", help="weight formats for decode, e.g. "
                    "int4_g64,bf16")
    ap.add_argument("--prefill-weights", default="bf16", help="weight formats for prefill, "
                    "e.g. bf16,int4_g64 (int4: each layer dequantized to bf16 as the engine "
                    "does for prompts)")
    add_plan_args(ap, "reference")
    ap.add_argument("--out", default="bench_27b.json")
    ap.add_argument("--preset", default=QWEN38_27B.name, help="model preset (tiny ones for a "
                    "CPU smoke run)")
    ap.add_argument("--skip-peaks", action="store_true")
    ap.add_argument("--unroll", action="store_true", help="unroll the scan over blocks")
    ap.add_argument("--paged", action="store_true", help="decode over the paged KV pool")
    ap.add_argument("--kv", default="bfloat16", choices=["bfloat16", "int8"],
                    help="the paged pool's KV storage (int8: codes and per-row scales)")
    ap.add_argument("--profile", type=int, default=0, help="after timing, trace this many "
                    "decode steps (and one prefill) and print the GPU time by kernel")
    ap.add_argument("--variants", default="", help="the decode rows once for each of these "
                    "plans, in turn --variant-reps times: 'NAME[:field=value,...] ...' or JSON "
                    "{name: {field: value}}, plan fields over --plan and --set (and "
                    "extra_kernels, --extra-kernels's for that variant)")
    ap.add_argument("--variant-reps", type=int, default=2)
    ap.add_argument("--extra-kernels", type=int, default=0, help="extra XLA kernels on the "
                    "decode step's path a layer (install_extra_kernels: the cost of a small "
                    "kernel)")
    ap.add_argument("--null-gemv", action="store_true", help="replace the GEMV kernel by zeros "
                    "(measures everything else in a decode step)")
    args = ap.parse_args()
    overrides = parse_overrides(args.set)
    if args.unroll:  # the plan's unroll_blocks
        overrides["unroll_blocks"] = True
    plan = make_plan(args.plan, overrides, where=f"--plan {args.plan} --set {args.set!r}")
    # XLA's flags before JAX starts its backend; the CUDA ops built for the plans that call them
    prepare(plan, *(variant_plans(args) if args.variants else ()))
    EXTRA_KERNELS["n"] = args.extra_kernels
    install_extra_kernels()
    if args.null_gemv:
        from engine.kernels import qgemv

        def null(x, w, index=None, **_):
            n = w.shape[0]
            return jnp.zeros((*x.shape[:-1], n), x.dtype)
        qgemv.qmatmul = null
    cfg, dt = preset(args.preset), jnp.bfloat16
    res = {"date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0].device_kind),
           "jax": jax.__version__, "python": platform.python_version(), "model": cfg.name,
           "weights": "synthetic", "argv": sys.argv[1:], "plan": plan.describe(),
           "unroll": args.unroll, "paged": args.paged, "null_gemv": args.null_gemv,
           "xla_flags": os.environ.get("XLA_FLAGS", "")}
    res["decode"], res["prefill"] = [], []
    dec_fmts = [f for f in args.weights.split(",") if f]
    pre_fmts = [f for f in args.prefill_weights.split(",") if f] if args.prefill else []
    for fmt in dict.fromkeys(dec_fmts + pre_fmts):  # each format's params built once
        t0 = time.perf_counter()
        params = random_params(cfg, dt, fmt)
        jax.block_until_ready(params)
        print(f"{fmt} params built in {time.perf_counter() - t0:.1f}s, "
              f"{decode_weight_bytes(params) / 1e9:.2f} GB read per decode step", flush=True)
        if fmt in dec_fmts and args.variants:
            run_variants(cfg, params, fmt, args, res, dt)
        elif fmt in dec_fmts:
            run_decode(cfg, params, fmt, args, res, dt, plan)
        if fmt in pre_fmts:
            run_prefill(cfg, params, fmt, args, res, dt, plan)
        del params
        Path(args.out).write_text(json.dumps(res, indent=2))
    if not args.skip_peaks:
        # The ceilings are measured after the runs: torch's copy and matmul in the same process
        # before them left the decode steps 3-5% slower on the H200 (v10).
        add_fractions(res, ceilings())
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


def ceilings() -> dict:
    """The copy and bf16 matmul ceilings (torch's where higher: the stricter fractions)."""
    tp = torch_peaks()
    pk = peaks()
    pk.update({f"jax_{k}": v for k, v in pk.items()})
    if tp:
        pk.update(tp)
        pk["copy_bytes_per_s"] = max(pk["copy_bytes_per_s"], tp["torch_copy_bytes_per_s"])
        pk["bf16_flops_per_s"] = max(pk["bf16_flops_per_s"], tp["torch_bf16_flops_per_s"])
    print(f"ceilings: copy {pk['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{pk['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s ({json.dumps(pk)})", flush=True)
    return pk


def add_fractions(res: dict, pk: dict) -> None:
    """Each row's fraction of its physical limit (docs/benchmarks/README.md says how it is
    counted), printed and stored beside the row."""
    res["peaks"] = pk
    for row in res["decode"]:
        if "ms_per_step" not in row:
            continue
        t = row["ms_per_step"] / 1e3
        row["fraction_of_copy_bw"] = row["bytes"] / t / pk["copy_bytes_per_s"]
        row["roofline_tokens_per_s"] = row["batch"] * pk["copy_bytes_per_s"] / row["bytes"]
        print(f"decode C{row['batch']} ctx {row['context']:>6}: {row['tokens_per_s']:6.1f} "
              f"tok/s, {row['fraction_of_copy_bw'] * 100:5.1f}% of the roofline "
              f"({row['roofline_tokens_per_s']:.0f} tok/s)", flush=True)
    for row in res["prefill"]:
        if "seconds" not in row:
            continue
        row["fraction_of_bf16_peak"] = row["flops"] / row["seconds"] / pk["bf16_flops_per_s"]
        row["floor_seconds"] = row["flops"] / pk["bf16_flops_per_s"]
        print(f"prefill {row.get('weights', 'bf16')} {row['tokens']:>6}: "
              f"{row['seconds']:7.3f} s, "
              f"{row['fraction_of_bf16_peak'] * 100:5.1f}% of the bf16 peak (floor "
              f"{row['floor_seconds']:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
