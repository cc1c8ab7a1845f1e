"""The peer at the qwen3.8-27b shapes: HF transformers' Qwen3_5ForCausalLM (random bf16 weights
made on the GPU) with flash-linear-attention's Triton kernels for the GDN layers when the
`fla` package imports (the wheel travels with the benchmark: pip install --no-deps fla-core),
SDPA attention. Measures prefill time and decode tokens/s at the contexts given, one sequence.

  python3 bench/peer_hf.py --contexts 1024,8192,32768 --steps 8 --out peer.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

from engine.io.hf_config import hf_text_config_dict  # noqa: E402
from engine.model.config import QWEN38_27B, preset  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="peer.json")
    ap.add_argument("--preset", default=QWEN38_27B.name, help="a tiny one for a CPU smoke run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefill-reps", type=int, default=2)
    args = ap.parse_args()
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    try:
        import fla  # noqa: F401
        fla_version = getattr(fla, "__version__", "?")
    except ImportError:
        fla_version = None
    hcfg = transformers.Qwen3_5TextConfig(**hf_text_config_dict(preset(args.preset)))
    hcfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(dev):
        torch.set_default_dtype(torch.bfloat16)
        model = transformers.Qwen3_5ForCausalLM(hcfg).eval()
    sync()
    res = {"date": time.strftime("%Y-%m-%d"),
           "device": torch.cuda.get_device_name() if dev == "cuda" else dev,
           "torch": torch.__version__, "transformers": transformers.__version__,
           "fla": fla_version, "build_s": time.perf_counter() - t0, "runs": []}
    print(f"peer model built in {res['build_s']:.1f}s, fla {fla_version}", flush=True)
    with torch.no_grad():  # the decode path's first steps (kernel selection) unmeasured
        out = model(torch.randint(0, hcfg.vocab_size, (1, 256), device=dev), use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(8):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        del out, past
    for ctx in [int(c) for c in args.contexts.split(",")]:
        ids = torch.randint(0, hcfg.vocab_size, (1, ctx), device=dev)
        with torch.no_grad():
            # the first forward at a length compiles and autotunes Triton's kernels for it:
            # the prefill is the best of --prefill-reps after one unmeasured forward
            prefills = []
            for rep in range(args.prefill_reps + 1):
                out = None
                sync()
                t0 = time.perf_counter()
                out = model(ids, use_cache=True, logits_to_keep=1)
                sync()
                if rep:
                    prefills.append(time.perf_counter() - t0)
            prefill = min(prefills)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(args.steps):
                sync()
                t0 = time.perf_counter()
                out = model(tok, past_key_values=past, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                sync()
                times.append(time.perf_counter() - t0)
                past = out.past_key_values
        times.sort()
        step = times[len(times) // 2]
        row = {"context": ctx, "prefill_s": prefill, "decode_ms_per_step": step * 1e3,
               "decode_tokens_per_s": 1 / step}
        res["runs"].append(row)
        print(f"peer ctx {ctx:>6}: prefill {prefill:7.2f} s, decode {step * 1e3:7.1f} ms/step "
              f"({1 / step:5.1f} tok/s)", flush=True)
        del out, past
        if dev == "cuda":
            torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
