"""One request's constraint at decode time: the next-token mask, the sampled token, the end.

A `Constraint` runs in up to two phases:

1. THINK (thinking on): generation starts inside `<think>\\n`. Any ordinary token and `</think>`
   may follow; no special token (so no `<tool_call>` before the thinking is closed), and no
   end-of-turn unless the text after thinking may be empty. `</think>` is forced once the
   thinking budget is spent, or when the output budget left is only what the answer needs.
2. BODY: the llguidance matcher of the request's grammar (tool calls, JSON), or nothing at all
   (free text: the row is unconstrained and costs nothing).

Budget steering. Near the end of the output budget the constraint plans the remaining text: a
deterministic close-out from the current state (`_plan`): forced bytes first, then the first of a
short list of closing pieces (`}`, `]`, `"`, `\\n</parameter>\\n</function>\\n</tool_call>`,
...) that the grammar accepts, else the longest non-whitespace token it allows, until the
grammar accepts (plus end-of-turn if it could go on). When the tokens left are no more than the
plan's length plus MARGIN, the plan's tokens are forced one by one. The plan is recomputed every
RECHECK steps, and every step once the budget left is within WINDOW of it; in that window the
model still writes freely inside strings and raw values (where a token moves the close-out by
at most a token or two), but at structural choices (a key, a function name, a new value, another
call) the plan's token is taken, since such a choice can lengthen the close-out arbitrarily. So
a bounded schema closes within max_output_tokens. A budget smaller than the shortest close-out
from the first body token cannot be met (the response is then incomplete).

Masks are bitmasks: int32 words, bit (id & 31) of word (id >> 5) set = allowed, one row of the
engine's [B, words] array. Not thread-safe: the engine thread owns a request's constraint.
"""
from __future__ import annotations

import numpy as np

MARGIN = 4     # tokens of slack when forcing a close-out (covers the plan growing by one token)
WINDOW = 16    # within this many tokens of the plan: re-plan every step, follow it at choices
RECHECK = 8    # otherwise every RECHECK steps
PLAN_CAP = 512
FREE_TEXT = 50_000  # allowed tokens above which a state is "inside free text" (a string, a value)


class ConstraintViolation(RuntimeError):
    """A token the constraint did not allow was accepted (a bug upstream), or the grammar failed."""


class Constraint:
    def __init__(self, vocab, matcher, *, thinking: bool, thinking_budget: int | None,
                 body_min: int, body_may_be_empty: bool):
        self._v = vocab              # compiler.Vocab: token tables shared by all requests
        self._m = matcher            # llguidance.LLMatcher, or None for free text after thinking
        self._thinking = thinking
        self._budget = thinking_budget
        self._think_tokens = 0
        self._reserve = 0 if matcher is None else body_min + MARGIN + 1
        self._think_mask = vocab.think_mask(allow_end=body_may_be_empty)
        self._forced: list[int] = []
        self._est = body_min
        self._body_min = body_min
        self._since_plan = 0
        self._terminated = False

    @property
    def mask_words(self) -> int:
        """Width of a mask row in int32 words."""
        return self._v.words

    @property
    def close_out_tokens(self) -> int:
        """Length of the planned shortest answer from the start of the body (0: free text): a
        max_output_tokens below this (plus thinking) cannot yield a complete answer."""
        return self._body_min

    # ---- what the engine calls --------------------------------------------------------------
    @property
    def in_thinking(self) -> bool:
        return self._thinking

    @property
    def terminated(self) -> bool:
        """True once the grammar can take no further token: the engine finishes with "stop"."""
        return self._terminated

    def fill_mask(self, row: np.ndarray, remaining: int) -> bool:
        """Write the allowed next tokens into `row` (int32 [words]); False: no constraint now.

        remaining: tokens this sequence may still produce, the one being sampled included."""
        if self._thinking:
            if (self._budget is not None and self._think_tokens >= self._budget) or (
                    remaining <= self._reserve):
                self._v.single(row, self._v.think_end)
            else:
                row[:] = self._think_mask
            return True
        if self._m is None:
            return False
        plan = None if self._forced else self._steer(remaining)
        if self._forced:
            self._v.single(row, self._forced[0])
            return True
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self._check()
        if plan and not _is_free_text(row):
            # Near the end a structural choice (a key, a function, a new value or call) could
            # lengthen the close-out past the budget: follow the plan there, write freely
            # only inside strings and raw values.
            self._forced = plan[:1]
            self._v.single(row, plan[0])
        return True

    def draft_prefix(self, tokens) -> int:
        """How many of `tokens`, from the first, this constraint allows in a row from its state
        now, advancing nothing: a speculative draft is cut there (the verifier's masked token
        can never be one the constraint disallows, so a position past it is wasted). It stops
        early, never late: at the end of thinking and of a forced run, and before an id past
        the vocabulary."""
        n_vocab = len(self._v.tokens)
        tokens = list(tokens)
        for i, t in enumerate(tokens):
            if not 0 <= t < n_vocab:
                tokens = tokens[:i]
                break
        if self._thinking:
            n = 0
            for t in tokens:
                if t == self._v.think_end or not self._v.allowed(self._think_mask, t) or (
                        self._budget is not None and self._think_tokens + n >= self._budget):
                    break
                n += 1
            return n
        if self._forced:
            n = 0
            while n < min(len(tokens), len(self._forced)) and tokens[n] == self._forced[n]:
                n += 1
            return n
        if self._m is None:
            return len(tokens)
        return int(self._m.validate_tokens(list(tokens)))

    def accept(self, token: int) -> None:
        """Advance past the sampled `token`; raises ConstraintViolation if it was not allowed."""
        if self._thinking:
            if token == self._v.think_end:
                self._thinking = False
            elif not self._v.allowed(self._think_mask, token) or (
                    self._budget is not None and self._think_tokens >= self._budget):
                raise ConstraintViolation(f"token {token} is not allowed while thinking")
            self._think_tokens += 1
            return
        if self._m is None:
            return
        if self._forced:
            if token != self._forced[0]:
                raise ConstraintViolation(f"token {token} sampled where {self._forced[0]} "
                                          "was forced")
            self._forced.pop(0)
        if not self._m.consume_token(token):
            raise ConstraintViolation(self._m.get_error() or f"token {token} rejected")
        self._since_plan += 1
        self._terminated = self._m.is_stopped()

    # ---- budget steering --------------------------------------------------------------------
    def _steer(self, remaining: int) -> list[int] | None:
        """Re-plan when due; returns the plan when the budget left is within WINDOW of it."""
        if remaining > self._est + WINDOW and self._since_plan < RECHECK:
            return None
        plan = self._plan()
        self._since_plan = 0
        if plan is None:
            return None  # no close-out within PLAN_CAP: steering gives up, the grammar holds
        self._est = len(plan)
        if plan and remaining <= len(plan) + MARGIN:
            self._forced = plan
        return plan if remaining <= len(plan) + WINDOW else None

    def _plan(self) -> list[int] | None:
        """A short sequence of tokens from the current state to an accepting one (see module)."""
        return plan_close_out(self._m, self._v)

    def _check(self) -> None:
        if self._m.is_error():
            raise ConstraintViolation(self._m.get_error())


def plan_close_out(matcher, vocab) -> list[int] | None:
    m = matcher.deep_copy()
    plan: list[int] = []
    while len(plan) <= PLAN_CAP:
        if m.is_error():
            return None
        if m.is_stopped():
            return plan
        if m.is_accepting():
            return plan + [vocab.eos]
        step = m.compute_ff_tokens() or _closing_step(m, vocab)
        if not step or not m.consume_tokens(step):
            return None
        plan += step
    return None


def _is_free_text(mask) -> bool:
    return int.from_bytes(mask.tobytes(), "little").bit_count() > FREE_TEXT


def _closing_step(m, vocab) -> list[int] | None:
    bits = np.frombuffer(m.compute_bitmask(), np.uint8)
    for seq in (vocab.free_closers if _is_free_text(bits) else vocab.struct_closers):
        if m.validate_tokens(seq) == len(seq):
            return seq
    return vocab.fallback_token(bits)
