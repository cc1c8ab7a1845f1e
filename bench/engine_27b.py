"""Decode and prefill through the serving engine itself (engine/engine.py: scheduler, paged
memory, sampler, chained steps) on the qwen3.8-27b shapes with synthetic weights, one GPU.

bench_27b.py times the jitted forward alone; this times what a request gets: the engine's
thread, its step log, the sampler, the host's token work and, with the plan's chain_decode,
decode steps chained on the device. The kernel plan is --plan's preset (engine/plan.py; default
h200) with --set's fields; --variants compares plan overrides in one process. For each engine
width B (max_concurrency) and context:

  prefill   one row's prompt of `ctx` random tokens, from empty: seconds and tokens/s (in an
            engine of B rows a prefill step is one sequence's piece)
  decode    C1 (row 0) and, where B > 1, C2 (rows 0 and 1 at once): each run a continuation
            of the row's stored state (the prompt extends what it holds, so only the new tokens
            are computed), --decode-tokens greedy tokens; the chained steps on and off in
            turn, --reps times each, in one process. tok/s counts each row from its own first
            token (what a client sees, so a C2 row includes the other row's new-turn prefill);
            "steady" counts every row while all of them decode (the batch's decode rate)
  turns     a new turn of each --turns size appended to row 0's history: its prefill seconds
            (what an agent's next turn waits before its first token)

    python3 bench/engine_27b.py --batches 1,2 --contexts 1024,32768,131072 --out e27.json
    .venv/bin/python bench/engine_27b.py --preset tiny --plan reference --batches 1,2 \
        --contexts 256,1024 --decode-tokens 32 --out /tmp/e_tiny.json     # the same on a CPU
    python3 bench/engine_27b.py --batches 1,2 --contexts 1024 --modes 1 \
        --variants 'base merge:attn_merge=true copy:gdn_conv_write=copy'   # plans compared
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import queue
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bench_27b import ceilings, decode_weight_bytes, random_params  # noqa: E402
from bench.plan_args import (add_plan_args, make_plan, parse_overrides,  # noqa: E402
                             parse_variants, prepare)
from engine.engine import Engine, GenerationRequest, TokenEvent  # noqa: E402
from engine.io.loader import LoadedModel  # noqa: E402
from engine.model.config import QWEN38_27B, preset  # noqa: E402
from engine.ops.paged_kv import kv_bytes_per_token  # noqa: E402
from engine.runtime.states import state_image_bytes  # noqa: E402
from engine.runtime.sampling import SamplingParams  # noqa: E402
from engine.text.tokenizer import Tokenizer  # noqa: E402

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


class Rows:
    """Each row's token history (what its stored state holds once a request is done)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.ids: dict[int, list[int]] = {}
        self.times: dict[int, list[float]] = {}  # the last request's token arrival times

    def request(self, rows: list[int], extra: dict[int, list[int]], max_tokens: int,
                sampling: SamplingParams = SamplingParams(temperature=0)) -> list:
        """Submit one request per row at once (prompt = the row's history + extra[row]); wait
        for all; returns their DoneEvents and appends what each produced to its history."""
        qs = {}
        for r in rows:
            prompt = self.ids.get(r, []) + extra[r]
            q: queue.Queue = queue.Queue()
            self.engine.submit(GenerationRequest(
                prompt_ids=prompt, sampling=sampling, max_tokens=max_tokens,
                stop_ids=frozenset(), emit=lambda ev, q=q: q.put((time.monotonic(), ev)),
                principal="bench", session=f"row{r}"))
            qs[r] = (q, prompt)
        dones = []
        for r, (q, prompt) in qs.items():
            out, times = [], []
            while True:
                at, ev = q.get(timeout=900)
                if isinstance(ev, TokenEvent):
                    times.append(at)  # when the engine thread emitted it
                    out.append(ev.token_id)
                    continue
                if ev.finish_reason not in ("length", "stop"):
                    raise RuntimeError(f"row {r}: {ev.finish_reason} {ev.error}")
                dones.append(ev)
                break
            self.ids[r] = prompt + out
            self.times[r] = times
        return dones

    def steady_rate(self, rows: list[int]) -> float:
        """Tokens a second over all `rows` while every one of them decodes: from the latest
        first token to the last token, so a row's rate does not include the time another
        row's prompt took (the rows' new tokens are prefilled one after another)."""
        t0 = max(self.times[r][0] for r in rows)
        t1 = max(self.times[r][-1] for r in rows)
        n = sum(sum(1 for t in self.times[r] if t > t0) for r in rows)
        return n / (t1 - t0) if t1 > t0 else float("nan")


SAMPLINGS = {"greedy": SamplingParams(temperature=0),
             "t0.7": SamplingParams(temperature=0.7),
             "t0.7p0.9": SamplingParams(temperature=0.7, top_p=0.9)}


def trace_run(rows: Rows, a, mode: bool, sampling: str, conc: int, variant: str = "") -> str:
    """One decode run of rows 0..conc-1 under jax.profiler.trace; returns the gzipped xplane's
    path."""
    import gzip
    import shutil
    import tempfile

    from bench.profile_summary import newest_xplane

    eng = rows.engine
    eng.loop.chain.enabled = mode
    narrow = 'n' if eng.runner.narrow_decode else ''
    path = (f"{a.trace}{'-' + variant if variant else ''}-b{eng.B}{narrow}-c{conc}-{int(mode)}-{sampling}"
            ".xplane.pb.gz")
    rng = np.random.default_rng(11)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            rows.request(list(range(conc)),
                         {r: rng.integers(10, 1000, 4).tolist() for r in range(conc)}, 16,
                         SAMPLINGS[sampling])
        with open(newest_xplane(d), "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    log(f"traced B={eng.B} C{conc} overlap={int(mode)} {sampling}: {path}")
    return path


def add_roofline(res: dict, summary: list, cfg, params, kv, dt) -> None:
    """The copy ceiling (read + write, as torch's device copy measures it; the higher of
    torch's and JAX's), measured after the engines have stopped, and each summary row's
    roofline: the bytes one step reads (every decode weight, each row's KV over its context,
    its recurrent state) at that ceiling."""
    pk = ceilings()
    wbytes = decode_weight_bytes(params)
    kv_tok = kv_bytes_per_token(cfg, kv)
    state = state_image_bytes(cfg, jnp.dtype(dt).itemsize)  # conv in dt, fp32 state
    res["ceilings"] = pk
    res["step_bytes"] = {"weights": wbytes, "kv_per_token": kv_tok, "state_per_row": state}
    for s in summary:
        c = s["concurrency"]
        moved = wbytes + c * (s["context"] * kv_tok + state)
        s["step_bytes"] = moved
        s["roofline_tokens_per_s"] = c * pk["copy_bytes_per_s"] / moved
        s["steady_of_roofline"] = s["steady_tokens_per_s_median"] / s["roofline_tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=QWEN38_27B.name)
    ap.add_argument("--weights", default="int4_g64")
    add_plan_args(ap, "h200", "every engine runs")
    ap.add_argument("--batches", default="1,2", help="engine widths (max_concurrency)")
    ap.add_argument("--contexts", default="1024,32768,131072")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="decode runs per mode (on/off)")
    ap.add_argument("--modes", default="1,0", help="chained decode steps on (1) and off "
                    "(0), in turn, set on each running engine (the plan's chain_decode)")
    ap.add_argument("--sampling", default="greedy", help=f"decode runs' sampling, in turn: "
                    f"some of {sorted(SAMPLINGS)}")
    ap.add_argument("--narrow", default="", help="for engines of more than one row: the "
                    "plan's narrow_decode values, each its own engine (e.g. 0,1; default: "
                    "each variant's plan's own)")
    ap.add_argument("--variants", default="", help="plans compared in one process, each its "
                    "own engines: space-separated NAME[:field=value,...], each plan field "
                    "over --plan and --set (e.g. 'base merge:attn_merge=true "
                    "copy:gdn_conv_write=copy'; values true/false, integers, strings)")
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--room", type=int, default=2048, help="context beyond the longest prompt")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv", default="", choices=["", "bfloat16", "float32", "int8"],
                    help="the KV pool's dtype (default: --dtype; int8: codes and per-row "
                         "scales, the engine's int8 KV format)")
    ap.add_argument("--turns", default="4,64,500,2000", help="new turns' sizes: the time to "
                    "prefill each, appended to row 0's history at every context")
    ap.add_argument("--budget-s", type=float, default=560.0, help="stop starting parts past it")
    ap.add_argument("--trace", default="", help="also trace, at each engine's first context, "
                    "one run per mode and sampling at its widest concurrency into "
                    "FILE-b<B>[n]-c<C>-<overlap>-<sampling>.xplane.pb.gz (n: narrow; trace_step.py "
                    "--read FILE prints its timelines)")
    ap.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the copy ceiling at the end (needs a GPU) and state each "
                         "decode figure as a fraction of its roofline")
    ap.add_argument("--out", default="engine_27b.json")
    a = ap.parse_args()
    sets = parse_overrides(a.set)
    base = make_plan(a.plan, sets, where=f"--plan {a.plan} --set {a.set!r}")
    variants = [(vname, over, make_plan(a.plan, {**sets, **over}, where=f"--variants {vname}"))
                for vname, over in parse_variants(a.variants)]
    # XLA's flags before JAX starts its backend; the CUDA ops built for the plans that call them
    prepare(base, *(p for _, _, p in variants))
    cfg = preset(a.preset)
    dt = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[a.dtype]
    kv = {"": dt, "bfloat16": jnp.bfloat16, "float32": jnp.float32, "int8": jnp.int8}[a.kv]
    contexts = [int(c) for c in a.contexts.split(",") if c]
    modes = [m == "1" for m in a.modes.split(",") if m]
    samplings = [x for x in a.sampling.split(",") if x]
    turns = [int(x) for x in a.turns.split(",") if x]
    res = {"date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0]),
           "jax": jax.__version__, "python": platform.python_version(), "argv": sys.argv[1:],
           "model": cfg.name, "weights": f"synthetic {a.weights}", "plan": base.describe(),
           "kv_dtype": jnp.dtype(kv).name,
           "runs": []}
    t = time.monotonic()
    params = random_params(cfg, dt, a.weights)
    jax.block_until_ready(params)
    log(f"{a.weights} params built in {time.monotonic() - t:.1f}s")
    tok = Tokenizer.qwen35()
    model = LoadedModel(cfg=cfg, params=params, tokenizer=tok, chat_template="",
                        sha256="synthetic", path=Path("synthetic"), compute_dtype=dt,
                        kv_dtype=kv)
    top = min(cfg.vocab_size, tok.vocab_size) - 1000
    rng = np.random.default_rng(5)

    def save():
        Path(a.out).write_text(json.dumps(res, indent=2))

    widths = [int(b) for b in a.batches.split(",") if b]
    narrows = [x in ("1", "true") for x in a.narrow.split(",") if x]
    for vname, venv, vplan, B, narrow in [
            (v, o, p, B, n) for v, o, p in variants for B in widths
            for n in ((narrows or [p.narrow_decode]) if B > 1 else [False])]:
        # each engine's own plan: a static argument of its forward, so two plans are two
        # traces (no caches to clear between variants)
        plan = dataclasses.replace(vplan, narrow_decode=narrow)
        # room for what row 0's history gains past the longest prompt: every decode run's
        # new tokens and output (C1 and C2 runs each rep, then the traced ones), and the turns
        runs = (a.reps * min(B, 2) + 1) * len(modes) * len(samplings)
        grow = runs * (4 + a.decode_tokens) + sum(turns) + 2 * len(turns)
        eng = Engine(model, context_tokens=max(contexts) + a.room + grow,
                     prefill_chunk=a.prefill_chunk,
                     max_concurrency=B, plan=plan, state_slots=2 * B + 2)
        compile_s = eng.warmup()
        eng.start()
        log(f"{vname + ' ' if vname else ''}B={B} narrow={int(narrow)}: compiled and warmed in "
            f"{compile_s:.1f}s")
        rows = Rows(eng)
        try:
            for ctx in contexts:
                if time.monotonic() - T0 > a.budget_s:
                    log(f"B={B} ctx={ctx}: skipped, over the budget")
                    res["runs"].append({"variant": vname, "batch": B, "narrow": narrow,
                                        "context": ctx, "skipped": "budget"})
                    continue
                for r in rows.ids:  # the last context's stored states free their pages
                    eng.forget_session("bench", f"row{r}")
                rows.ids = {}
                run = {"variant": vname, "overrides": venv,
                       "plan_digest": plan.digest(), "batch": B, "narrow": narrow,
                       "context": ctx, "prefill": [], "decode": []}
                for r in range(B):  # each row's prompt from empty, one at a time
                    ids = rng.integers(10, top, ctx).tolist()
                    d, = rows.request([r], {r: ids}, 1)
                    run["prefill"].append({"row": r, "tokens": d.prompt_tokens,
                                           "computed": d.computed_tokens,
                                           "seconds": round(d.prefill_s, 4),
                                           "tokens_per_s": round(d.computed_tokens /
                                                                 d.prefill_s, 1)})
                    log(f"B={B} ctx={ctx} row {r}: prefill {d.computed_tokens} tokens "
                        f"{d.prefill_s:.3f}s")
                concs = [1] + ([2] if B >= 2 else [])
                for rep in range(a.reps):
                    for smp in samplings:
                        for mode in modes:
                            for c in concs:
                                eng.loop.chain.enabled = mode  # the engine thread is idle here
                                chained0 = eng.chained_steps
                                new = {r: rng.integers(10, top, 4).tolist() for r in range(c)}
                                dones = rows.request(list(range(c)), new, a.decode_tokens,
                                                     SAMPLINGS[smp])
                                dec = max(d.decode_s for d in dones)
                                n = sum(d.output_tokens - 1 for d in dones)
                                e = {"concurrency": c, "overlap": mode, "sampling": smp,
                                     "rep": rep, "tokens_per_s": round(n / dec, 2),
                                     "steady_tokens_per_s": round(
                                         rows.steady_rate(list(range(c))), 2),
                                     "turn_prefill_s": [round(d.prefill_s, 4) for d in dones],
                                     "ms_per_step": round(dec / (a.decode_tokens - 1) * 1e3,
                                                          3),
                                     "cached": [d.cached_tokens for d in dones],
                                     "paths": [d.path for d in dones],
                                     "chained_steps": eng.chained_steps - chained0}
                                run["decode"].append(e)
                                log(f"{vname + ' ' if vname else ''}B={B} ctx={ctx} C{c} {smp} overlap={int(mode)}: "
                                    f"{e['tokens_per_s']:.1f} tok/s, steady "
                                    f"{e['steady_tokens_per_s']:.1f}, new turn's 4 tokens "
                                    f"{e['turn_prefill_s']}s ({e['ms_per_step']:.2f} "
                                    f"ms a step, {e['chained_steps']} chained, paths "
                                    f"{e['paths']})")
                for size in turns:  # a new turn of `size` tokens on row 0's history
                    d, = rows.request([0], {0: rng.integers(10, top, size).tolist()}, 1)
                    run.setdefault("turns", []).append(
                        {"tokens": size, "computed": d.computed_tokens,
                         "seconds": round(d.prefill_s, 4)})
                    log(f"B={B} ctx={ctx} a new turn of {size} tokens: prefill "
                        f"{d.computed_tokens} in {d.prefill_s:.3f}s")
                if a.trace and ctx == contexts[0]:
                    res.setdefault("traces", []).extend(
                        trace_run(rows, a, mode, smp, max(concs), vname) for smp in samplings
                        for mode in modes)
                res["runs"].append(run)
                save()
        finally:
            eng.stop()
            del eng
    summary = []
    for run in res["runs"]:
        for c in (1, 2):
            for smp in samplings:
                for mode in modes:
                    got = [d for d in run.get("decode", [])
                           if d["concurrency"] == c and d["overlap"] == mode
                           and d["sampling"] == smp]
                    v = [d["tokens_per_s"] for d in got]
                    if v:
                        summary.append({"variant": run.get("variant", ""),
                                        "batch": run["batch"],
                                        "narrow": run.get("narrow", False),
                                        "context": run["context"],
                                        "concurrency": c, "sampling": smp, "overlap": mode,
                                        "tokens_per_s_median": float(np.median(v)),
                                        "steady_tokens_per_s_median": float(np.median(
                                            [d["steady_tokens_per_s"] for d in got]))})
    if a.roofline and jax.default_backend() == "gpu":
        add_roofline(res, summary, cfg, params, kv, dt)
    res["summary"] = summary
    save()
    print(f"{'variant':>8} {'B':>2} {'narrow':>6} {'ctx':>7} {'C':>2} {'sampling':>9} {'overlap':>7} "
          f"{'tok/s':>8} {'steady':>8} {'roof':>6}")
    for s in summary:
        print(f"{s['variant']:>8} {s['batch']:>2} {int(s['narrow']):>6} {s['context']:>7} {s['concurrency']:>2} "
              f"{s['sampling']:>9} {int(s['overlap']):>7} {s['tokens_per_s_median']:>8.1f} "
              f"{s['steady_tokens_per_s_median']:>8.1f} "
              f"{100 * s.get('steady_of_roofline', float('nan')):>5.1f}%")
    for run in res["runs"]:
        for p in run.get("prefill", []):
            print(f"prefill {run.get('variant') or ''} B={run['batch']} narrow={int(run.get('narrow', False))} "
                  f"ctx={run['context']} row {p['row']}: "
                  f"{p['seconds']:.3f}s {p['tokens_per_s']:.0f} tok/s")
        for t in run.get("turns", []):
            print(f"turn B={run['batch']} ctx={run['context']} +{t['tokens']} tokens: "
                  f"{t['seconds']:.3f}s")


if __name__ == "__main__":
    main()
