"""Speculative decoding in the engine loop: a drafter proposes up to K tokens a row, ONE verify
pass of the full model scores them (engine/model/verify.py), and the row keeps what the verifier
agrees with. Drafters (engine/runtime/drafters.py): prompt lookup, proposed row by row on the
host, and the model's MTP layer, run for every row in one device call before the pass
(`_batched_drafts`; the engine's cache then keeps that layer's KV current, model.py `mtp_track`).

A decode step with speculation on (`SpecDecode.run`): each decoding row feeds its last token
and its draft d_1..d_k (k <= K, and k < the tokens the row may still produce, so the pass never
writes past its reservation). Then, position by position, the verifier's token is sampled from
that position's logits exactly as a decode step would sample it (the same key step, the row's
constraint mask after the tokens before it, its parameters), and the row goes on while that
token equals the draft token fed at the next position. So every emitted token is the one the
non-speculative engine emits, at any temperature: a draft is accepted when the verifier's own
sample equals it (for greedy rows: when it is the argmax), and the first disagreeing position
emits the verifier's token. The standard accept/resample rule, which accepts more often at
temperature > 0 against a drafter with a known proposal distribution, is
engine/runtime/spec_sampling.py; the engine keeps the matching rule because it leaves seeded
outputs equal to the non-speculative ones.

Rollback: the row's GDN state is set to the pass's snapshot after its last accepted position
(`commit_verified`), its position there, and its page table truncated to the tokens fed
(`Memory.rollback`): pages holding only rejected positions go back to the allocator. Only then
are the tokens accepted by the loop, so a finished response stores (and a checkpoint exports)
exactly the state of the tokens it kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np

from engine.model.verify import jit_commit
from engine.runtime.drafters import Drafter

# the draft lengths a verify pass supports
MIN_DRAFT, MAX_DRAFT = 1, 8
# the drafters a configuration may name ("off": no speculation)
METHODS = ("off", "prompt_lookup", "mtp", "prompt_lookup+mtp")


def uses_mtp(method) -> bool:
    """Whether a [speculative] method drafts with the model's MTP layer (the engine's pool then
    holds that layer's KV, and the model must have one)."""
    return method in ("mtp", "prompt_lookup+mtp")


def check_speculative(method, draft_tokens, where: str = "speculative.") -> None:
    """Refuse a speculative configuration the engine cannot run, naming the key (`where`
    + key: "speculative.method", or a profile's "[speculative] method") and the allowed
    values (ValueError)."""
    if method not in METHODS:
        raise ValueError(f"{where}method must be one of {list(METHODS)}, got {method!r}")
    if method != "off":
        check_draft_tokens(draft_tokens, where)


def check_draft_tokens(k, where: str = "speculative.") -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not MIN_DRAFT <= k <= MAX_DRAFT:
        raise ValueError(f"{where}draft_tokens must be an integer in {MIN_DRAFT}..{MAX_DRAFT}, "
                         f"got {k!r}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculation for an engine: `drafter` proposes up to `k` tokens a row a verify pass."""
    drafter: Drafter
    k: int

    @staticmethod
    def from_settings(method: str, draft_tokens: int) -> "SpecConfig | None":
        """The configuration a profile's [speculative] table names (None for "off")."""
        check_speculative(method, draft_tokens)
        if method == "off":
            return None
        from engine.runtime.drafters import MTP, LookupThenMTP, PromptLookup

        drafter = {"mtp": MTP, "prompt_lookup+mtp": LookupThenMTP}.get(method, PromptLookup)
        return SpecConfig(drafter(), draft_tokens)

    @property
    def mtp(self) -> bool:
        """Whether drafts come from the model's MTP layer (the engine's cache then keeps that
        layer's KV current)."""
        return uses_mtp(self.drafter.name)

    def describe(self) -> dict:
        """What a fingerprint or a status shows."""
        return {"method": self.drafter.name, "draft_tokens": self.k}


@dataclass
class SpecStats:
    """A request's speculative counts: drafted[i] / accepted[i] are the drafts that had a token
    at draft position i (0-based) and how many of those the verifier accepted."""
    passes: int = 0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add(self, n_drafted: int, n_accepted: int) -> None:
        self.passes += 1
        need = max(n_drafted - len(self.drafted), 0)
        self.drafted += [0] * need
        self.accepted += [0] * need
        for i in range(n_drafted):
            self.drafted[i] += 1
            self.accepted[i] += i < n_accepted

    def as_dict(self) -> dict:
        return {"verify_passes": self.passes, "drafted": list(self.drafted),
                "accepted": list(self.accepted)}


class SpecDecode:
    """The verify step of a `StepLoop` (`loop`: its runner, memory, sampler and token
    acceptance) with `drafter` proposing up to `k` tokens a row."""

    def __init__(self, loop, drafter: Drafter, k: int):
        check_draft_tokens(k)
        self.loop, self.drafter, self.k = loop, drafter, k
        self.totals = SpecStats()  # every request's, for the engine's gauges

    def run(self, step) -> None:
        loop = self.loop
        tokens = np.zeros((loop.B, self.k + 1), np.int32)
        lengths = np.zeros((loop.B,), np.int32)
        drafts = {}
        fed = {seq.seq_id: seq.table.num_tokens for seq in step.seqs}
        rooms = {seq.seq_id: max(min(self.k, loop.sampler.remaining(seq) - 1), 0)
                 for seq in step.seqs}
        batched = getattr(self.drafter, "batched", False)
        lookup = getattr(self.drafter, "lookup", None)  # prompt lookup first (a combination)
        looked = {seq.seq_id: [int(t) for t in lookup.propose(seq, rooms[seq.seq_id])]
                  [:rooms[seq.seq_id]] if lookup is not None and rooms[seq.seq_id] else []
                  for seq in step.seqs}
        # the MTP layer drafts only for the rows prompt lookup left without a draft
        made = self._batched_drafts(step, rooms, looked) if batched else None
        for seq in step.seqs:
            room = rooms[seq.seq_id]
            if room == 0:
                draft = []
            elif made is not None:
                draft = looked[seq.seq_id] or [int(t) for t in made[seq.slot, :room]]
            else:
                draft = [int(t) for t in self.drafter.propose(seq, room)][:room]
            con = seq.payload.constraint
            if draft and con is not None and hasattr(con, "draft_prefix"):
                draft = draft[:con.draft_prefix(draft)]  # what the mask allows, in a row
            tokens[seq.slot, 0] = seq.output_ids[-1]
            tokens[seq.slot, 1:1 + len(draft)] = draft
            lengths[seq.slot] = 1 + len(draft)
            drafts[seq.seq_id] = draft
            if not batched:  # the batched drafter made room for its longest pass already
                loop.mem.prepare([seq], int(lengths[seq.slot]))
        keep = np.zeros((loop.B,), np.int32)  # rows not in the step: left alone
        if lengths.max() == 1:
            # no row has a draft: the plain decode step (its state is the one to keep)
            logits, _, loop.mem.cache = loop.runner.forward(
                jax.device_put(tokens[:, :1]), loop.mem.cache, jax.device_put(lengths))
            emitted = self._decide(step.seqs, [logits[:, 0]], drafts)
            if batched:  # pages made for drafts that were all cut go back
                loop.mem.rollback([(seq, fed[seq.seq_id] + 1) for seq in step.seqs])
        else:
            (logits, conv_all, rec_all, mtp_all), cache = loop.runner.verify(
                jax.device_put(tokens), loop.mem.cache, jax.device_put(lengths))
            emitted = self._decide(step.seqs, logits, drafts)
            for seq in step.seqs:
                keep[seq.slot] = len(emitted[seq.seq_id])
            loop.mem.cache = jit_commit(cache, conv_all, rec_all, jax.device_put(lengths),
                                        jax.device_put(keep), mtp_all)
            loop.mem.rollback([(seq, fed[seq.seq_id] + int(keep[seq.slot]))
                               for seq in step.seqs])
        for seq in step.seqs:
            n_draft, n_acc = len(drafts[seq.seq_id]), len(emitted[seq.seq_id]) - 1
            stats = seq.payload.speculative
            if stats is not None:
                stats.add(n_draft, n_acc)
            self.totals.add(n_draft, n_acc)
            for tok, con_result in emitted[seq.seq_id]:
                loop._accept(seq, tok, con_result=con_result)
                if seq.finish_reason is not None:
                    break

    def _batched_drafts(self, step, rooms: dict, looked: dict) -> np.ndarray:
        """The MTP layer's drafts for the step's rows ([B, k] on the host; row b's first
        rooms[seq] are real), run for the rows with no draft in `looked` (prompt lookup's) and
        not at all when every row has one. They write MTP entries at and past each row's
        position, so every row's pages for the pass it may run (room + 1 tokens) are made
        first; the rollback after the pass gives back what it does not keep."""
        loop = self.loop
        last = np.zeros((loop.B,), np.int32)
        steps = np.zeros((loop.B,), np.int32)
        for seq in step.seqs:
            room = rooms[seq.seq_id]
            last[seq.slot] = seq.output_ids[-1]
            steps[seq.slot] = 0 if looked[seq.seq_id] else room
            loop.mem.prepare([seq], room + 1)
        if not steps.any():
            return np.zeros((loop.B, self.k), np.int32)
        drafts, loop.mem.cache = loop.runner.draft(jax.device_put(last), loop.mem.cache,
                                                   jax.device_put(steps), self.k)
        return np.asarray(drafts)

    def warm(self) -> None:
        """Compile the verify pass and its commit by running them with every row's length 0
        (nothing is written, no position moves)."""
        loop = self.loop
        zeros = np.zeros((loop.B,), np.int32)
        (_, conv_all, rec_all, mtp_all), cache = loop.runner.verify(
            jax.device_put(np.zeros((loop.B, self.k + 1), np.int32)), loop.mem.cache,
            jax.device_put(zeros))
        loop.mem.cache = jit_commit(cache, conv_all, rec_all, jax.device_put(zeros),
                                    jax.device_put(zeros), mtp_all)
        if getattr(self.drafter, "batched", False):
            _, loop.mem.cache = loop.runner.draft(jax.device_put(zeros), loop.mem.cache,
                                                  jax.device_put(zeros), self.k)

    def _decide(self, seqs, logits, drafts) -> dict:
        """Sample each position's verifier token, row by row while the drafts agree; returns
        {seq_id: [(token, constraint result)]}: what the loop accepts, in order. A row's
        constraint is advanced here (each position's mask must follow the tokens before it):
        the result is whether it terminated after the token, or the exception it raised."""
        loop = self.loop
        out = {seq.seq_id: [] for seq in seqs}
        live = list(seqs)
        for t in range(len(logits)):
            if not live:
                break
            rows = [None] * loop.B
            for seq in live:
                rows[seq.slot] = seq
            picked, failed = loop.sampler.sample(logits[t], rows, ahead=t)
            picked = np.asarray(picked)
            still = []
            for seq in live:
                tok = -1 if seq.slot in failed else int(picked[seq.slot])
                req = seq.payload
                con_result = None
                if req.constraint is not None and tok >= 0:
                    try:
                        req.constraint.accept(tok)
                        con_result = req.constraint.terminated
                    except Exception as e:  # reported by the loop's accept
                        con_result = e
                out[seq.seq_id].append((tok, con_result))
                draft = drafts[seq.seq_id]
                done = (tok < 0 or isinstance(con_result, Exception) or con_result is True
                        or tok in req.stop_ids
                        or len(seq.output_ids) + t + 1 >= seq.max_tokens)
                if not done and t < len(draft) and draft[t] == tok:
                    still.append(seq)
            live = still
        return out
