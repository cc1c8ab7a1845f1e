"""Speculative decoding's verify pass on the serving engine: its cost against K, and the decode
rate it gives at a set acceptance rate (the H200 issue's run 3).

For each K, one engine with speculation on decodes the same prompt greedily, fed by a drafter
that knows the target's own greedy continuation (measured first, speculation off) and proposes
each position's right token with probability `a` (seeded), a wrong one otherwise. A draft is
kept up to its first wrong token, so `a` is the per-position acceptance the engine sees.
a = 1 is the upper bound (perfect drafts); 0.9 / 0.7 / 0.5 are what a real drafter might give.
Random weights give no real acceptance rate: only the verify cost (seconds a pass against K)
is a property of the engine; the tokens/s at each `a` are what it would give at that rate.

    python3 bench/spec_verify.py --k 1,2,4,8 --out spec_verify.json          # 27B shapes, GPU
    .venv/bin/python bench/spec_verify.py --preset tiny --plan reference --context 64 \
        --k 1,2 --accept 1,0.5 --tokens 16 --out /tmp/sv.json                 # the same on a CPU
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bench_27b import random_params  # noqa: E402
from bench.plan_args import make_plan, prepare  # noqa: E402
from bench.suites import commit, machine  # noqa: E402
from engine.engine import DoneEvent, Engine, GenerationRequest  # noqa: E402
from engine.io.loader import LoadedModel  # noqa: E402
from engine.model.config import QWEN38_27B, preset  # noqa: E402
from engine.runtime.sampling import SamplingParams  # noqa: E402
from engine.runtime.speculative import SpecConfig  # noqa: E402
from engine.text.tokenizer import Tokenizer  # noqa: E402


class AtRate:
    """Proposes the target's greedy continuation `ref`, each position right with probability
    `a` (seeded per engine run) and otherwise a token the target does not pick there."""
    name = "at_rate"

    def __init__(self, ref: list[int], a: float, seed: int = 0):
        self.ref, self.a, self.rng = ref, a, np.random.default_rng(seed)

    def propose(self, seq, k):
        done = len(seq.output_ids)
        return [t if self.rng.random() < self.a else t + 1
                for t in self.ref[done:done + k]]


def decode(model, prompt: list[int], tokens: int, spec, context: int, plan) -> dict:
    eng = Engine(model, context_tokens=context + tokens + 64, prefill_chunk=8192,
                 max_concurrency=1, max_queue=2, speculative=spec, plan=plan)
    t = time.monotonic()
    eng.warmup()
    eng.start()
    compile_s = time.monotonic() - t
    try:
        runs = []
        for _ in range(2):  # the first run's prefill is the same as the second's: time both
            q: queue.Queue = queue.Queue()
            eng.submit(GenerationRequest(
                prompt_ids=list(prompt), sampling=SamplingParams(temperature=0.0),
                max_tokens=tokens, stop_ids=frozenset(), emit=q.put, principal="b"))
            toks, first = [], None
            while not isinstance(ev := q.get(timeout=900), DoneEvent):
                toks.append(ev.token_id)
                if first is None:
                    first = time.monotonic()
            end = time.monotonic()
            runs.append({"tokens": toks, "decode_s": end - first, "done": ev})
        best = min(runs[1:] or runs, key=lambda r: r["decode_s"])
        out = {"compile_s": round(compile_s, 2), "output_tokens": len(best["tokens"]),
               "decode_s": best["decode_s"],
               "tokens_per_s": (len(best["tokens"]) - 1) / best["decode_s"],
               "tokens": best["tokens"]}
        if best["done"].speculative:
            sp = best["done"].speculative
            out.update(verify_passes=sp["verify_passes"], drafted=sum(sp["drafted"]),
                       accepted=sum(sp["accepted"]),
                       s_per_pass=best["decode_s"] / max(1, sp["verify_passes"]),
                       tokens_per_pass=(len(best["tokens"]) - 1) / max(1, sp["verify_passes"]))
        return out
    finally:
        eng.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/spec_verify.py")
    ap.add_argument("--preset", default=QWEN38_27B.name)
    ap.add_argument("--plan", default="h200")
    ap.add_argument("--weights", default="int4_g64")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens before decoding")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens a run")
    ap.add_argument("--k", default="1,2,4,8", help="draft lengths")
    ap.add_argument("--accept", default="1,0.9,0.7,0.5", help="per-position acceptance rates")
    ap.add_argument("--out", default="spec_verify.json")
    a = ap.parse_args(argv)
    ks = [int(k) for k in a.k.split(",") if k]
    rates = [float(x) for x in a.accept.split(",") if x]
    if not ks or any(not 1 <= k <= 8 for k in ks) or any(not 0 <= r <= 1 for r in rates):
        ap.error("--k: draft lengths in 1..8; --accept: rates in [0, 1]")
    plan = make_plan(a.plan, {}, where=f"--plan {a.plan}")
    prepare(plan)
    cfg = preset(a.preset)
    dt = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    params = random_params(cfg, dt, a.weights)
    tok = Tokenizer.qwen35()
    model = LoadedModel(cfg=cfg, params=params, tokenizer=tok, chat_template="",
                        sha256="synthetic", path=Path("synthetic"), compute_dtype=dt,
                        kv_dtype=dt)
    top = min(cfg.vocab_size, tok.vocab_size) - 1000
    prompt = [int(t) for t in np.random.default_rng(5).integers(100, top, a.context)]
    res = {"command": "python3 bench/spec_verify.py " + " ".join(argv or sys.argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
           "device": str(jax.devices()[0]), "jax": jax.__version__, "commit": commit(),
           "model": cfg.name, "weights": f"synthetic {a.weights}", "plan": plan.describe(),
           "context": a.context, "depends_on_weights": "s_per_pass: no (the verify pass's "
           "cost); tokens_per_s at each rate: the rate is set here, not measured"}
    plain = decode(model, prompt, a.tokens, None, a.context, plan)
    ref = plain.pop("tokens")
    res["plain"] = plain
    print(f"plain decode: {plain['tokens_per_s']:.1f} tok/s", flush=True)
    rows = []
    for k in ks:
        for r in rates:
            got = decode(model, prompt, a.tokens, SpecConfig(AtRate(ref, r), k), a.context,
                         plan)
            if got.pop("tokens") != ref:
                raise SystemExit(f"K={k} a={r}: the tokens differ from speculation off")
            rows.append({"k": k, "accept": r, **got,
                         "speedup": got["tokens_per_s"] / plain["tokens_per_s"]})
            print(f"K={k} a={r:.2f}: {got['tokens_per_s']:.1f} tok/s, "
                  f"{1e3 * got.get('s_per_pass', float('nan')):.2f} ms a pass, "
                  f"{got.get('tokens_per_pass', float('nan')):.2f} tokens a pass", flush=True)
            res["runs"] = rows
            Path(a.out).write_text(json.dumps(res, indent=1))
    res["runs"] = rows
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
