"""Warm continuation vs cold prefill on the CPU engine (embedded tiny model), and C1 vs C2 decode.

For each context length L: a first request builds an L-token transcript and its state; the next
turn (L + 32 new tokens) is timed twice: continuing from the stored state, and cold (a principal
with no stored states). Time to first token is queue + prefill, as the engine reports it.

    .venv/bin/python bench/cpu_reuse.py [--lengths 1024,4096,8192] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_engine import run  # noqa: E402
from engine.engine import Engine, GenerationRequest, TokenEvent  # noqa: E402
from engine.io.loader import ensure_embedded, load_model  # noqa: E402
from engine.runtime.sampling import SamplingParams  # noqa: E402
from lanes.profile import load_profile  # noqa: E402


def one(engine, ids, principal, max_tokens=2):
    import queue

    q: queue.Queue = queue.Queue()
    engine.submit(GenerationRequest(prompt_ids=ids, sampling=SamplingParams(temperature=0),
                                    max_tokens=max_tokens, stop_ids=frozenset(), emit=q.put,
                                    principal=principal, session=principal))
    toks = []
    while True:
        ev = q.get(timeout=1800)
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
        else:
            return toks, ev


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", default=str(Path.home() / ".local/state/ninfer"))
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--out", default="cpu_reuse.json")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    profile = load_profile("cpu")
    model = load_model(ensure_embedded(Path(args.state_dir), "tiny", profile.model_sha256))
    eng = Engine(model, context_tokens=max(lengths) + 256, prefill_chunk=profile.prefill_chunk,
                 max_concurrency=2, capacity_tokens=4 * (max(lengths) + 256), state_slots=16)
    eng.warmup()
    eng.start()
    tok = model.tokenizer
    corpus = tok.encode(open(Path(__file__).resolve().parent.parent / "engine" / "ops" / "gdn.py").read()
                        * 40)
    new_turn = tok.encode("<|im_start|>user\nNow explain the chunked form.<|im_end|>\n"
                          "<|im_start|>assistant\n")
    res = {"date": time.strftime("%Y-%m-%d"), "machine": "2-core CPU dev machine",
           "model": "embedded tiny (fp32, paged KV fp32)", "rows": []}
    # compile the snapshot/restore path once, outside the measurements
    warm_out, _ = one(eng, corpus[:100], "warmup")
    one(eng, corpus[:100] + warm_out + new_turn, "warmup")
    for i, n in enumerate(lengths):
        base = corpus[:n - 2]
        out, _ = one(eng, base, f"warm-{i}")  # state after base + out[:-1]
        turn2 = base + out + new_turn
        _, warm = one(eng, turn2, f"warm-{i}")
        _, cold = one(eng, turn2, f"cold-{i}")
        row = {"context": len(turn2), "warm_ttft_s": warm.queue_s + warm.prefill_s,
               "cold_ttft_s": cold.queue_s + cold.prefill_s, "warm_path": warm.path,
               "warm_computed": warm.computed_tokens, "cold_computed": cold.computed_tokens}
        row["speedup"] = row["cold_ttft_s"] / row["warm_ttft_s"]
        res["rows"].append(row)
        print(f"context {row['context']:>6}: warm {row['warm_ttft_s']:.3f}s "
              f"({row['warm_path']}, {row['warm_computed']} computed) vs cold "
              f"{row['cold_ttft_s']:.2f}s: {row['speedup']:.0f}x", flush=True)
    short = [tok.encode("Write a function that reverses a list."),
             tok.encode("Explain what a hash map is.")]
    res["c1"] = run(eng, short[:1], 64)
    res["c2"] = run(eng, short, 64)
    res["c2_over_c1_decode"] = res["c2"]["decode_tokens_per_s"] / res["c1"]["decode_tokens_per_s"]
    print(f"decode C1 {res['c1']['decode_tokens_per_s']:.1f} tok/s, C2 "
          f"{res['c2']['decode_tokens_per_s']:.1f} tok/s aggregate "
          f"({res['c2_over_c1_decode']:.2f}x)")
    eng.stop()
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
