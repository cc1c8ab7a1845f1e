"""CPU lane cost against the lane's context size: the embedded tiny model in an engine sized
like lanes/profiles/cpu.toml (32K-token context, chunk 256) against one sized to the prompt,
prefilling a ~4K-token prompt and decoding 32 tokens. Measures what the paged attention's cost
follows: the live length or the table width.

    .venv/bin/python bench/cpu_context.py --out cpu_context.json [--label NAME]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.io.loader import ensure_embedded, load_model  # noqa: E402
from lanes.profile import load_profile  # noqa: E402
from tests.engine_runs import greedy_tokens  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", default=str(Path.home() / ".local/state/ninfer"))
    ap.add_argument("--prompt", type=int, default=4000)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="cpu_context.json")
    args = ap.parse_args()
    profile = load_profile("cpu")
    model = load_model(ensure_embedded(Path(args.state_dir), "tiny", profile.model_sha256))
    ids = [1000 + i % 5000 for i in range(args.prompt)]
    rows = []
    for ctx in (args.prompt + 256, profile.context_tokens):
        greedy_tokens(model, ids[:300], 2, context_tokens=ctx, prefill_chunk=256)  # compile
        t0 = time.perf_counter()
        _, done = greedy_tokens(model, [i + 1 for i in ids], 33, context_tokens=ctx,
                                prefill_chunk=256)
        row = {"context_tokens": ctx, "prompt_tokens": done.prompt_tokens,
               "prefill_s": done.prefill_s, "decode_tokens_per_s": 32 / done.decode_s,
               "wall_s": time.perf_counter() - t0}
        rows.append(row)
        print(f"{args.label} context {ctx:>6}: prefill {done.prompt_tokens} tokens "
              f"{done.prefill_s:6.2f} s, decode {row['decode_tokens_per_s']:5.1f} tok/s",
              flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "machine": "2-core CPU dev machine",
           "label": args.label, "argv": sys.argv[1:], "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
