"""Outputs of the model's forward on this machine's CPU, digested bit for bit: what a kernel
plan's refactor must leave unchanged.

    .venv/bin/python -m tests.plan_outputs --out tests/golden/cpu_outputs.json

Two runs, each a 40-token prefill then 3 greedy decode steps over a paged cache (as the engine
runs them): the embedded tiny model in fp32 with the plain-JAX references (the CPU lane), and
the test-small model in bf16 with int4_g64 matrices through the Pallas kernels in interpret
mode. Each gives the greedy tokens and the sha256 of every step's fp32 logits.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

PROMPT = 40
STEPS = 3


def _tiny_fp32():
    from engine.io.tiny import tiny_tensors
    from engine.model.config import TINY
    from engine.model.params import stack_params

    flat = {n: np.asarray(a, np.float32) for n, a in tiny_tensors(TINY)}
    return TINY, stack_params(flat, TINY), jnp.float32


def _small_int4_bf16():
    from engine.kernels.stacked import MATRICES
    from engine.model.config import TEST_SMALL
    from engine.model.params import random_flat_params, stack_params
    from engine.ops.quant import INT4_G64, quantize

    flat = random_flat_params(TEST_SMALL, seed=3)
    out = {}
    for n, a in flat.items():
        leaf = n.rsplit(".", 1)[-1]
        if (leaf in MATRICES or leaf == "lm_head") and "mtp" not in n:
            out[n] = quantize(a, INT4_G64)
        else:
            out[n] = jnp.asarray(a, jnp.bfloat16)
    return TEST_SMALL, stack_params(out, TEST_SMALL), jnp.bfloat16


def run(cfg, params, dtype, call_kw: dict) -> dict:
    import engine.model.model as M
    from engine.model.cache import init_paged_cache
    from engine.ops import paged_kv as pk

    pages = 4
    pool = pk.init_kv_pool(cfg, pages, pk.PAGE_SIZE, dtype)
    cache = init_paged_cache(cfg, pool, np.arange(pages, dtype=np.int32)[None], dtype)
    fwd = M.jit_forward()
    rng = np.random.default_rng(11)
    tokens = jnp.asarray(rng.integers(0, min(cfg.vocab_size, 5000), (1, PROMPT)), jnp.int32)
    digests, picked = [], []
    lengths = jnp.asarray([PROMPT], jnp.int32)
    for _ in range(STEPS + 1):
        logits, _, cache = fwd(params, cfg, tokens, cache, lengths=lengths, last_only=True,
                               **call_kw)
        row = np.asarray(logits[0, -1], np.float32)
        digests.append(hashlib.sha256(row.tobytes()).hexdigest())
        picked.append(int(row.argmax()))
        tokens, lengths = jnp.asarray([[picked[-1]]], jnp.int32), jnp.asarray([1], jnp.int32)
    return {"tokens": picked, "logits_sha256": digests}


def outputs(reference_kw: dict, pallas_kw: dict) -> dict:
    return {"tiny fp32 reference": run(*_tiny_fp32(), reference_kw),
            "test-small int4 bf16 pallas": run(*_small_int4_bf16(), pallas_kw)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        from engine.plan import preset
        kws = {"plan": preset("reference")}, {"plan": preset("pallas")}
    except ImportError:  # the tree before kernel plans
        kws = {"kernels": "xla"}, {"kernels": "pallas"}
    res = outputs(*kws)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
