"""CPU engine throughput on the embedded tiny model: prefill and decode, C1 vs C2.

    .venv/bin/python bench/cpu_engine.py [--state-dir DIR] [--out FILE.json] [--plan reference]
        [--set chain_decode=false]

The engine runs the kernel plan of --plan (engine/plan.py; default reference, the CPU lane's)
with --set's fields over it.
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.plan_args import add_plan_args, plan_from_args, prepare  # noqa: E402
from engine.engine import Engine, GenerationRequest, TokenEvent  # noqa: E402
from engine.io.loader import ensure_embedded, load_model  # noqa: E402
from engine.runtime.sampling import SamplingParams  # noqa: E402
from lanes.profile import load_profile  # noqa: E402


def run(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    qs = []
    t0 = time.perf_counter()
    for ids in prompts:
        q: queue.Queue = queue.Queue()
        engine.submit(GenerationRequest(prompt_ids=ids, sampling=SamplingParams(temperature=0),
                                        max_tokens=max_tokens, stop_ids=frozenset(),
                                        emit=q.put))
        qs.append(q)
    dones = []
    for q in qs:
        while True:
            ev = q.get(timeout=600)
            if not isinstance(ev, TokenEvent):
                dones.append(ev)
                break
    wall = time.perf_counter() - t0
    decode_s = max(d.decode_s for d in dones)
    return {"wall_s": wall, "ttft_s": [d.queue_s + d.prefill_s for d in dones],
            "decode_tokens_per_s": sum(d.output_tokens - 1 for d in dones) / decode_s,
            "prompt_tokens": [d.prompt_tokens for d in dones]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", default=str(Path.home() / ".local/state/ninfer"))
    ap.add_argument("--out", default="cpu_engine.json")
    add_plan_args(ap, "reference", "the engine runs")
    args = ap.parse_args()
    plan = plan_from_args(args)
    prepare(plan)  # the plan's XLA flags (none for reference) before JAX starts its backend
    profile = load_profile("cpu")
    model = load_model(ensure_embedded(Path(args.state_dir), "tiny", profile.model_sha256))
    eng = Engine(model, context_tokens=4096, prefill_chunk=profile.prefill_chunk,
                 max_concurrency=2, plan=plan)
    t0 = time.perf_counter()
    compile_s = eng.warmup()
    eng.start()
    tok = model.tokenizer
    short = [tok.encode("Write a function that reverses a list."),
             tok.encode("Explain what a hash map is.")]
    text = open(Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURE.md").read()
    long_ids = tok.encode(text * 4)[:2048]
    run(eng, short[:1], 8)  # warm the sampler path
    res = {"date": time.strftime("%Y-%m-%d"), "machine": "2-core CPU dev machine",
           "model": "embedded tiny (fp32)", "plan": plan.describe(),
           "warmup_compile_s": compile_s,
           "load_to_ready_s": time.perf_counter() - t0}
    res["c1"] = run(eng, short[:1], 64)
    res["c2"] = run(eng, short, 64)
    res["prefill_2048"] = run(eng, [long_ids], 2)
    res["prefill_2048"]["prefill_tokens_per_s"] = 2048 / res["prefill_2048"]["ttft_s"][0]
    res["c2_over_c1_decode"] = res["c2"]["decode_tokens_per_s"] / res["c1"]["decode_tokens_per_s"]
    # chained decode steps (the plan's chain_decode): on or off, and how many were chained
    res["overlap"], res["chained_steps"] = eng.loop.chain.enabled, eng.chained_steps
    eng.stop()
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"compile {compile_s:.1f}s | decode C1 {res['c1']['decode_tokens_per_s']:.1f} tok/s, "
          f"C2 {res['c2']['decode_tokens_per_s']:.1f} tok/s aggregate "
          f"({res['c2_over_c1_decode']:.2f}x) | prefill 2048 tokens "
          f"{res['prefill_2048']['prefill_tokens_per_s']:.0f} tok/s | overlap {res['overlap']} "
          f"({res['chained_steps']} steps chained)")


if __name__ == "__main__":
    main()
