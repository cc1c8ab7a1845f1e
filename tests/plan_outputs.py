"""Outputs of the model's forward on this machine's CPU, digested bit for bit: what a kernel
plan's refactor must leave unchanged.

Two runs, each a 40-token prefill then 3 greedy decode steps over a paged cache (as the engine
runs them): the embedded tiny model in fp32 with the plain-JAX references (the CPU lane), and
the test-small model in bf16 with int4_g64 matrices through the Pallas kernels in interpret
mode. Each gives the greedy tokens and the sha256 of every step's fp32 logits.

XLA's CPU code differs between CPU kinds, so the fp32 bits do too: tests/golden/cpu_outputs.json
holds one recorded run of the tree before plans (commit BEFORE_PLANS) per machine kind it was
taken on. To add this machine's, from a clone with that commit:

    .venv/bin/python -m tests.plan_outputs --record tests/golden/cpu_outputs.json

which unpacks that commit's tree into a temporary folder, runs this module's copy there (the
same interpreter and packages), and appends the result with this machine's description.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

PROMPT = 40
STEPS = 3
BEFORE_PLANS = "31aa907d7401ad5e1e29c910a0f6eb2a21a396e3"
ROOT = Path(__file__).resolve().parent.parent
# the CPU features that decide which instructions XLA's CPU compiler may emit
ISA = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
       "avx512_fp16", "amx_tile", "amx_bf16")


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


def machine() -> str:
    """This CPU's model name and the instruction-set features XLA can use, as one line."""
    model, flags = platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == platform.machine():
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return f"{model}; {' '.join(f for f in ISA if f in flags) or 'no x86 features'}"


def recorded(path: Path) -> list[dict]:
    return json.loads(path.read_text())["runs"]


def before_plans_outputs() -> dict:
    """The outputs of the tree before plans on this machine: that commit's files from this
    clone's history, its own copy of this module run on them in a child interpreter."""
    with tempfile.TemporaryDirectory(prefix="before-plans-") as tmp:
        tree = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE_PLANS],
                              capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=tree, check=True)
        out = Path(tmp) / "outputs.json"
        subprocess.run([sys.executable, "-m", "tests.plan_outputs", "--out", str(out)],
                       cwd=tmp, check=True, capture_output=True)
        return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", required=True, metavar="GOLDEN",
                    help="append this machine's run of the tree before plans to GOLDEN")
    a = ap.parse_args(argv)
    path = Path(a.record)
    doc = json.loads(path.read_text())
    res = before_plans_outputs()
    if any(r["outputs"] == res for r in doc["runs"]):
        print("this machine's outputs are already recorded")
        return 0
    doc["runs"].append({"machine": machine(), "outputs": res})
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["runs"][-1], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
