"""The batches tiny-chat trains on, by phase (engine/train/train_tiny_chat.py's recipe): each
step's parts (chat, tools, retrieval, one long row, copying rows), what each part draws in each
phase, and the supervised positions the loss takes."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from engine.train import data as D

# (rows, length) of the parts of every step's batch
CHAT = {1: (12, 96), 2: (20, 64), 3: (20, 64)}  # chat tasks without a tools section, by phase
TOOLS = (3, 576)      # anything with the tools section
RETRIEVE = {1: (2, 896), 2: (2, 896), 3: (3, 2048)}  # retrieval over filler text, by phase
# one long row a step: to 10K tokens (the CPU lane's 8.8K probe), from phase 5 16K (OMP's 13.6K)
LONG = {3: (1, 10240), 4: (1, 10240), 5: (1, 16384), 6: (1, 16384), 7: (1, 16384),
        8: (1, 16384), 9: (1, 16384)}
LONG_TOOLS = {3: 0.4, 4: 0.2, 5: 0.5, 6: 0.7, 7: 0.7, 8: 0.5, 9: 0.5}  # long rows: tool turns
LONG_LOW = {3: 16, 4: 3, 5: 6, 6: 6, 7: 6, 8: 6, 9: 6}  # long retrievals' filler: length // this
REMIND = {7: 0.5, 8: 0.5, 9: 0.5}  # the share of chat and tool rows after a reminder
# the share of long rows that are a copying row after 4K-16K tokens of filler: OMP's path is
# copied from a few tokens back at position 13.6K, where the copying rows (at 0-33) never go
LATE_REPEAT = {8: 0.3, 9: 0.2}
# phase 9: the share of tool rows (and of the long rows' tool turns) rendered in a captured
# client's own prompt (CLIENTS, load_client: OMP's system text and tool texts, which
# a model trained on our shorter tool texts does not act in), and the tool rows' length then
CLIENT, CLIENT_TOOLS = {9: 0.8}, (2, 2304)
CLIENTS: list[dict] = []  # set by the training script (--client, load_client)
REPEAT = {0: 32, 1: 8, 2: 8, 3: 24}  # rows of span, newline, span (copying practice), by phase
SPAN, ALPHABET = 16, 16       # a span's tokens, and how many distinct ids a row draws them from
PARTS = {0: ("repeat",), 1: ("chat", "tools", "retrieve", "repeat"), 2: ("chat", "tools",
         "retrieve", "repeat"), 3: ("chat", "tools", "retrieve", "long", "repeat")}
SUPERVISED = {"chat": 64, "tools": 128, "retrieve": 24, "long": 24, "repeat": 2 * SPAN}  # a row
MIX_TOOLS = ["read", "read", "bash", "followup", "greet", "echo", "add", "lang"]
# the chat part's tasks in each phase: the second adds dense copying practice
MIX_CHAT = {1: D.TASKS[:4], 2: D.TASKS[:4] + ["copy"] * 4, 3: D.TASKS[:4] + ["copy"] * 4}
for _table in (CHAT, RETRIEVE, REPEAT, PARTS, MIX_CHAT):  # phases 4-9: phase 3's parts, drawn
    _table.update(dict.fromkeys((4, 5, 6, 7, 8, 9), _table[3]))  # otherwise (make_batch)
RETRIEVE[9] = (2, 2048)  # phase 9 trains on the CPU too (--long-tokens 0): fewer, shorter rows


def load_client(path) -> dict:
    """A captured agent client's prompt parts (bench/lab/omp_tool_prompt.py capture writes
    them, from the real client's request as the server parses it): {"system": its system
    text, "tools": its tools in the template's form, "tokens": the captured prompt's length}.
    Training reads them from the capture; the client's text is not part of this repository."""
    cap = json.loads(Path(path).read_text())
    return {"system": cap["client"]["system"], "tools": cap["client"]["tools"],
            "tokens": len(cap["ids"])}


def _client(rng, phase: int, length: int) -> dict | None:
    """A captured client whose prompt leaves room in a row of `length`, for CLIENT's share,
    its machine description redrawn (workstation)."""
    fits = [c for c in CLIENTS if c["tokens"] + 200 <= length]
    if not fits or rng.random() >= CLIENT.get(phase, 0.0):
        return None
    c = fits[rng.integers(len(fits))]
    return {**c, "system": workstation(rng, c["system"])}


# What a client says about the machine it runs on differs from machine to machine (OMP's
# <workstation> block: kernel, distribution, CPU, terminal); a capture holds one machine's.
MACHINE = {"OS": ("linux 6.{a}.{b}-{c}", ("generic", "arch1-1", "fc-v1272", "cloud-amd64", "1")),
           "Distro": ("{c}", ("Linux", "Ubuntu 24.04.1 LTS", "Debian GNU/Linux 12 (bookworm)",
                              "Fedora Linux 41", "Arch Linux", "NixOS 24.11")),
           "Kernel": ("#{a} SMP PREEMPT_DYNAMIC {c}", ("@0", "Debian", "Ubuntu", "Thu Oct 3")),
           "CPU": ("{c}", ("Intel(R) Xeon(R) Processor @ 2.80GHz", "AMD EPYC 7B13 64-Core "
                           "Processor", "AMD Ryzen 9 7950X 16-Core Processor", "13th Gen Intel(R)"
                           " Core(TM) i7-13700K", "AMD EPYC 9654 96-Core Processor")),
           "Terminal": ("{c}", ("dumb", "xterm-256color", "tmux-256color"))}


def workstation(rng, system: str) -> str:
    """`system` with each MACHINE line's value redrawn (other text unchanged)."""
    def one(m):
        form, choices = MACHINE[m.group(1)]
        return f"- {m.group(1)}: " + form.format(a=rng.integers(1, 19), b=rng.integers(0, 80),
                                                   c=choices[rng.integers(len(choices))])
    return re.sub(r"^- (" + "|".join(MACHINE) + r"): .*$", one, system, flags=re.M)


def _fit(tk, prompt: str, completion: str, length: int):
    p, c = tk.encode(prompt), tk.encode(completion)
    ids = p + c
    if len(ids) > length:
        return None
    return ids, len(p)


def _span_twice(rng, pool: np.ndarray, sep: int) -> list[int]:
    """span, sep, span: SPAN ids drawn from ALPHABET ids of the pool chosen for this row."""
    span = [int(t) for t in rng.choice(rng.choice(pool, ALPHABET, replace=False), SPAN)]
    return span + [sep] + span


def repeat_batch(rng, pool: np.ndarray, sep: int, rows: int):
    """Copying practice: span, newline, span; the loss on the second span (its first token
    follows from the row's start, the rest from the first copy)."""
    length = 2 * SPAN + 1
    toks = np.zeros((rows, length), np.int32)
    for r in range(rows):
        toks[r] = _span_twice(rng, pool, sep)
    mask = np.zeros((rows, length), np.float32)
    mask[:, SPAN:length - 1] = 1.0
    return (toks, mask, np.full((rows,), length, np.int32),
            np.full((rows,), ALL_TASKS.index("repeat"), np.int32))


def late_repeat(rng, tk, pool: np.ndarray, length: int):
    """A copying row (span, newline, span) after filler of about a quarter to nine tenths of
    `length` tokens: (ids, where the second span starts, i.e. the loss)."""
    lines, sep = D._filler_lines(rng, int(rng.integers(length // 6, int(length / 1.6))))
    filler = tk.encode(sep.join(lines) + "\n\n")[:length - 2 * SPAN - 1]
    return filler + _span_twice(rng, pool, tk.encode("\n")[0]), len(filler) + SPAN + 1


def make_batch(rng, tk, part: str, phase: int = 1, pool=None):
    if part == "repeat":
        return repeat_batch(rng, pool, tk.encode("\n")[0], REPEAT[phase])
    tools = CLIENT_TOOLS if CLIENT.get(phase) and CLIENTS else TOOLS
    rows, length = {"chat": CHAT[phase], "tools": tools, "retrieve": RETRIEVE[phase],
                    "long": LONG.get(phase)}[part]
    toks = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), np.float32)
    lengths = np.zeros((rows,), np.int32)
    task_ids = np.zeros((rows,), np.int32)
    r = 0
    while r < rows:
        fit = None
        if part == "long" and LATE_REPEAT.get(phase) and rng.random() < LATE_REPEAT[phase]:
            fit, task = late_repeat(rng, tk, pool, length), "late_repeat"
        elif part == "long" and rng.random() < LONG_TOOLS[phase]:
            # a read, bash or follow-up turn under a tools section as long as OMP's
            task = MIX_TOOLS[rng.integers(4)]
            describe = int(rng.integers(40, int(length / 1.45 / 9)))
            prompt, completion = D.chat_sample(rng, task, describe, REMIND.get(phase, 0.0),
                                               _client(rng, phase, length))
        elif part in ("retrieve", "long"):
            if part == "long":  # phases 4-8: the long rows' retrievals from 3.4K-4K tokens up
                low = length // LONG_LOW[phase]
            else:  # phase 4: half the short rows' facts with little or no filler
                low = 40 if phase != 4 else int(rng.integers(0, 2)) * 40
            n_words = int(rng.integers(low, int(length / 1.45)))
            prompt, completion, _ = D.retrieval_sample(rng, n_words)
            task = "retrieve"
        else:
            names = MIX_CHAT[phase] if part == "chat" else MIX_TOOLS
            task = names[rng.integers(len(names))]
            client = _client(rng, phase, length) if part == "tools" else None
            prompt, completion = D.chat_sample(rng, task, remind=REMIND.get(phase, 0.0),
                                               client=client)
            if part == "chat" and "<tools>" in prompt:
                continue
        fit = fit or _fit(tk, prompt, completion, length)
        if fit is None:
            continue
        ids, n_prompt = fit
        toks[r, :len(ids)] = ids
        mask[r, n_prompt - 1:len(ids) - 1] = 1.0  # predict each completion token
        lengths[r] = len(ids)
        task_ids[r] = ALL_TASKS.index(task)
        r += 1
    return toks, mask, lengths, task_ids


ALL_TASKS = D.TASKS + ["retrieve", "copy", "repeat", "late_repeat"]


def supervised(mask: np.ndarray, tgt: np.ndarray, cap: int):
    """The positions a batch is trained on, as [rows, cap] (index, target, weight): the loss
    needs the output rows only there, so the trained vocabulary's size costs little."""
    rows = mask.shape[0]
    idx = np.zeros((rows, cap), np.int32)
    out = np.zeros((rows, cap), np.int32)
    w = np.zeros((rows, cap), np.float32)
    for r in range(rows):
        pos = np.flatnonzero(mask[r])[:cap]
        idx[r, :len(pos)], out[r, :len(pos)], w[r, :len(pos)] = pos, tgt[r, pos], 1.0
    return idx, out, w
