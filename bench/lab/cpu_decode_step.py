"""Where a cpu-lane decode step's time goes: the Engine with the cpu lane's settings on the
embedded tiny-chat, one session's greedy decode after a 4.6K-token prompt, two sessions decoding
together, and the compiled decode forward and the greedy sampler alone, under a kernel plan.

    .venv/bin/python bench/lab/cpu_decode_step.py [--plan reference|cpu|narrow]

(narrow: the reference with narrow_decode.) Figures of 2026-12-07 in docs/benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import queue
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", choices=("reference", "cpu", "narrow"), default="cpu")
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from engine.engine import DoneEvent, Engine, GenerationRequest, TokenEvent
    from engine.io.loader import build_embedded, load_model
    from engine.plan import CPU, REFERENCE
    from engine.runtime.sampling import SamplingParams, batch_paths
    from lanes.profile import load_profile

    plan = {"reference": REFERENCE, "cpu": CPU,
            "narrow": dataclasses.replace(REFERENCE, narrow_decode=True)}[a.plan]
    lane = load_profile("cpu")
    path = Path(tempfile.mkdtemp()) / "tiny-chat.ninfer"
    build_embedded("tiny-chat", path)
    model = load_model(path)
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
    print(f"plan {a.plan}: one session {1 / step:.1f} tok/s ({step * 1e3:.2f} ms a step)")
    t0, both = run([ids[:100], ids[100:200]], 256)
    print(f"two sessions together: {512 / (max(end for _, end in both) - t0):.1f} tok/s in all "
          f"(their 100-token prefills included)")
    eng.stop()

    def timed(f, n=40):
        jax.block_until_ready(f())
        t = time.perf_counter()
        for _ in range(n):
            jax.block_until_ready(f())
        return (time.perf_counter() - t) / n * 1e3

    B = lane.max_concurrency
    tokens = jnp.zeros((B, 1), jnp.int32)
    lengths = jnp.asarray([1] + [0] * (B - 1), jnp.int32)
    box = {"cache": eng.mem.cache}

    def forward():
        logits, _, box["cache"] = eng.runner.forward(tokens, box["cache"], lengths)
        return logits
    print(f"the decode forward ({B} rows, one live) alone: {timed(forward):.2f} ms")
    logits = forward()[:, 0]
    args = (np.zeros((B,), np.float32), np.zeros((B,), np.int32), np.ones((B,), np.float32),
            np.zeros((B, 2), np.uint32), np.zeros((B,), np.int32))
    paths = batch_paths(args[0], args[1], args[2], logits.shape[-1])
    print(f"the greedy sampler alone: "
          f"{timed(lambda: eng.sampler._sample(logits, *args, None, paths=paths)):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
