"""Micro-benchmark of the Pallas kernels at the qwen3.8-27b shapes on one GPU: achieved bytes/s
of the weight-only GEMV (per format, per tile config, against XLA's dequantize + matmul), of
paged decode attention and of the recurrent GDN step; and the time of one GDN layer's prefill,
XLA's chunk rule against the Pallas chunked kernel over its tiles (--only gdnprefill), and of one
attention layer's causal prefill: the flash kernel's tiles, the paged kernel and cuDNN (--only
flash). Weights are stacks of 4 layers read in
place through the layer index (as the model does), so the 60 MB L2 cannot hold them.

  python bench/kernels_micro.py --out micro.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from bench.bench_27b import _random_qtensor  # noqa: E402
from engine.kernels import qgemv  # noqa: E402
from engine.kernels.gdn_decode import gdn_recurrent  # noqa: E402
from engine.kernels.paged_decode import paged_attend  # noqa: E402
from engine.kernels.stacked import Stacked  # noqa: E402
from engine.model.linear import linear  # noqa: E402
from engine.ops.paged_kv import KVPool  # noqa: E402

LAYERS = 4
REPEAT = 8  # calls per layer inside one jit: amortizes the host dispatch
SMOKE = False  # --smoke: tiny shapes
CONTEXTS = (1024, 32768, 131072)
ATTN_WARPS = (4,)
FMTS = ("int4_g64", "bf16", "int8_row", "fp8_row")
SHAPES = [(17408, 5120), (5120, 17408)]
CONFIGS = [qgemv.GemvConfig(),
           qgemv.GemvConfig(bn=16, bk=256, programs=2048, num_warps=4, num_stages=4),
           qgemv.GemvConfig(dot=True),
           qgemv.GemvConfig(dot=True, bn=32, bk=512, programs=1024),
           qgemv.GemvConfig(dot=True, bn=64, bk=256, programs=1024, num_stages=4),
           qgemv.GemvConfig(dot=True, bn=32, bk=1024, programs=512, num_warps=8)]


def call_loop(fn, *args, layers=LAYERS):
    """jit(run)(*args): REPEAT calls a layer of fn(*args, index), index an int32 [1] cycling
    over `layers` stacked layers (so the L2 holds no layer's weights from the call before),
    their fp32 results added up so none is dropped."""
    out = jax.eval_shape(fn, *args, jnp.zeros((1,), jnp.int32))

    def run(*args):
        def body(i, acc):
            return acc + fn(*args, jnp.reshape(i % layers, (1,))).astype(jnp.float32)
        return lax.fori_loop(0, layers * REPEAT, body, jnp.zeros(out.shape, jnp.float32))
    return jax.jit(run)


def traced_kernels(run, *args, runs: int = 2) -> list[dict]:
    """GPU time by kernel (bench/profile_summary.py's rows, per run) of `run(*args)`, traced
    `runs` times after one untraced warm-up call."""
    import tempfile

    from bench import profile_summary

    jax.block_until_ready(run(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(runs):
                jax.block_until_ready(run(*args))
        summary = profile_summary.summarize(profile_summary.newest_xplane(d), steps=runs)
    return summary["by_kernel"]


def per_call(fn, *args, layers=LAYERS, reps=20):
    """Seconds a call of fn(*args, index) takes in `call_loop` (the loop's and the dispatch's
    share included)."""
    return bench(call_loop(fn, *args, layers=layers), *args, reps=reps) / (layers * REPEAT)


def bench(fn, *args, reps=20):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def weights(fmt, n, k, key):
    if fmt == "bf16":
        return (jax.random.normal(key, (LAYERS, n, k), jnp.float32) * k ** -0.5).astype(
            jnp.bfloat16)
    return _random_qtensor(key, (LAYERS, n, k), fmt)


def gemv_rows(res):
    for fmt in FMTS:
        for n, k in SHAPES:
            w = weights(fmt, n, k, jax.random.key(n + k))
            nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w))
            for rows in (1, 2):
                x = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
                variants = {"xla": None}
                variants.update({f"pallas{i}": c for i, c in enumerate(CONFIGS)})
                for name, cfg in variants.items():
                    def one(x, w, idx, cfg=cfg):
                        if cfg is None:
                            return linear(x, Stacked(w, idx).materialize())
                        return qgemv.qmatmul(x, w, idx, config=cfg)
                    try:
                        t = per_call(one, x, w, reps=5)
                    except Exception as e:  # noqa: BLE001
                        print(f"gemv {fmt} {n}x{k} M{rows} {name}: {type(e).__name__} "
                              f"{str(e)[:400]}", flush=True)
                        continue
                    bw = nbytes / LAYERS / t
                    res["gemv"].append({"fmt": fmt, "n": n, "k": k, "rows": rows, "impl": name,
                                        "config": None if cfg is None else cfg.__dict__,
                                        "us": t * 1e6, "bytes_per_s": bw})
                    print(f"gemv {fmt:>8} {n:>5}x{k:<5} M{rows} {name:>8}: {t * 1e6:8.1f} us "
                          f"{bw / 1e12:5.2f} TB/s", flush=True)
            del w


def attention_rows(res):
    """Paged decode at each context, B = 1 and 2: bf16 pages and int8 pages, each warps
    setting (ATTN_WARPS)."""
    kvh, hd, nh, page = 4, 256, 24, 64
    for b in (1, 2):
        for ctx in CONTEXTS:
            mp = ctx // page
            shape = (1, b * mp, page, kvh, hd)
            table = jnp.arange(b * mp, dtype=jnp.int32).reshape(b, mp)
            q = jax.random.normal(jax.random.key(1), (b, 1, nh, hd), jnp.bfloat16)
            last = jnp.full((b,), ctx - 1, jnp.int32)
            for kv_dtype in ("bfloat16", "int8"):
                if kv_dtype == "int8":
                    k = jax.random.randint(jax.random.key(0), shape, -127, 128).astype(jnp.int8)
                    sc = jnp.full(shape[:-1], 0.01, jnp.float32)
                    pool = KVPool(k, k, sc, sc)
                else:
                    k = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
                    pool = KVPool(k, k, None, None)
                # K and V (the same buffer here, read twice as in the model) plus scales.
                nbytes = 2 * k.size * k.dtype.itemsize
                if kv_dtype == "int8":
                    nbytes += 2 * pool.k_scale.size * 4
                ref = None
                for w in ATTN_WARPS:
                    f = jax.jit(lambda p, t, q, s, w=w: paged_attend(
                        p, t, jnp.int32(0), q, s, num_warps=w))
                    out = np.asarray(f(pool, table, q, last), np.float32)
                    ref = out if ref is None else ref
                    t = bench(f, pool, table, q, last)
                    res["paged_decode"].append({
                        "kv": kv_dtype, "num_warps": w, "batch": b,
                        "context": ctx, "us": t * 1e6, "bytes_per_s": nbytes / t,
                        "max_abs_diff_vs_first": float(np.abs(out - ref).max())})
                    print(f"paged decode {kv_dtype:>8} w{w} B{b} ctx {ctx:>6}: "
                          f"{t * 1e6:8.1f} us {nbytes / t / 1e12:5.2f} TB/s "
                          f"(max |diff| {np.abs(out - ref).max():.2e})", flush=True)
                del pool, k


def gdn_rows(res):
    for b in (1, 2):
        key = jax.random.split(jax.random.key(0), 6)
        q = jax.random.normal(key[0], (b, 1, 16, 128)) * 0.08
        k = jax.random.normal(key[1], (b, 1, 16, 128)) * 0.08
        v = jax.random.normal(key[2], (b, 1, 48, 128))
        g = -jax.random.uniform(key[3], (b, 1, 48))
        beta = jax.random.uniform(key[4], (b, 1, 48))
        s = jax.random.normal(key[5], (b, 48, 128, 128))
        for name, fn in (("pallas", gdn_recurrent),
                         ("xla", __import__("engine.ops.gdn", fromlist=["x"]).
                          recurrent_gated_delta_rule)):
            t = bench(jax.jit(fn), q, k, v, g, beta, s)
            nbytes = 2 * s.size * 4
            res["gdn_decode"].append({"impl": name, "batch": b, "us": t * 1e6,
                                      "bytes_per_s": nbytes / t})
            print(f"gdn step {name:>6} B{b}: {t * 1e6:8.1f} us {nbytes / t / 1e12:5.2f} TB/s",
                  flush=True)


PREFILL_TOKENS = (8192, 32768)
# (64, 4, 2): the model's (gdn_prefill.gdn_chunk_bf16_operands)
GDN_PREFILL_TILES = [(bv, w, 1) for bv in (32, 64, 128) for w in (4, 8)] + [(64, 4, 2),
                                                                             (64, 8, 2)]


def gdn_prefill_rows(res):
    """One 27B GDN layer's prefill (the gated delta rule over T tokens, state in and out):
    the XLA chunk rule (fp32, plan gdn_prefill "xla") against the Pallas chunked kernel with
    bf16 operands (every state-independent term from XLA, the diagonal blocks' inverse kernel
    and the lean scan: plan gdn_prefill "pallas") over its scan's tiles (value-column tile bv,
    warps, pipeline stages)."""
    from engine.kernels.gdn_prefill import gdn_chunk
    from engine.ops import gdn

    hk, hv, d = (16, 48, 128) if not SMOKE else (2, 6, 16)
    for t in PREFILL_TOKENS:
        key = jax.random.split(jax.random.key(t), 6)
        q = gdn.l2_normalize(jax.random.normal(key[0], (1, t, hk, d)))
        k = gdn.l2_normalize(jax.random.normal(key[1], (1, t, hk, d)))
        v = jax.random.normal(key[2], (1, t, hv, d))
        g = -jax.random.uniform(key[3], (1, t, hv)) * 0.5
        beta = jax.random.uniform(key[4], (1, t, hv))
        s0 = jax.random.normal(key[5], (1, hv, d, d)) * 0.1
        ref_fn = jax.jit(gdn.chunk_gated_delta_rule)
        ref = ref_fn(q, k, v, g, beta, s0)
        runs = [("xla", None, ref_fn, (q, k, v, g, beta, s0))]
        qb, kb, vb = (a.astype(jnp.bfloat16) for a in (q, k, v))
        for bv, warps, stages in GDN_PREFILL_TILES:
            if bv > d:
                continue
            fn = jax.jit(lambda *a, bv=bv, w=warps, st=stages: gdn_chunk(
                *a, bv=bv, num_warps=w, num_stages=st))
            runs.append(("pallas_bf16", (bv, warps, stages), fn, (qb, kb, vb, g, beta, s0)))
        for impl, tile, fn, args in runs:
            try:
                t_s = bench(fn, *args, reps=5)
                out, state = fn(*args)
                err = float(jnp.linalg.norm(out - ref[0]) / jnp.linalg.norm(ref[0]))
                serr = float(jnp.linalg.norm(state - ref[1]) / jnp.linalg.norm(ref[1]))
            except Exception as e:  # noqa: BLE001  (a tile Triton cannot build is a result)
                print(f"gdn prefill T{t} {impl} {tile}: {type(e).__name__} {str(e)[:200]}",
                      flush=True)
                continue
            res["gdn_prefill"].append({"tokens": t, "impl": impl, "tile": tile,
                                       "ms_per_layer": t_s * 1e3, "out_rel_err": err,
                                       "state_rel_err": serr})
            print(f"gdn prefill T{t:>6} {impl:>11} {str(tile):>12}: {t_s * 1e3:8.2f} ms/layer "
                  f"(x48 layers {t_s * 48:6.3f} s) err out {err:.1e} state {serr:.1e}",
                  flush=True)


# A short new turn on a long session (--only piece): its tokens, the context before them, the
# table widths the paged kernel is given (the context's own pages, and a 128K lane's table),
# the paged kernel's program targets and row tiles, and the GDN inverse's blocks a program
PIECE_TOKENS, PIECE_CONTEXT, PIECE_TABLES = 65, 32768, (None, 131072)
PIECE_PROGRAMS, PIECE_ROWS, INVERSE_BN = (132, 264, 512, 1024), (64, 128), (1, 2, 4, 8, 16)


def piece_rows(res):
    """What a short new turn's prefill piece spends outside its weight matmuls (issue 44: a
    64-token turn on a 32K session within 15 ms): one 27B attention layer's paged prefill of
    PIECE_TOKENS queries after PIECE_CONTEXT tokens (the split partials and XLA's merge of
    them included: the kernel's `programs` target sets the split) over programs and row
    tiles, for a table of the context's own pages and a 128K lane's wider one; and one GDN
    layer's diagonal-block inverses for that piece (48 heads x 2 chunks of 64 x 4 blocks of
    16) over the blocks a program (`bn`). Errors are against the kernel's defaults and the
    reference inverse."""
    from engine.kernels.gdn_inverse import diag_inverse, diag_inverse_ref
    from engine.kernels.paged_prefill import paged_prefill_attend

    kvh, hd, nh, page = (4, 256, 24, 64) if not SMOKE else (2, 32, 6, 16)
    t, ctx = PIECE_TOKENS, PIECE_CONTEXT
    used = -(-(ctx + t) // page)
    key = jax.random.split(jax.random.key(ctx + t), 4)
    q = jax.random.normal(key[2], (1, t, nh, hd), jnp.bfloat16)
    slots = (ctx + jnp.arange(t, dtype=jnp.int32))[None]
    flops = 2 * 2 * t * (ctx + (t + 1) / 2) * nh * hd
    kv_bytes = 2 * (ctx + t) * kvh * hd * 2
    for width in PIECE_TABLES:
        mp = max(used, (width or 0) // page)
        shape = (1, mp, page, kvh, hd)
        pool = KVPool(jax.random.normal(key[0], shape, jnp.bfloat16),
                      jax.random.normal(key[1], shape, jnp.bfloat16), None, None)
        table = jnp.where(jnp.arange(mp) < used, jnp.arange(mp), -1).astype(jnp.int32)[None]
        base = None
        for rows in PIECE_ROWS:
            for programs in PIECE_PROGRAMS:
                fn = jax.jit(lambda pool, table, q, s, r=rows, p=programs: paged_prefill_attend(
                    pool, table, jnp.int32(0), q, s, block_rows=r, programs=p))
                t_s = bench(fn, pool, table, q, slots)
                out = fn(pool, table, q, slots).astype(jnp.float32)
                base = out if base is None else base
                err = float(jnp.max(jnp.abs(out - base)))
                res["piece"].append({"part": "paged_prefill", "tokens": t, "context": ctx,
                                     "table_pages": mp, "block_rows": rows,
                                     "programs": programs, "us_per_layer": t_s * 1e6,
                                     "tflops": flops / t_s / 1e12,
                                     "kv_bytes_per_s": kv_bytes / t_s,
                                     "max_abs_diff_vs_first": err})
                print(f"piece attn T{t} ctx {ctx} table {mp:>5} rows {rows:>3} programs "
                      f"{programs:>4}: {t_s * 1e6:8.1f} us/layer {flops / t_s / 1e12:6.1f} "
                      f"TFLOP/s KV {kv_bytes / t_s / 1e9:7.1f} GB/s diff {err:.1e}", flush=True)
    heads, chunks = (48, 2) if not SMOKE else (4, 2)
    d = jax.random.normal(key[3], (1, heads, chunks * 4, 16, 16), jnp.float32) * 0.1
    ref = diag_inverse_ref(d)
    for bn in INVERSE_BN:
        fn = jax.jit(lambda d, bn=bn: diag_inverse(d, bn=bn))
        t_s = bench(fn, d)
        err = float(jnp.max(jnp.abs(fn(d) - ref)))
        res["piece"].append({"part": "gdn_diag_inverse", "blocks": heads * chunks * 4,
                             "bn": bn, "us_per_layer": t_s * 1e6, "max_abs_err_vs_ref": err})
        print(f"piece gdn inverse {heads * chunks * 4} blocks bn {bn:>2}: {t_s * 1e6:8.1f} "
              f"us/layer err {err:.1e}", flush=True)


FLASH_TILES = [(64, 64, 4, 2, False), (64, 64, 4, 2, True), (64, 64, 4, 3, True),
               (64, 64, 8, 2, True), (128, 64, 8, 2, True), (128, 64, 8, 3, True),
               (128, 32, 8, 2, True), (64, 128, 8, 2, True), (128, 128, 8, 2, True)]


def flash_rows(res):
    """One 27B attention layer's causal prefill over T tokens (24 query heads, 4 KV heads,
    head dim 256, bf16): the contiguous-cache flash kernel over its tiles (bq, bk, warps,
    stages, split mask), the paged kernel (GQA rows packed, the server's path) and cuDNN's
    fused attention through jax.nn.dot_product_attention (the peer on the same machine).
    TFLOP/s counts the causal half: 2 x 2 x T^2 / 2 x heads x head_dim."""
    from engine.kernels.flash_prefill import flash_attend
    from engine.kernels.paged_prefill import paged_prefill_attend

    kvh, hd, nh, page = (4, 256, 24, 64) if not SMOKE else (2, 32, 6, 16)
    for t in PREFILL_TOKENS:
        t = -(-t // page) * page
        key = jax.random.split(jax.random.key(t), 3)
        kc = jax.random.normal(key[0], (1, 1, t, kvh, hd), jnp.bfloat16)
        vc = jax.random.normal(key[1], (1, 1, t, kvh, hd), jnp.bfloat16)
        q = jax.random.normal(key[2], (1, t, nh, hd), jnp.bfloat16)
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        flops = 2 * 2 * t * t / 2 * nh * hd
        runs = []
        for bq, bk, w, st, split in FLASH_TILES:
            runs.append((f"flash {bq}x{bk} w{w} s{st}{' split' if split else ''}", jax.jit(
                lambda kc, vc, q, p, bq=bq, bk=bk, w=w, st=st, sp=split: flash_attend(
                    kc, vc, jnp.int32(0), q, p, bq=bq, bk=bk, num_warps=w, num_stages=st,
                    split=sp)), (kc, vc, q, pos)))
        pool = KVPool(kc[0].reshape(1, t // page, page, kvh, hd),
                      vc[0].reshape(1, t // page, page, kvh, hd), None, None)
        table = jnp.arange(t // page, dtype=jnp.int32)[None]
        for rows, w in ((64, 8), (128, 8)):
            runs.append((f"paged rows {rows} w{w}", jax.jit(
                lambda pool, table, q, s, rows=rows, w=w: paged_prefill_attend(
                    pool, table, jnp.int32(0), q, s, block_rows=rows, num_warps=w)),
                (pool, table, q, pos)))
        runs.append(("cudnn (jax.nn.dot_product_attention)", jax.jit(
            lambda kc, vc, q, p: jax.nn.dot_product_attention(
                q, kc[0], vc[0], is_causal=True, implementation="cudnn")), (kc, vc, q, pos)))
        base = None
        for name, fn, args in runs:
            try:
                t_s = bench(fn, *args, reps=5)
                out = fn(*args).astype(jnp.float32)
            except Exception as e:  # noqa: BLE001  (a tile Triton cannot build is a result)
                print(f"attn prefill T{t} {name}: {type(e).__name__} {str(e)[:200]}", flush=True)
                continue
            base = out if base is None else base
            err = float(jnp.linalg.norm(out - base) / jnp.linalg.norm(base))
            res["attn_prefill"].append({"tokens": t, "impl": name, "ms_per_layer": t_s * 1e3,
                                        "tflops": flops / t_s / 1e12, "rel_err_vs_first": err})
            print(f"attn prefill T{t:>6} {name:>38}: {t_s * 1e3:8.2f} ms/layer "
                  f"{flops / t_s / 1e12:6.1f} TFLOP/s (x16 layers {t_s * 16:6.3f} s) "
                  f"err {err:.1e}", flush=True)


def main():
    global SHAPES, CONFIGS, CONTEXTS, FMTS, SMOKE, PREFILL_TOKENS, GDN_PREFILL_TILES, FLASH_TILES
    global ATTN_WARPS, PIECE_TOKENS, PIECE_CONTEXT, PIECE_TABLES, PIECE_PROGRAMS
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    ap.add_argument("--out", default="micro.json")
    ap.add_argument("--only", default="gemv,attention,gdn")
    ap.add_argument("--fmts", default=",".join(FMTS))
    ap.add_argument("--contexts", default="", help="paged decode contexts (default: "
                    + ",".join(map(str, CONTEXTS)) + ")")
    ap.add_argument("--attn-warps", default=",".join(map(str, ATTN_WARPS)))
    args = ap.parse_args()
    FMTS = tuple(args.fmts.split(","))
    ATTN_WARPS = tuple(int(w) for w in args.attn_warps.split(","))
    if args.contexts:
        CONTEXTS = tuple(int(c) for c in args.contexts.split(","))
    if args.smoke:
        SHAPES, CONFIGS, CONTEXTS = [(64, 256)], CONFIGS[:2], (128,)
        SMOKE, PREFILL_TOKENS, GDN_PREFILL_TILES = True, (200,), [(16, 4, 1)]
        FLASH_TILES = [(16, 16, 4, 1, False), (16, 16, 4, 1, True)]
        PIECE_TOKENS, PIECE_CONTEXT, PIECE_TABLES, PIECE_PROGRAMS = 5, 200, (None, 512), (8, 64)
    res = {"date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0].device_kind),
           "jax": jax.__version__, "gemv": [], "paged_decode": [], "gdn_decode": [],
           "gdn_prefill": [], "attn_prefill": [], "piece": []}
    parts = args.only.split(",")
    for name, fn in (("gdn", gdn_rows), ("gdnprefill", gdn_prefill_rows), ("flash", flash_rows),
                     ("attention", attention_rows), ("gemv", gemv_rows), ("piece", piece_rows)):
        if name in parts:
            fn(res)
            Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
