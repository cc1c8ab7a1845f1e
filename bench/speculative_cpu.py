"""Speculative decoding on the CPU: each drafter's acceptance rate and tokens per verify pass on a
coding-style transcript (a file read, then the same file written back with an edit).

    .venv/bin/python bench/speculative_cpu.py [--state-dir DIR] [--out FILE.json]
        [--tokens 128] [--k 2 4 8]

Two measurements, written with the command, date, machine and commit:
- "transcript": the drafter against the transcript's own response, teacher-forced (the target
  emits the response's tokens; a pass keeps the draft up to its first wrong token, then the
  target's token). No weights are involved, so the figures hold for any model that answers
  the way the transcript does: they say what the drafter can give where a model repeats text.
- "engine": the embedded tiny model through the engine, greedy, speculation off and on, on the
  transcript's prompt: tokens per second, verify passes, acceptance. The tiny model's weights
  are random, so its output rarely repeats the prompt and its acceptance says nothing about a
  trained model; the rate shows what a verify pass costs on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.suites import commit, machine  # noqa: E402
from engine.engine import DoneEvent, Engine, GenerationRequest  # noqa: E402
from engine.io.loader import ensure_embedded, load_model  # noqa: E402
from engine.runtime.drafters import MTP, PromptLookup  # noqa: E402
from engine.runtime.sampling import SamplingParams  # noqa: E402
from engine.runtime.speculative import SpecConfig  # noqa: E402
from lanes.profile import load_profile  # noqa: E402

FILE = '''def load_rows(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, value = line.split("=", 1)
            rows.append((name.strip(), value.strip()))
    return rows


def merge(rows, defaults):
    out = dict(defaults)
    for name, value in rows:
        out[name] = value
    return out
'''
PROMPT = ("<|im_start|>user\nHere is config.py:\n```python\n" + FILE + "```\nMake load_rows "
          "skip lines without '=' and keep the rest as it is.<|im_end|>\n"
          "<|im_start|>assistant\n")
RESPONSE = ("```python\n" + FILE.replace(
    '            name, value = line.split("=", 1)\n',
    '            if "=" not in line:\n                continue\n'
    '            name, value = line.split("=", 1)\n') + "```\n")


class _Seq:  # what a drafter reads of a row
    def __init__(self, prompt, output):
        self.prompt_ids, self.output_ids = prompt, output


def teacher_forced(drafter, prompt: list[int], response: list[int], k: int) -> dict:
    """Passes over `response` as speculation would make them if the target emitted it."""
    out, passes, drafted, accepted = [response[0]], 0, 0, 0
    while len(out) < len(response):
        room = min(k, len(response) - len(out) - 1)
        draft = drafter.propose(_Seq(prompt, out), room)[:room] if room > 0 else []
        want = response[len(out):len(out) + len(draft) + 1]
        n = 0
        while n < len(draft) and draft[n] == want[n]:
            n += 1
        out += want[:n + 1]
        passes, drafted, accepted = passes + 1, drafted + len(draft), accepted + n
    return {"k": k, "verify_passes": passes, "drafted": drafted, "accepted": accepted,
            "acceptance_rate": round(accepted / max(drafted, 1), 4),
            "tokens_per_pass": round((len(response) - 1) / passes, 3)}


def transcript_figures(tok, ks=(2, 4, 8)) -> dict:
    """Prompt lookup on the coding transcript, teacher-forced: acceptance rate and tokens a
    verify pass at each K (independent of weights: the transcript's own response is the
    target's)."""
    prompt, response = tok.encode(PROMPT), tok.encode(RESPONSE)
    drafter = PromptLookup()
    return {"prompt_tokens": len(prompt), "response_tokens": len(response),
            drafter.name: [teacher_forced(drafter, prompt, response, k) for k in ks]}


class OwnGreedy:
    """Proposes the tiny model's own greedy continuation (from the run without speculation):
    every draft is accepted, so the run shows what a verify pass of K + 1 positions costs."""
    name = "own_greedy"

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, seq, k):
        return self.tokens[len(seq.output_ids):len(seq.output_ids) + k]


def engine_run(model, prompt: list[int], tokens: int, spec) -> dict:
    eng = Engine(model, context_tokens=1024, prefill_chunk=256, speculative=spec)
    eng.warmup()
    eng.start()
    try:
        result = None
        for _ in range(2):  # the first run compiles the verify pass
            q: queue.Queue = queue.Queue()
            eng.submit(GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(
                temperature=0.0), max_tokens=tokens, stop_ids=frozenset(), emit=q.put))
            out = []
            while not isinstance(done := q.get(timeout=600), DoneEvent):
                out.append(done.token_id)
            result = done
    finally:
        eng.stop()
    fig = {"decode_tokens_per_s": round((result.output_tokens - 1) / result.decode_s, 2),
           "output_tokens": result.output_tokens, "tokens": out}
    if result.speculative:
        s = result.speculative
        drafted, accepted = sum(s["drafted"]), sum(s["accepted"])
        fig.update(verify_passes=s["verify_passes"], drafted=drafted, accepted=accepted,
                   acceptance_rate=round(accepted / max(drafted, 1), 4),
                   tokens_per_pass=round((result.output_tokens - 1) / s["verify_passes"], 3))
    return fig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", default=str(Path.home() / ".local/state/ninfer"))
    ap.add_argument("--out", default="docs/benchmarks/speculative_cpu.json")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    model = load_model(ensure_embedded(Path(args.state_dir), "tiny",
                                       load_profile("cpu").model_sha256))
    tok = model.tokenizer
    prompt = tok.encode(PROMPT)
    drafter = PromptLookup()
    transcript = transcript_figures(tok, args.k)
    load = {"before": os.getloadavg()}
    engine = {"off": engine_run(model, prompt, args.tokens, None)}
    own = OwnGreedy(engine["off"]["tokens"])
    for d in (drafter, MTP(), own):
        for k in args.k:
            engine[f"{d.name}_k{k}"] = engine_run(model, prompt, args.tokens, SpecConfig(d, k))
            assert engine[f"{d.name}_k{k}"]["tokens"] == own.tokens, "speculation changed tokens"
    for fig in engine.values():
        del fig["tokens"]
    load["after"] = os.getloadavg()
    rec = {"command": "bench/speculative_cpu.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": machine(), "commit": commit(), "load_average": load,
           "depends_on_weights": {
               "transcript": "no: teacher-forced on the transcript's own response",
               "engine": "prompt_lookup: yes (the tiny model's weights are random: its output "
                         "rarely repeats the prompt); mtp: yes (its MTP layer is as random as "
                         "the rest: the figure is the drafter's cost, not its acceptance on "
                         "trained weights); own_greedy: no (every draft accepted by "
                         "construction: it shows what a verify pass costs on this CPU, where "
                         "the pass reads the weights once a position)"},
           "transcript": transcript, "engine": engine}
    Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({"transcript": transcript, "engine": engine}, indent=1))


if __name__ == "__main__":
    main()
