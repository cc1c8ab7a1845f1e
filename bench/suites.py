"""`./ninfer bench SUITE`: the figures the README states, measured in one run, written to one
results file (JSON: the command, date, machine, commit, kernel plan, figures, and their ratios to
the physical limit and to a peer on the same machine); `--chart` also draws them (PNG).

    ./ninfer bench cpu [--out FILE] [--chart] [--prompt-tokens 4600] [--decode-tokens 128]
    ./ninfer bench h200 [--out FILE] [--chart]       # on the GPU machine

cpu: the embedded model's shapes on this machine's CPU, through the real server. A transformers
Qwen3_5ForCausalLM of those shapes (random fp32 weights) is saved, converted with
`./ninfer convert`, and served by `./ninfer serve --model` on the cpu lane (its plan, `cpu`);
a ~4.6K-token prompt streams through the OpenAI SDK (time to first token, then the decode rate
between the first and the last token), then transformers itself runs the same weights on the
same token count: one forward over the prompt (its prefill) and greedy steps with its cache (its
decode). The limit: the host's copy bandwidth (numpy) against the bytes a decode step reads.

h200: the serving engine at the qwen3.8-27b shapes with the h200 plan (bench/engine_27b.py: one
and two sequences at 1K / 32K / 128K, prefill of 8K / 32K / 128K, the copy roofline of each),
then the peer on the same GPU (bench/peer_hf.py: transformers with flash-linear-attention);
it needs a GPU and says so, writing nothing, anywhere else.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITES = ("cpu", "h200")


class SuiteUnavailable(RuntimeError):
    """This machine cannot run the suite (the message says why)."""


# ---- the record ------------------------------------------------------------------------------

def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return {"node": platform.node(), "system": platform.platform(), "cpu": cpu,
            "cores": len(os.sched_getaffinity(0)), "memory_bytes": mem,
            "python": platform.python_version()}


def commit() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout
    return {"sha": git("rev-parse", "HEAD").strip() or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip())}


def record(suite: str, argv: list[str], plan, figures: dict, ratios: dict, **extra) -> dict:
    import jax

    return {"suite": suite, "command": "./ninfer bench " + " ".join(argv),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine(), "commit": commit(),
            "versions": {"jax": jax.__version__, "backend": jax.default_backend()},
            "plan": plan.describe(), "figures": figures, "ratios": ratios, **extra}


# ---- cpu ---------------------------------------------------------------------------------------

def copy_bandwidth(nbytes: int = 1 << 29, reps: int = 5) -> float:
    """The host's copy bandwidth (bytes read + written a second), the best of `reps` copies."""
    import numpy as np

    a = np.ones(nbytes // 8, np.float64)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best


def decode_bytes(cfg, context: int) -> int:
    """fp32 bytes a decode step of one sequence reads: every weight but the embedding table
    (one row of it), and the attention layers' KV over the context."""
    n = cfg.param_count() - cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    kv = 2 * cfg.num_blocks * cfg.num_kv_heads * cfg.head_dim * context
    return 4 * (n + kv)


def prompt_text(n_words: int, salt: str) -> str:
    """A code-like prompt of n_words words, distinct by `salt` (no prefix reuse)."""
    words = []
    for i in range(n_words):
        words.append(f"value_{(i * 7919) % 1009}" if i % 3 else ("def" if i % 2 else "return"))
    return f"[{salt}] Review this code:\n" + " ".join(words)


def words_for(tok, tokens: int) -> int:
    """The number of words whose prompt_text encodes to about `tokens` tokens."""
    words = max(4, tokens // 4)
    for _ in range(3):  # the tokens a word converge: two refinements are within a few tokens
        n = len(tok.encode(prompt_text(words, "run 0")).ids)
        words = max(4, round(words * tokens / n))
    return words


def _stream_turn(client, model: str, text: str, max_tokens: int) -> dict:
    """One streamed response: seconds to the first text delta, then the output tokens and the
    seconds between the first and the last delta."""
    t0 = time.perf_counter()
    first = last = None
    out_tokens = in_tokens = 0
    stream = client.responses.create(model=model, input=text, max_output_tokens=max_tokens,
                                     temperature=0, stream=True,
                                     prompt_cache_key=f"bench-{time.monotonic_ns()}")
    for ev in stream:
        if ev.type == "response.output_text.delta":
            now = time.perf_counter()
            first = first or now
            last = now
        elif ev.type in ("response.completed", "response.incomplete"):
            out_tokens = ev.response.usage.output_tokens
            in_tokens = ev.response.usage.input_tokens
    if first is None:
        raise RuntimeError("the server streamed no text")
    return {"ttft_s": first - t0, "input_tokens": in_tokens, "output_tokens": out_tokens,
            "decode_s": last - first}


def _hf_checkpoint(cfg, work: Path) -> Path:
    """A random fp32 transformers model of cfg's shapes, saved with our tokenizer and chat
    template, for `./ninfer convert`."""
    from engine.text.chat import default_chat_template
    from engine.text.tokenizer import build_qwen35_tokenizer_json
    from tests.hf_models import build_hf

    src = work / "hf-tiny"
    build_hf(cfg, seed=5, weight_scale=1.0).save_pretrained(src)
    (src / "tokenizer.json").write_text(build_qwen35_tokenizer_json(), encoding="utf-8")
    (src / "chat_template.jinja").write_text(default_chat_template(), encoding="utf-8")
    return src


def _hf_peer(src: Path, ids, decode_tokens: int, reps: int) -> dict:
    """transformers on the same weights: the prompt's forward (best of reps), then greedy steps
    with its cache."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    x = torch.tensor([ids], dtype=torch.long)
    best = float("inf")
    with torch.no_grad():
        for _ in range(reps):
            t = time.perf_counter()
            out = model(x, use_cache=True)
            best = min(best, time.perf_counter() - t)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(decode_tokens):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        dt = time.perf_counter() - t
    return {"prefill_s": best, "prompt_tokens": len(ids), "decode_tokens": decode_tokens,
            "decode_tok_s": decode_tokens / dt, "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads()}


def run_cpu(args) -> dict:
    import openai
    from tokenizers import Tokenizer

    from engine.model.config import TINY
    from lanes.profile import load_profile
    from tests.serverproc import start_server

    lane = load_profile("cpu")
    cfg = TINY
    with tempfile.TemporaryDirectory(prefix="ninfer-bench-") as tmp:
        work = Path(tmp)
        t = time.perf_counter()
        src = _hf_checkpoint(cfg, work)
        artifact = work / "hf-tiny.ninfer"
        conv = subprocess.run([str(REPO / "ninfer"), "convert", "--from", str(src), "--out",
                               str(artifact), "--recipe", "fp32", "--quiet"], cwd=REPO,
                              capture_output=True, text=True)
        if conv.returncode != 0:
            raise RuntimeError(f"./ninfer convert failed:\n{conv.stderr[-2000:]}")
        print(f"bench cpu: peer checkpoint made and converted in {time.perf_counter() - t:.1f}s",
              file=sys.stderr)
        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
        words = words_for(tok, args.prompt_tokens)
        server = start_server(work / "state", "--lane", "cpu", "--model", str(artifact),
                              timeout=900)
        try:
            client = openai.OpenAI(base_url=server.api_url, api_key=server.key, max_retries=0,
                                   timeout=900)
            model = client.models.list().data[0].id
            _stream_turn(client, model, prompt_text(32, "warm"), 4)  # the first request's work
            turns = [_stream_turn(client, model, prompt_text(words, f"run {i}"),
                                  args.decode_tokens) for i in range(args.reps)]
        finally:
            server.stop()
        ids = tok.encode(prompt_text(words, "run 0")).ids
        # the server's prompt adds the chat template's few tokens: the peer gets as many
        ids = (ids * 2)[:turns[0]["input_tokens"]]
        peer = _hf_peer(src, ids, args.decode_tokens, args.reps)
    ttft = min(r["ttft_s"] for r in turns)
    rates = [(r["output_tokens"] - 1) / r["decode_s"] for r in turns if r["decode_s"] > 0]
    decode = max(rates) if rates else 0.0
    bw = copy_bandwidth()
    roof = bw / decode_bytes(cfg, turns[0]["input_tokens"])
    figures = {"prompt_tokens": turns[0]["input_tokens"], "ttft_s": ttft,
               "decode_tok_s": decode, "runs": turns, "peer": peer,
               "copy_bytes_per_s": bw, "decode_roofline_tok_s": roof,
               "lane": lane.name, "model": "hf-tiny (the embedded model's shapes, fp32)",
               "speculative": {**_speculative_cpu(lane),
                               "engine": _speculative_engine(lane, work / "state")}}
    ratios = {"ttft_over_peer_prefill": ttft / peer["prefill_s"],
              "decode_over_peer": decode / peer["decode_tok_s"],
              "decode_of_roofline": decode / roof}
    return record("cpu", args.argv, lane.plan, figures, ratios)


def _speculative_cpu(lane) -> dict:
    """Speculative decoding's figures on the cpu lane: prompt lookup on a coding transcript
    (bench/speculative_cpu.py, teacher-forced: acceptance and tokens a verify pass, which do
    not depend on weights), and what the lane serves with (its profile's [speculative])."""
    from bench.speculative_cpu import transcript_figures
    from engine.text.tokenizer import Tokenizer as QwenTokenizer

    return {"lane_setting": dict(lane.speculative or ()) or None,
            "transcript": transcript_figures(QwenTokenizer.qwen35()),
            "depends_on_weights": "no: teacher-forced on the transcript's own response"}


def _speculative_engine(lane, state_dir: Path, k: int = 4, tokens: int = 64) -> dict:
    """Each drafter through the engine on the lane's own model (greedy, the coding transcript's
    prompt, K = k): acceptance and tokens a verify pass, and the decode rate; off for the
    rate without speculation. Every run must give the tokens of the run without speculation."""
    from bench.speculative_cpu import PROMPT, engine_run
    from engine.io.loader import ensure_embedded, load_model
    from engine.runtime.speculative import METHODS, SpecConfig

    name = lane.model.split(":", 1)[1]
    model = load_model(ensure_embedded(state_dir, name, lane.model_sha256))
    prompt = model.tokenizer.encode(PROMPT)
    runs = {"model": name, "k": k}
    for method in METHODS:
        spec = SpecConfig.from_settings(method, k) if method != "off" else None
        runs[method] = engine_run(model, prompt, tokens, spec)
        if method != "off":
            assert runs[method]["tokens"] == runs["off"]["tokens"], method
    for method in METHODS:
        del runs[method]["tokens"]
    runs["depends_on_weights"] = ("yes: what a drafter proposes, and so its acceptance, "
                                  "follows the model's output; the embedded model's MTP layer "
                                  "is untrained")
    return runs


# ---- h200 ---------------------------------------------------------------------------------------

def run_h200(args) -> dict:
    import jax

    from engine.plan import H200

    if args.engine_json:
        return _h200_composed(args)
    if jax.default_backend() != "gpu":
        raise SuiteUnavailable(f"the h200 suite needs a GPU; JAX's backend here is "
                               f"{jax.default_backend()!r}")
    with tempfile.TemporaryDirectory(prefix="ninfer-bench-") as tmp:
        out = Path(tmp) / "engine_27b.json"
        # 8K is there for its prefill; decode is stated at 1K / 32K / 128K
        cmd = [sys.executable, str(REPO / "bench" / "engine_27b.py"), "--plan", "h200",
               "--batches", "1,2", "--contexts", "1024,8192,32768,131072", "--modes", "1",
               "--reps", str(args.reps), "--decode-tokens", "64", "--turns", "4,64",
               "--budget-s", "420",
               "--out", str(out)]
        run = subprocess.run(cmd, cwd=REPO)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {run.returncode}")
        engine = json.loads(out.read_text())
        peer, peer_cmd = _h200_peer(Path(tmp) / "peer.json")
    figures, ratios = h200_figures(engine, peer)
    return record("h200", args.argv, H200, {**figures, "engine_27b": engine, "peer": peer},
                  ratios, engine_command=" ".join(cmd[1:]), peer_command=peer_cmd)


def _h200_composed(args) -> dict:
    """The record from parts measured in earlier device calls (bench/engine_27b.py's and
    bench/peer_hf.py's own result files), for a run split across calls: the machine is the one
    those files name, not this one."""
    from engine.plan import H200

    engine = json.loads(Path(args.engine_json).read_text())
    peer = json.loads(Path(args.peer_json).read_text()) if args.peer_json else None
    figures, ratios = h200_figures(engine, peer)
    gpu = {"gpu": engine.get("device"), "jax": engine.get("jax"), "python": engine.get("python")}
    return record("h200", args.argv, H200, {**figures, "engine_27b": engine, "peer": peer},
                  ratios, machine=gpu, composed_from=[args.engine_json, args.peer_json])


def _h200_peer(out: Path) -> tuple[dict, str]:
    """The peer on the same machine, after the engine's process has given the GPU back:
    transformers with flash-linear-attention's kernels (bench/peer_hf.py), prefill at 8K and
    32K and decode at 1K / 8K / 32K. Where transformers or torch is missing, the record says
    so instead."""
    cmd = [sys.executable, str(REPO / "bench" / "peer_hf.py"), "--contexts", "1024,8192,32768",
           "--steps", "16", "--out", str(out)]
    run = subprocess.run(cmd, cwd=REPO)
    if run.returncode != 0 or not out.exists():
        return {"error": f"{' '.join(cmd[1:])} exited {run.returncode}"}, " ".join(cmd[1:])
    return json.loads(out.read_text()), " ".join(cmd[1:])


def h200_figures(engine: dict, peer: dict | None = None) -> tuple[dict, dict]:
    """The README's H200 table from an engine_27b result: steady C1 and C2 tokens/s at each
    context (the B=1 engine's C1, the B=2 engine's C2), their fractions of the roofline, and
    prefill seconds from empty (the B=1 engine's)."""
    figures: dict = {"decode": {}, "prefill_s": {}, "turn_prefill_s": {},
                     "copy_bytes_per_s": engine.get("ceilings", {}).get("copy_bytes_per_s")}
    ratios: dict = {}
    for s in engine["summary"]:
        if (s["batch"], s["concurrency"]) not in ((1, 1), (2, 2)):
            continue
        row = figures["decode"].setdefault(str(s["context"]), {})
        key = f"c{s['concurrency']}"
        row[f"{key}_tok_s"] = s["steady_tokens_per_s_median"]
        if "steady_of_roofline" in s:
            row[f"{key}_of_roofline"] = s["steady_of_roofline"]
    for ctx, row in figures["decode"].items():
        if "c1_tok_s" in row and "c2_tok_s" in row:
            ratios[f"c2_over_c1_{ctx}"] = row["c2_tok_s"] / row["c1_tok_s"]
        if "c1_of_roofline" in row:
            ratios[f"c1_of_roofline_{ctx}"] = row["c1_of_roofline"]
    for run in engine["runs"]:
        if run.get("batch") == 1 and run.get("prefill"):
            figures["prefill_s"][str(run["context"])] = run["prefill"][0]["seconds"]
            for t in run.get("turns", []):
                figures["turn_prefill_s"].setdefault(str(run["context"]), {})[
                    str(t["tokens"])] = t["seconds"]
    figures["prefill_s_note"] = "one prompt from empty through the engine (B=1)"
    for p in (peer or {}).get("runs", []):
        ctx = str(p["context"])
        ours = figures["decode"].get(ctx, {}).get("c1_tok_s")
        if ours:
            ratios[f"c1_over_peer_decode_{ctx}"] = ours / p["decode_tokens_per_s"]
        if ctx in figures["prefill_s"] and p["context"] >= 8192:
            ratios[f"prefill_peer_over_ours_{ctx}"] = p["prefill_s"] / figures["prefill_s"][ctx]
    return figures, ratios


# ---- chart ---------------------------------------------------------------------------------------

def chart(res: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SuiteUnavailable("--chart needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = res["figures"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    if res["suite"] == "cpu":
        a.bar(["ours (server TTFT)", "transformers prefill"], [f["ttft_s"],
                                                              f["peer"]["prefill_s"]])
        a.set_ylabel("seconds")
        a.set_title(f"{f['prompt_tokens']}-token prompt")
        b.bar(["ours", "transformers", "copy roofline"],
              [f["decode_tok_s"], f["peer"]["decode_tok_s"], f["decode_roofline_tok_s"]])
        b.set_ylabel("tokens/s")
        b.set_title("greedy decode, one sequence")
    fig.suptitle(f"./ninfer bench {res['suite']} — {res['date'][:10]}, "
                 f"{res['machine']['cpu']}, {res['commit']['sha'] and res['commit']['sha'][:10]}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- entry point ---------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ninfer bench", description=__doc__.splitlines()[0])
    ap.add_argument("suite", help=f"one of {', '.join(SUITES)}")
    ap.add_argument("--out", help="results file (default bench-results/<suite>.json)")
    ap.add_argument("--chart", action="store_true", help="also draw the figures (PNG beside it)")
    ap.add_argument("--prompt-tokens", type=int, default=4600)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--engine-json", help="h200: compose the record from this engine_27b result "
                    "(measured in an earlier call) instead of running it")
    ap.add_argument("--peer-json", help="h200, with --engine-json: the peer_hf result beside it")
    ap.add_argument("--reps", type=int, default=None,
                    help="runs of each figure (default: cpu 2, h200 5; medians)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        if e.code:
            print(f"ninfer bench: suites: {', '.join(SUITES)}", file=sys.stderr)
        return 2 if e.code else 0
    if args.suite not in SUITES:
        print(f"ninfer bench: unknown suite {args.suite!r}; suites: {', '.join(SUITES)}",
              file=sys.stderr)
        return 2
    if args.prompt_tokens < 16 or args.decode_tokens < 2 or (args.reps is not None and args.reps < 1):
        print("ninfer bench: --prompt-tokens >= 16, --decode-tokens >= 2, --reps >= 1; "
              f"suites: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    args.reps = args.reps or (5 if args.suite == "h200" else 2)
    args.argv = list(argv)
    out = Path(args.out or REPO / "bench-results" / f"{args.suite}.json")
    try:
        res = {"cpu": run_cpu, "h200": run_h200}[args.suite](args)
    except SuiteUnavailable as e:
        print(f"ninfer bench {args.suite}: {e}", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    os.replace(tmp, out)
    if args.chart:
        try:
            chart(res, out.with_suffix(".png"))
        except SuiteUnavailable as e:
            print(f"ninfer bench: {e}", file=sys.stderr)
            return 1
    f, r = res["figures"], res["ratios"]
    if args.suite == "cpu":
        print(f"prompt {f['prompt_tokens']} tokens: TTFT {f['ttft_s']:.3f} s (transformers "
              f"prefill {f['peer']['prefill_s']:.3f} s, ratio {r['ttft_over_peer_prefill']:.2f}); "
              f"decode {f['decode_tok_s']:.1f} tok/s (transformers "
              f"{f['peer']['decode_tok_s']:.1f}, {r['decode_over_peer']:.2f}x; "
              f"{100 * r['decode_of_roofline']:.0f}% of the copy roofline "
              f"{f['decode_roofline_tok_s']:.0f})")
        for row in f["speculative"]["transcript"]["prompt_lookup"]:
            print(f"prompt lookup K={row['k']}: acceptance {row['acceptance_rate']:.2f}, "
                  f"{row['tokens_per_pass']:.2f} tokens a verify pass (coding transcript)")
    if args.suite == "h200":
        print(f"{'context':>8} {'C1 tok/s':>9} {'of roof':>8} {'C2 tok/s':>9} {'C2/C1':>6} "
              f"{'prefill s':>10}")
        for ctx, row in f["decode"].items():
            print(f"{ctx:>8} {row.get('c1_tok_s', float('nan')):>9.1f} "
                  f"{100 * row.get('c1_of_roofline', float('nan')):>7.1f}% "
                  f"{row.get('c2_tok_s', float('nan')):>9.1f} "
                  f"{r.get(f'c2_over_c1_{ctx}', float('nan')):>6.2f} "
                  f"{f['prefill_s'].get(ctx, float('nan')):>10.3f}")
        for p in f["peer"].get("runs", []):
            print(f"peer (transformers + fla) {p['context']:>6}: prefill {p['prefill_s']:.2f} s, "
                  f"decode {p['decode_tokens_per_s']:.1f} tok/s")
        print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
