"""Where a cpu-lane decode step's time goes: the Engine with the cpu lane's settings on the
embedded tiny-chat, one session's greedy decode after a 4.6K-token prompt, two sessions decoding
together, and the compiled decode forward and the greedy sampler alone, under each kernel plan
in turn, in one process; one results file (command, date, machine, commit, each plan).

    .venv/bin/python bench/lab/cpu_decode_step.py [--plans reference,cpu,narrow] [--out FILE]

(narrow: the reference with narrow_decode.) docs/benchmarks/cpu_decode_step.json holds the last
run; docs/benchmarks/README.md its table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", default="reference,cpu,narrow")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import jax

    from bench.bench_27b import timed
    from bench.suites import commit, machine
    from engine.io.loader import build_embedded, load_model
    from engine.plan import CPU, REFERENCE

    plans = {"reference": REFERENCE, "cpu": CPU,
             "narrow": dataclasses.replace(REFERENCE, narrow_decode=True)}
    names = a.plans.split(",")
    if not set(names) <= set(plans):
        ap.error(f"--plans: choose from {sorted(plans)}")
    path = Path(tempfile.mkdtemp()) / "tiny-chat.ninfer"
    build_embedded("tiny-chat", path)
    model = load_model(path)
    runs = []
    for name in names:
        fig = measure(model, plans[name], timed)
        print(f"plan {name}: one session {fig['one_session_tok_s']:.1f} tok/s "
              f"({fig['step_ms']:.2f} ms a step); two sessions together "
              f"{fig['two_sessions_tok_s']:.1f} tok/s in all; the decode forward alone "
              f"{fig['forward_ms']:.2f} ms, the greedy sampler {fig['sampler_ms']:.2f} ms",
              flush=True)
        runs.append({"plan_name": name, "plan": plans[name].describe(), "figures": fig})
    if a.out:
        a.out.write_text(json.dumps({
            "command": ".venv/bin/python bench/lab/cpu_decode_step.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
            "commit": commit(), "versions": {"jax": jax.__version__},
            "model": "embedded tiny-chat, the cpu lane's engine settings", "runs": runs},
            indent=1) + "\n")
    return 0


def measure(model, plan, timed) -> dict:
    """One plan's figures: a lone session's decode after a 4.6K-token prompt (128 tokens), two
    100-token sessions decoding 256 tokens each together, the decode forward and sampler alone."""
    import jax.numpy as jnp
    import numpy as np

    from engine.engine import DoneEvent, Engine, GenerationRequest, TokenEvent
    from engine.runtime.sampling import SamplingParams, batch_paths
    from lanes.profile import load_profile

    lane = load_profile("cpu")
    eng = Engine(model, context_tokens=lane.context_tokens, prefill_chunk=lane.prefill_chunk,
                 max_concurrency=lane.max_concurrency, max_queue=4,
                 capacity_tokens=lane.kv_capacity_tokens, state_slots=lane.state_slots, plan=plan)
    eng.compile()
    eng.start()
    ids = [int(x) for x in np.random.default_rng(0).integers(1000, 50000, 4600)]

    def run(prompts, n):
        qs = [queue.Queue() for _ in prompts]
        t0 = time.perf_counter()
        for p, q in zip(prompts, qs):
            eng.submit(GenerationRequest(prompt_ids=p, sampling=SamplingParams(temperature=0.0),
                                         max_tokens=n, stop_ids=frozenset(),
                                         emit=lambda ev, q=q: q.put((time.perf_counter(), ev))))
        out = []
        for q in qs:
            times = []
            while True:
                t, ev = q.get(timeout=600)
                if isinstance(ev, TokenEvent):
                    times.append(t)
                elif isinstance(ev, DoneEvent):
                    out.append((times, t))
                    break
        return t0, out

    _, [(ts, _)] = run([ids], 128)
    step = (ts[-1] - ts[0]) / (len(ts) - 1)
    t0, both = run([ids[:100], ids[100:200]], 256)
    together = 512 / (max(end for _, end in both) - t0)  # their 100-token prefills included
    eng.stop()

    B = lane.max_concurrency
    tokens = jnp.zeros((B, 1), jnp.int32)
    lengths = jnp.asarray([1] + [0] * (B - 1), jnp.int32)
    box = {"cache": eng.mem.cache}

    def forward():
        logits, _, box["cache"] = eng.runner.forward(tokens, box["cache"], lengths)
        return logits
    forward_s, logits = timed(forward, reps=40)
    logits = logits[:, 0]
    args = (np.zeros((B,), np.float32), np.zeros((B,), np.int32), np.ones((B,), np.float32),
            np.zeros((B, 2), np.uint32), np.zeros((B,), np.int32))
    paths = batch_paths(args[0], args[1], args[2], logits.shape[-1])
    sampler_s, _ = timed(lambda: eng.sampler._sample(logits, *args, None, paths=paths), reps=40)
    return {"one_session_tok_s": round(1 / step, 2), "step_ms": round(step * 1e3, 2),
            "two_sessions_tok_s": round(together, 2),
            "forward_ms": round(forward_s * 1e3, 2), "forward_rows": f"{B} rows, one live",
            "sampler_ms": round(sampler_s * 1e3, 2)}


if __name__ == "__main__":
    sys.exit(main())
