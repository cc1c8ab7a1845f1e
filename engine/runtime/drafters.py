"""Drafters for speculative decoding (engine/runtime/speculative.py): what a row proposes for
the verify pass to score.

A drafter is any object with a `name` and `propose(seq, k) -> list[int]`: at most k token ids
that it expects to follow the row's tokens so far (`seq.prompt_ids + seq.output_ids`; the last
output token is the one the pass feeds first). Proposing fewer, or none, is always allowed.
`MTP` is the exception: its drafts come from the model's own MTP layer, for every row in one
device call, so the verify step asks the runner for them (`batched = True`).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class Drafter(Protocol):
    name: str

    def propose(self, seq, k: int) -> list[int]: ...


class MTP:
    """The model's multi-token-prediction layer, run greedily k steps from each row's last
    hidden state (engine/model/model.py `mtp_draft`). Needs a model with MTP weights and an
    engine whose cache tracks the MTP layer (`Engine(..., speculative=...)` builds it so)."""

    name = "mtp"
    batched = True


class LookupThenMTP(MTP):
    """Prompt lookup where the row's tokens have a match, the MTP layer's drafts where they do
    not: copied text costs nothing to draft and is accepted whole, new text gets MTP's guess."""

    name = "prompt_lookup+mtp"

    def __init__(self):
        self.lookup = PromptLookup()


class PromptLookup:
    """The continuation of the longest recent n-gram match in the row's own tokens (prompt and
    output): the last n tokens (n from `max_ngram` down to `min_ngram`) are looked up in the
    `window` tokens before them, the most recent match first, and the up to k tokens that
    followed it are proposed. Costs no weights; pays off where a response repeats text it has
    seen (an edit of a file just read)."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, window: int = 4096):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window

    def propose(self, seq, k: int) -> list[int]:
        toks = list(seq.prompt_ids[-self.window:]) + list(seq.output_ids)
        return lookup(np.asarray(toks[-self.window:], np.int64), k, self.max_ngram,
                      self.min_ngram)


def lookup(toks: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """`PromptLookup`'s search over toks [N] (the last token is the newest)."""
    n_tok = len(toks)
    if k <= 0:
        return []
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        tail = toks[n_tok - n:]
        # starts j < N - n whose n tokens equal the tail, newest first
        cand = np.nonzero(toks[:n_tok - n] == tail[0])[0]
        for j in cand[::-1]:
            if j + n < n_tok and np.array_equal(toks[j:j + n], tail):
                follow = toks[j + n:j + n + k]
                if len(follow):
                    return [int(t) for t in follow]
    return []
