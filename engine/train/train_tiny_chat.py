"""Train the embedded chat model `tiny-chat` (TINY's shapes) on the synthetic tasks of
engine/train/data.py and write the tensors the repository ships (engine/io/tiny_chat.py loads
them). Run outside CI, by hand, on the CPU:

    .venv/bin/python -m engine.train.train_tiny_chat --phase 0 --steps 500 --lr 3e-3 \
        --out P0.safetensors --raw P0.npz
    .venv/bin/python -m engine.train.train_tiny_chat --init P0.npz --phase 2 --steps 1200 \
        --lr 2e-3 --out engine/io/weights/tiny_chat.safetensors --raw P2.npz

(docs/benchmarks/trained_tiny.json has the times, losses and what the result can do). Then pin
the new file's sha256 in engine/io/tiny_chat.py and the artifact's in engine/io/tiny.py and
lanes/profiles/cpu.toml, and record the role corpus again (`./ninfer qualify --lane cpu
--record-corpus`). The shipped file is this recipe's, phase 2 run for 1,200 steps on the
device machine (bench/lab/tiny_chat_gpu_train.sh runs both phases there).

Phase 3 is phase 2 with more copying rows, retrieval rows of up to 2K tokens and one long row
of up to 10K a step (the CPU lane's qualification asks at 8.8K): a retrieval, or a tool turn
under tool descriptions as long as OMP's. Phase 4 continues phase 3's result (--init the file
it wrote) with more long retrievals, of 3.4K tokens and up, and short rows whose fact has little
or no filler around it. Phase 5 continues phase 3's result with long rows of up to 16K tokens,
half of them tool turns, the retrievals from 4K tokens up: OMP's own prompt is 13.6K tokens
before the user's request. Phase 6 is phase 5 with 70% tool turns among the long rows; phase 7
puts a date and a working directory before half the requests, as OMP does (candidate 9 copied
its year as the path to read). Phase 8 makes 30% of the long rows copying rows after 4K-16K
tokens of filler (engine/train/batches.py late_repeat). Phase 9 renders most tool rows in a
captured client's own system text and tool texts (--client: OMP's, captured from the pinned
client by bench/lab/omp_tool_prompt.py; candidates 8 and 9, trained on our shorter tool texts,
copy no path inside OMP's prompt even at 2K tokens), and holds the row all untrained ids share
at zero, as serving does. docs/benchmarks/trained_tiny.json has the runs.

Phase 0 teaches copying alone: each row is a span of 16 random tokens, drawn from 16 of the
trained ids chosen for that row, then a newline and the same span again; the loss is on the
second copy. The later phases keep a few such rows in every step so the skill stays. Copying
forms in phase 0 (the loss falls from ~12 to 0.1 between steps 200 and 275) from the start
given here: fresh layer weights (normal, std 0.02; the GDN decays and steps in the ranges the
architecture is built for; norms at their identity) and output rows that start as 0.1 x the
embedding rows, so that a copied token's own row already points at its logit; a word's forms
with and without a leading space start from rows that share half their direction
(`space_pairs`). The earlier start (the generator's weights, whose GDN state halves every
token, and output rows unrelated to the embedding) stayed at chance on the same task.

Deterministic: the data comes from numpy Generators with fixed seeds, the initial weights from
the embedded generator (engine/io/tiny.py) and a seeded Generator, the optimiser is a plain
Adam written here (optax is not a dependency). XLA's CPU reductions are deterministic on a
given machine and thread count; another machine may differ in the last bits of the result,
which the sha256 pin then catches.

Only some tokens are trained: the model trains over a compact vocabulary (the ids the data uses
and every id below VOCAB_BASE, plus one "background" row standing for every other token, whose
logit counts them all through a log(count) offset, so training pushes their total probability
down). The loss takes output rows only at the supervised positions (`supervised`), so the
vocabulary's size costs little. engine/io/tiny_chat.py expands the compact rows back to the
full vocabulary.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.io.tiny import tiny_tensors
from engine.model import model as M
from engine.model.cache import init_cache
from engine.model.config import TINY
from engine.text.tokenizer import Tokenizer
from engine.train import batches as B
from engine.train import data as D
from engine.train.batches import ALL_TASKS, PARTS, SUPERVISED, make_batch, supervised

VOCAB_BASE = 40960  # every id below this is trained too: Qwen's ids follow its merges, so these
                    # are the most common pieces of text and code, enough to copy most words
LAYER_STD = 0.02   # fresh layer weights
HEAD_TIE = 0.1     # output rows start as this times the embedding rows


def build_vocab(tk, seed: int, n: int = 4000) -> np.ndarray:
    """The sorted token ids training covers: every id below VOCAB_BASE, every id of n samples
    of each part, plus the chat template's and the tool-call markup's control tokens and every
    WORDS entry in the ways it is tokenized (alone, after a space, capitalised, after '/')."""
    rng = np.random.default_rng(seed)
    used: set[int] = set()
    for _ in range(n):
        for part in ("chat", "tools"):
            task = D.TASKS[rng.integers(len(D.TASKS))] if part == "tools" else \
                D.TASKS[rng.integers(4)]
            p, c = D.chat_sample(rng, task)
            used.update(tk.encode(p + c))
    for _ in range(50):
        p, c, _ = D.retrieval_sample(rng, 300)
        used.update(tk.encode(p + c))
    for w in D.WORDS + D.DIRS:
        for form in (w, " " + w, w.capitalize(), " " + w.capitalize(), "/" + w, "_" + w):
            used.update(tk.encode(form))
    for i in range(100):
        used.update(tk.encode(f" {i}") + tk.encode(str(i)))
    used.update(range(VOCAB_BASE))
    return np.array(sorted(used), np.int64)


def _fresh(name: str, shape: tuple[int, ...], g) -> np.ndarray:
    """A layer tensor's starting value (see the module's docstring)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":  # decay rates A in [1, 16]
        return np.log(g.uniform(1.0, 16.0, shape))
    if leaf == "dt_bias":  # softplus(dt_bias) = dt, log-uniform in [1e-3, 0.1]
        dt = np.exp(g.uniform(math.log(1e-3), math.log(0.1), shape))
        return dt + np.log(-np.expm1(-dt))
    if leaf == "conv1d":
        return g.uniform(-0.5, 0.5, shape)
    if name.endswith("linear_attn.norm"):  # the GDN output norm's plain weight
        return np.ones(shape)
    if len(shape) == 1:  # zero-centred norms: 1 + w
        return np.zeros(shape)
    return g.normal(0.0, LAYER_STD, shape)


def space_pairs(tk, vocab: np.ndarray) -> list[tuple[int, int]]:
    """(compact index of " w", of "w") for every trained word that is one token both ways: a
    word read after a space ("Read src/...") is written without one at the start of an answer
    or an argument ("<parameter=path>\nsrc/...")."""
    index = {int(t): i for i, t in enumerate(vocab)}
    pairs = []
    for i, t in enumerate(vocab):
        text = tk.decode([int(t)])
        if len(text) > 1 and text[0] == " " and text[1] != " ":
            bare = tk.encode(text[1:])
            if len(bare) == 1 and bare[0] in index:
                pairs.append((i, index[bare[0]]))
    return pairs


def init_params(vocab: np.ndarray, seed: int, pairs=()) -> tuple[dict, dict]:
    """(trainable params tree over the compact vocabulary, the config it runs with). The two
    forms of each of `pairs` start from rows that share half their direction, so that copying
    one form raises the other's logit too and the model only has to learn which form fits."""
    cfg = dataclasses.replace(TINY, name="tiny-chat-train", vocab_size=len(vocab) + 1)
    g = np.random.default_rng(seed)
    flat = {}
    for name, arr in tiny_tensors(TINY):  # sorted: embed_tokens comes before lm_head
        a = np.asarray(arr, np.float32)
        zero = np.zeros((1, a.shape[-1]), np.float32)
        if name == "embed_tokens":
            a = np.concatenate([a[vocab], zero])
            for sp, bare in pairs:
                a[bare] = math.sqrt(0.5) * (a[sp] + a[bare])
        elif name == "lm_head":
            a = np.concatenate([flat["embed_tokens"][:-1] * HEAD_TIE, zero])
        elif name.startswith("layers.") or name == "norm":
            a = _fresh(name, a.shape, g)
        flat[name] = np.asarray(a, np.float32)
    return M.stack_params(flat, cfg), cfg


def shipped_tree(path: Path, n_vocab: int) -> dict:
    """A file of --out as --raw's {keystr: array, "vocab"} over the compact vocabulary: its
    int8 rows dequantized, the background embedding row (which the file leaves out) zero, the
    untrained MTP head the generator's."""
    from engine.io.tiny_chat import load_trained

    t = load_trained(path, hashlib.sha256(Path(path).read_bytes()).hexdigest())
    flat = {k: v for k, v in t.items() if k.startswith("layers.") or k == "norm"}
    flat.update((k, np.asarray(v, np.float32)) for k, v in tiny_tensors(TINY)
                if k.startswith("mtp."))  # the generator's, as init_params leaves them
    flat["embed_tokens"] = np.concatenate([t["embed_rows"], np.zeros_like(t["embed_rows"][:1])])
    flat["lm_head"] = np.concatenate([t["lm_head_rows"], t["lm_head_background"][None]])
    cfg = dataclasses.replace(TINY, name="tiny-chat-train", vocab_size=n_vocab + 1)
    tree = M.stack_params(flat, cfg)
    out, _ = jax.tree.flatten_with_path(tree)
    return {"vocab": t["vocab"], **{jax.tree_util.keystr(k): np.asarray(v) for k, v in out}}


def loss_fn(params, cfg, batches, n_background: float):
    total, per_task = 0.0, []
    for toks, idx, tgt, w, lengths, task_ids in batches:
        cache = init_cache(cfg, toks.shape[0], toks.shape[1])
        _, hidden, _ = M.forward(params, cfg, toks, cache, lengths=lengths)
        h = jnp.take_along_axis(hidden, idx[..., None], axis=1)
        logits = (h @ params["lm_head"].T).astype(jnp.float32)
        logits = logits.at[..., -1].add(math.log(n_background))
        lp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0]
        row = (nll * w).sum(1)
        total = total + row.sum()
        per_task.append((row, w.sum(1), task_ids))
    n = sum(b[3].sum() for b in batches)
    return total / n, per_task


def adam_init(params):
    z = jax.tree.map(jnp.zeros_like, params)
    return {"m": z, "v": jax.tree.map(jnp.zeros_like, params), "t": jnp.zeros((), jnp.int32)}


def adam_update(params, grads, st, lr, b1=0.9, b2=0.98, eps=1e-8, clip=1.0):
    gnorm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, clip / (gnorm + 1e-6))
    grads = jax.tree.map(lambda g: g * scale, grads)
    t = st["t"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, st["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, st["v"], grads)
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t
    params = jax.tree.map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps),
                          params, m, v)
    return params, {"m": m, "v": v, "t": t}, gnorm


def lr_at(step: int, steps: int, peak: float, warmup: int = 30) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--data-seed", type=int, help="the data's seed (default: --seed + the "
                    "phase); --seed also fixes the vocabulary, so a run that continues another "
                    "keeps --seed and draws new data with this")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop early at this wall time")
    ap.add_argument("--init", type=Path, help="start from a raw tree (.npz) of --raw, or from "
                    "a file of --out (.safetensors: its int8 matrices dequantized)")
    ap.add_argument("--phase", type=int, default=1, choices=tuple(range(10)),
                    help="the data mix")
    ap.add_argument("--client", type=Path, action="append", default=[],
                    help="phase 9: a captured client request (bench/lab/omp_tool_prompt.py "
                    "capture) whose system text and tools some tool rows are rendered in")
    ap.add_argument("--long-tokens", type=int, help="the long row's length instead of the "
                    "phase's (0: no long row; the CPU cannot hold a 16K-token row's step)")
    ap.add_argument("--raw", type=Path, help="also save the raw trained tree (.npz) here")
    ap.add_argument("--log", type=Path, help="write the loss curve (JSON) here")
    args = ap.parse_args(argv)
    if args.phase == 9 and not args.client:
        ap.error("phase 9 needs at least one --client capture")
    B.CLIENTS[:] = [B.load_client(c) for c in args.client]
    parts = PARTS[args.phase]
    if args.long_tokens is not None:
        if args.long_tokens:
            B.LONG[args.phase] = (1, args.long_tokens)
        else:
            parts = tuple(p for p in parts if p != "long")
    t0 = time.monotonic()
    tk = Tokenizer.qwen35()
    vocab = build_vocab(tk, args.seed)
    if args.init:
        init = (np.load(args.init) if args.init.suffix == ".npz"
                else shipped_tree(args.init, len(vocab)))
        if not np.array_equal(init["vocab"], vocab):
            raise SystemExit(f"{args.init} was trained over another vocabulary")
    remap = np.full((TINY.vocab_size,), len(vocab), np.int32)
    remap[vocab] = np.arange(len(vocab), dtype=np.int32)
    params, cfg = init_params(vocab, args.seed, space_pairs(tk, vocab))
    if args.init:
        flat, _ = jax.tree.flatten_with_path(params)
        params = jax.tree.unflatten(jax.tree.structure(params), [
            jnp.asarray(init[jax.tree_util.keystr(k)]) for k, _ in flat])
    n_bg = float(TINY.vocab_size - len(vocab))
    added = {i for t in tk.added_tokens() for i in tk.encode(t)}
    pool = np.array([i for i in vocab if int(i) not in added], np.int32)  # repeat rows' ids
    print(f"vocab {len(vocab)} ids, setup {time.monotonic() - t0:.1f}s", flush=True)

    def step_fn(params, st, batches, lr):
        (loss, per_task), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, cfg, batches, n_bg)
        # the row every untrained id embeds to stays zero: the shipped file leaves it out,
        # and serving gives those ids zero rows (engine/io/tiny_chat.py trained_tensors)
        grads["embed_tokens"] = grads["embed_tokens"].at[-1].set(0.0)
        params, st, gnorm = adam_update(params, grads, st, lr)
        return params, st, loss, per_task, gnorm

    step = jax.jit(step_fn, donate_argnums=(0, 1))
    st = adam_init(params)
    data_seed = args.seed + args.phase if args.data_seed is None else args.data_seed
    rng = np.random.default_rng(data_seed)
    sums = {t: [0.0, 0.0] for t in ALL_TASKS}
    log = []
    for i in range(args.steps):
        batches = []
        for part in parts:
            toks, mask, lengths, task_ids = make_batch(rng, tk, part, args.phase, pool)
            # a target outside the trained vocabulary would train the background row up
            nxt = remap[np.concatenate([toks[:, 1:], toks[:, :1]], axis=1)]
            mask = mask * (nxt != len(vocab))
            idx, tgt, w = supervised(mask, nxt, SUPERVISED[part])
            batches.append(tuple(jnp.asarray(a) for a in (remap[toks], idx, tgt, w, lengths,
                                                           task_ids)))
        params, st, loss, per_task, gnorm = step(params, st, batches,
                                                 lr_at(i, args.steps, args.lr))
        for row, cnt, tid in per_task:
            for r, c, t in zip(np.asarray(row), np.asarray(cnt), np.asarray(tid)):
                sums[ALL_TASKS[t]][0] += float(r)
                sums[ALL_TASKS[t]][1] += float(c)
        if (i + 1) % 25 == 0 or i < 3 or i == args.steps - 1:
            per = {t: round(s / max(c, 1), 4) for t, (s, c) in sums.items()}
            entry = {"step": i + 1, "loss": round(float(loss), 4), "gnorm": round(float(gnorm), 3),
                     "per_task": per, "wall_s": round(time.monotonic() - t0, 1)}
            log.append(entry)
            print(json.dumps(entry), flush=True)
            sums = {t: [0.0, 0.0] for t in ALL_TASKS}
        if args.minutes and time.monotonic() - t0 > args.minutes * 60:
            print(f"stopping at step {i + 1}: wall time limit", flush=True)
            break
    if args.raw:  # the trained tree as it left the optimiser (to re-export without training)
        flat, _ = jax.tree.flatten_with_path(params)
        np.savez(args.raw, vocab=vocab, **{jax.tree_util.keystr(k): np.asarray(v)
                                            for k, v in flat})
    from engine.io.tiny_chat import save_trained

    save_trained(args.out, params, vocab, meta={
        "steps": log[-1]["step"], "seed": args.seed, "data_seed": data_seed, "lr": args.lr,
        "wall_s": round(time.monotonic() - t0, 1), "final": log[-1]})
    if args.log:
        args.log.write_text(json.dumps(log, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
