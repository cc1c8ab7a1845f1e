"""Measure what the trained `tiny-chat` can and cannot do: greedy answers (fp32, the model's
forward over a contiguous cache) to fresh draws of every task (a seed training never used), the
retrieval task at 8,192 tokens with the fact at >= 90% depth, and how much probability the
untrained tokens get while it answers.

    .venv/bin/python -m engine.train.evaluate --artifact STATE/models/tiny-chat.ninfer --n 20
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import engine.model.model as M
from engine.train import data as D

EVAL_SEED = 9041


class Greedy:
    """Greedy decoding of one prompt at a time: a last-only prefill, then T = 1 steps."""

    def __init__(self, model, max_len: int = 8704):
        self.m, self.max_len = model, max_len
        self.fwd = M.jit_forward()
        self.trained = None
        self.margins = None  # a list: each step's top-1 minus top-2 logit is appended

    def __call__(self, ids: list[int], max_new: int = 48):
        cfg, params = self.m.cfg, self.m.params
        cache = M.init_cache(cfg, 1, self.max_len)
        width = -(-len(ids) // 256) * 256  # padded: one compile per 256 tokens of prompt
        toks = np.zeros((1, width), np.int32)
        toks[0, :len(ids)] = ids
        logits, _, cache = self.fwd(params, cfg, jnp.asarray(toks), cache,
                                    lengths=jnp.asarray([len(ids)], jnp.int32), last_only=True)
        out, worst = [], 0.0
        eos = set(self.m.tokenizer.eos_ids)
        for _ in range(max_new):
            lp = jax.nn.softmax(logits[0, -1])
            if self.trained is not None:
                worst = max(worst, float(1.0 - lp[self.trained].sum()))
            if self.margins is not None:
                top2 = jax.lax.top_k(logits[0, -1], 2)[0]
                self.margins.append(float(top2[0] - top2[1]))
            t = int(jnp.argmax(logits[0, -1]))
            out.append(t)
            if t in eos:
                break
            logits, _, cache = self.fwd(params, cfg, jnp.asarray([[t]], jnp.int32), cache)
        return out, worst


def _expected(task: str, completion: str) -> str:
    return completion.split("</think>\n\n")[-1]


def evaluate(model, n: int, n_long: int, long_tokens: int = 8192) -> dict:
    from engine.io.tiny_chat import load_trained

    tk = model.tokenizer
    g = Greedy(model)
    g.trained = jnp.asarray(load_trained()["vocab"])
    rng = np.random.default_rng(EVAL_SEED)
    report, worst = {}, 0.0
    for task in D.TASKS:
        ok, examples = 0, []
        for i in range(n):
            prompt, completion = D.chat_sample(rng, task)
            out, w = g(tk.encode(prompt))
            worst = max(worst, w)
            text = tk.decode(out)
            want = _expected(task, completion)
            hit = text == completion or text == want
            ok += hit
            if len(examples) < 2:
                examples.append({"asked": prompt.rsplit("<|im_start|>user\n", 1)[-1][:120],
                                 "answer": text, "pass": hit})
        report[task] = {"pass": ok, "of": n, "examples": examples}
    # retrieval at the qualification's length: the fact at >= 90% depth
    ok, lengths, secs = 0, [], []
    for i in range(n_long):
        n_words = int(long_tokens / 1.28)
        while True:
            prompt, completion, value = D.retrieval_sample(rng, n_words,
                                                           depth=float(rng.uniform(0.9, 0.97)))
            ids = tk.encode(prompt)
            if len(ids) >= long_tokens:
                break
            n_words += 200
        t = time.monotonic()
        out, w = g(ids, max_new=8)
        secs.append(round(time.monotonic() - t, 1))
        worst = max(worst, w)
        lengths.append(len(ids))
        ok += tk.decode(out) in (value + "<|im_end|>", "\n</think>\n\n" + value + "<|im_end|>")
    report["retrieve_8k"] = {"pass": ok, "of": n_long, "prompt_tokens": lengths,
                             "seconds_each": secs}
    report["untrained_token_mass_max"] = worst
    return report


def main(argv=None) -> int:
    from engine.io.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--n-long", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    report = evaluate(load_model(args.artifact), args.n, args.n_long)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
