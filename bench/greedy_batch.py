"""Batch invariance on the GPU: the greedy continuation of a prompt decoded alone (C1) must be
the same as when it shares the batch with another sequence (C2). qwen3.8-27b shapes, random
int4_g64 weights, paged KV, the kernel plan of --plan (engine/plan.py; default h200, the decode
path being benchmarked) with --set's fields over it.

  python3 bench/greedy_batch.py --prompt 64 --steps 32 --out greedy.json
  python3 bench/greedy_batch.py --set paged_merge=chain --out greedy_chain.json
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

from bench.bench_27b import random_params  # noqa: E402
from bench.plan_args import add_plan_args, label, plan_from_args, prepare  # noqa: E402
import engine.model.model as M  # noqa: E402
from engine.model.config import QWEN38_27B, preset  # noqa: E402
from engine.ops import paged_kv as pk  # noqa: E402


def greedy(params, cfg, prompts, steps, plan, weights_dtype):
    b, t = prompts.shape
    per_row = pk.kv_pages_needed(t + steps + 1)
    pool = pk.init_kv_pool(cfg, b * per_row, pk.PAGE_SIZE, weights_dtype)
    table = np.arange(b * per_row, dtype=np.int32).reshape(b, per_row)
    cache = M.init_paged_cache(cfg, pool, table, weights_dtype)
    fwd = M.jit_forward()
    logits, _, cache = fwd(params, cfg, prompts, cache, last_only=True, plan=plan)
    toks, all_logits = [], []
    for _ in range(steps):
        tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
        toks.append(np.asarray(tok))
        all_logits.append(np.asarray(logits[:, -1]))
        logits, _, cache = fwd(params, cfg, tok[:, None], cache, plan=plan)
    return np.stack(toks, 1), np.stack(all_logits, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--weights", default="int4_g64")
    add_plan_args(ap, "h200")
    ap.add_argument("--preset", default=QWEN38_27B.name)
    ap.add_argument("--out", default="greedy.json")
    args = ap.parse_args()
    plan = plan_from_args(args)
    prepare(plan)  # XLA's flags before JAX starts; the CUDA ops registered where it calls them
    cfg, dt = preset(args.preset), jnp.bfloat16
    params = random_params(cfg, dt, args.weights)
    prompts = jax.random.randint(jax.random.key(11), (2, args.prompt), 0, cfg.vocab_size,
                                 jnp.int32)
    t1, l1 = greedy(params, cfg, prompts[:1], args.steps, plan, dt)
    t2, l2 = greedy(params, cfg, prompts, args.steps, plan, dt)
    same_tokens = bool((t1[0] == t2[0]).all())
    first_diff = int(np.argmax(t1[0] != t2[0])) if not same_tokens else None
    bit_equal = bool((l1[0] == l2[0]).all())
    max_diff = float(np.abs(l1[0].astype(np.float64) - l2[0]).max())
    res = {"date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0].device_kind),
           "weights": args.weights, "plan": plan.describe(), "prompt": args.prompt,
           "steps": args.steps, "same_greedy_tokens": same_tokens, "first_diff": first_diff,
           "logits_bit_equal": bit_equal, "max_abs_logit_diff": max_diff,
           "tokens_c1": t1[0].tolist(), "tokens_c2_row0": t2[0].tolist(),
           "distinct_tokens": int(len(set(t1[0].tolist())))}
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"greedy C1 vs C2 row 0 ({args.weights}, {label(plan)}): same tokens {same_tokens} "
          f"(first diff {first_diff}), logits bit-equal {bit_equal}, max |diff| {max_diff:.3g}, "
          f"{res['distinct_tokens']} distinct tokens", flush=True)


if __name__ == "__main__":
    main()
