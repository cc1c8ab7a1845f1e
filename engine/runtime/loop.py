"""The engine thread's loop: submissions in, one device step at a time, tokens out.

Each iteration moves what other threads put in the `Inbox` into the scheduler (or runs it:
commands, forgets), expires requests that waited too long, admits what fits (beginning each
admitted sequence's state: fresh, or continued from a stored one), finishes cancelled
sequences, and runs the scheduler's next step: a prefill piece or a decode step through the
model runner, then the sampling of the rows that are ready. Each row's token is accepted
(emitted, or it ends the sequence); a finished sequence's state is stored for reuse. Decode
steps may be chained (`DecodeChain`): while one is in flight, the loop only chains the next and
reads it.

Chained decode steps (the plan's chain_decode): the next step dispatched before the host reads
the last one's tokens. While only decode steps of the same rows can follow (nothing waiting or
prefilling, no constraint, no request asking for log-probabilities, no command or submission in
the inbox), step K + 1 is dispatched with step K's sampled tokens still on the device, and only
then are K's tokens read and accepted: the host's
dispatch and token work run while the device computes, where the synced path leaves the device
idle for both (0.7-0.8 ms a 27B decode step on the H200). The results are the synced path's:
K + 1 feeds a row exactly the token the synced path would feed it (a stop token, tested on the
device, and a row ending at its budget get length 0, which leaves its state alone), with the
same sampling key and step; a row that ended at K is dropped from K + 1's log entry and its
K + 1 token is never read.
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from engine.runtime.request import DoneEvent, GenerationRequest, TokenEvent
from engine.runtime.scheduler import Inbox, SeqStatus, Sequence

log = logging.getLogger("ninfer.engine")


class StepLoop:
    """The engine thread's work (`run`) over the engine's scheduler, memory, model runner and
    batch sampler, fed by `inbox`. `chain_decode`: the plan's, whether decode steps may be
    chained."""

    def __init__(self, *, sched, mem, runner, sampler, inbox: Inbox, context_tokens: int,
                 chain_decode: bool, speculative=None):
        self.sched, self.mem, self.runner, self.sampler = sched, mem, runner, sampler
        self.inbox, self.context_tokens, self.B = inbox, context_tokens, runner.B
        self.chain = DecodeChain(runner=runner, sampler=sampler, sched=sched, mem=mem,
                                 inbox_empty=inbox.empty, context_tokens=context_tokens,
                                 enabled=chain_decode)
        self._inflight: InFlight | None = None
        # speculative decoding (engine/runtime/speculative.py): decode steps are verify passes
        self.spec = None
        if speculative is not None:
            from engine.runtime.speculative import SpecDecode

            self.spec = SpecDecode(self, speculative.drafter, speculative.k)
        self.keep_warm = None  # the engine's KeepWarm: told before each step, and when idle
        self._warm_idle = True

    def run(self) -> None:
        """The engine thread: runs until the inbox says stop."""
        while True:
            if self._inflight is not None:
                # a chained decode step is on the device: chain the next one or read it; the
                # inbox (submissions, commands, stop) waits until no step is in flight
                self._advance_inflight()
                continue
            if not self._drain_inbox(block=self.sched.idle):
                return
            for seq in self.sched.expire():
                self.inbox.admitted()
                seq.emit(DoneEvent(seq.finish_reason, len(seq.prompt_ids), 0,
                                   queue_s=time.monotonic() - seq.enqueued_at))
            for seq in self.sched.admit():
                self.inbox.admitted()
                req = seq.payload
                req.path, req.cached_tokens = self.mem.begin(seq, req.principal)
                seq.computed = req.cached_tokens
            for seq in list(self.sched.running):
                if seq.payload.cancelled.is_set():
                    self._finish(seq, "cancelled")
            step = self.sched.next_step()
            if step is None:
                if self.sched.idle and not self._warm_idle and self.keep_warm is not None:
                    self._warm_idle = True
                    self.keep_warm.idle()
                continue
            if self._warm_idle and self.keep_warm is not None:
                self._warm_idle = False
                self.keep_warm.busy()  # the spin in flight stops before this step is enqueued
            try:
                self.run_step(step)
            except Exception as e:  # the engine thread must survive a failed step
                log.exception("a %s step failed; its requests end with an error", step.kind)
                for seq in step.seqs:
                    self._finish(seq, "error", error=type(e).__name__)

    def _drain_inbox(self, block: bool) -> bool:
        """Move submissions into the scheduler; False when asked to stop."""
        try:
            item = self.inbox.get(block)
            while True:
                if item is None:
                    return False
                if callable(item):  # a command from `Engine.call`: runs between steps
                    item()
                elif isinstance(item, tuple):  # ("forget" | "forget_session", principal, key)
                    getattr(self.mem, item[0])(item[1], item[2])
                else:
                    self.sched.waiting.append(item)  # capacity was checked by submit()
                item = self.inbox.get(block=False)
        except queue.Empty:
            return True

    def run_step(self, step) -> None:
        # a row that asked for log-probabilities takes the plain step (the verify pass has none)
        if step.kind == "decode" and self.spec is not None \
                and all(s.payload.logprobs is None for s in step.seqs):
            self.spec.run(step)
            return
        # [B, width]: a prefill piece may be right-padded past its size; padded steps are not
        # valid, so they write no KV and leave the GDN state alone (tests/test_engine_padding.py),
        # and pages are made for the real tokens only.
        # Over the step's own rows where that is narrower than the engine (`runner.narrow`):
        # tokens row i is step.seqs[i]'s; else over every row, row b the sequence in slot b.
        narrow = self.runner.narrow(step.kind, len(step.seqs))
        n = len(step.seqs) if narrow else self.B
        tokens = np.zeros((n, step.width), np.int32)
        lengths = np.zeros((n,), np.int32)
        for i, seq in enumerate(step.seqs):
            at = i if narrow else seq.slot
            if step.kind == "prefill":
                tokens[at, :step.size] = seq.prompt_ids[step.start:step.start + step.size]
                lengths[at] = step.size
            else:
                tokens[at, 0] = seq.output_ids[-1]
                lengths[at] = 1
        rows = np.array([seq.slot for seq in step.seqs], np.int32) if narrow else None
        self.mem.prepare(step.seqs, max(step.size, 1))
        # fresh arrays each step: device_put (jnp.asarray compiles a staging computation for
        # each new shape, ~10 ms the first time a piece width runs)
        logits, _, self.mem.cache = self.runner.forward(
            jax.device_put(tokens), self.mem.cache, jax.device_put(lengths),
            None if rows is None else jax.device_put(rows))
        if step.kind == "prefill":
            seq = step.seqs[0]
            self.sched.prefilled(seq, step.size)
            if seq.computed == seq.breakpoint:
                self.mem.snapshot(seq, seq.payload.principal, seq.computed, "prefix")
            ready = [s for s in step.seqs if s.prefill_remaining == 0]
        else:
            ready = list(step.seqs)
        if ready:
            rows = [None] * self.B
            for s in ready:
                rows[s.slot] = s
            picked, failed = self.sampler.sample(logits[:, 0], rows)
            lp = self.sampler.logprobs(logits[:, 0], picked, rows)
            # a decode step: the next one goes to the device before this one's tokens are read
            nxt = self.chain.dispatch(step.seqs, picked) if step.kind == "decode" \
                and not failed else None
            self._collect(ready, picked, failed, lp)
            if nxt is not None:
                self.chain.settle_log(nxt)
            self._inflight = nxt

    def _advance_inflight(self) -> None:
        """Chain the step after the one in flight (when it may be), then read and accept the
        in-flight step's tokens."""
        inf, self._inflight = self._inflight, None
        try:
            nxt = self.chain.dispatch(inf.seqs, inf.picked)
            self._collect([s for s in inf.seqs if s.status is SeqStatus.DECODING],
                          inf.picked, [])
            if nxt is not None:
                self.chain.settle_log(nxt)
            self._inflight = nxt
        except Exception as e:  # the engine thread must survive a failed step
            log.exception("a chained decode step failed; its requests end with an error")
            for seq in inf.seqs:
                if seq.status is not SeqStatus.FINISHED:
                    self._finish(seq, "error", error=type(e).__name__)

    def _collect(self, seqs, picked, failed: list, lp=None) -> None:
        """Read a step's sampled tokens (the host waits for the device here) and accept each
        row's; failed rows (a constraint that could not build its mask) get -1. `lp`: the
        step's log-probabilities (`BatchSampler.logprobs`), or None."""
        picked = np.array(picked)
        picked[failed] = -1  # _accept finishes these with "error"
        for s in seqs:
            self._accept(s, int(picked[s.slot]), lp=lp)

    def _accept(self, seq: Sequence, tok: int, con_result=None, lp=None) -> None:
        """Accept `seq`'s next token. con_result: None (the row's constraint, if any, accepts
        it here), a bool (it already did, and whether it terminated right after this token),
        or the exception its accept raised: the verify step (engine/runtime/speculative.py)
        advances the constraint through a pass's tokens before the loop accepts them. `lp`: the
        step's log-probabilities (`BatchSampler.logprobs`), or None."""
        req: GenerationRequest = seq.payload
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        con, terminated = req.constraint, False
        if con is not None:
            try:
                if tok < 0:
                    raise RuntimeError("the constraint failed to build its mask")
                if isinstance(con_result, Exception):
                    raise con_result
                if con_result is None:
                    con.accept(tok)
                terminated = con.terminated if con_result is None else con_result
            except Exception as e:  # a failed constraint ends its own sequence only
                self._finish(seq, "error", error=f"constraint: {type(e).__name__}")
                return
        if tok in req.stop_ids:
            self._finish(seq, "stop")
            return
        seq.output_ids.append(tok)
        if lp is not None and req.logprobs is not None:
            chosen, top_ids, top_lp = lp
            b, k = seq.slot, req.logprobs
            seq.emit(TokenEvent(tok, float(chosen[b]), tuple(
                (int(i), float(v)) for i, v in zip(top_ids[b, :k], top_lp[b, :k]))))
        else:
            seq.emit(TokenEvent(tok))
        total = len(seq.prompt_ids) + len(seq.output_ids)
        if terminated:  # the grammar is complete: nothing may follow
            self._finish(seq, "stop", last_fed=False)
        elif len(seq.output_ids) >= seq.max_tokens or total >= self.context_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, error: str | None = None,
                last_fed: bool | None = None) -> None:
        req: GenerationRequest = seq.payload
        if reason in ("stop", "length") and seq.status.value == "decoding":
            # The state covers every token fed so far: all outputs when the last sampled token
            # was a stop token (never fed), all but the last when the budget ran out or the
            # constraint ended the output on a token that was never fed.
            last_fed = reason != "length" if last_fed is None else last_fed
            fed = len(seq.prompt_ids) + len(seq.output_ids) - (not last_fed)
            self.mem.snapshot(seq, req.principal, fed, "response", one_off=req.session is None,
                              session=req.session)
        self.mem.end(seq)
        self.sched.finish(seq, reason)
        now = time.monotonic()
        first = req.first_token_at or now
        admitted = seq.admitted_at or seq.enqueued_at
        seq.emit(DoneEvent(reason, len(seq.prompt_ids), len(seq.output_ids),
                           queue_s=admitted - seq.enqueued_at, prefill_s=first - admitted,
                           decode_s=now - first, error=error,
                           cached_tokens=req.cached_tokens, path=req.path,
                           speculative=None if req.speculative is None
                           else req.speculative.as_dict()))


# ---- chained decode steps -------------------------------------------------------------------
# Stop ids a row may have for its decode steps to be chained on the device: the on-device stop
# test compares the sampled token with this many ids (padded with -1).
CHAIN_STOP_IDS = 16


def _next_inputs(picked, stops, live):
    """The next decode step's tokens [B, 1] and lengths [B] from the device-resident tokens
    `picked` [B] that the last step sampled: a row continues (length 1) where it is `live`
    and its token is none of its stop ids `stops` [B, S] (a stop token is never fed, as the
    synced path never feeds it); any other row has length 0 and its state is left alone."""
    cont = live & jnp.all(picked[:, None] != stops, axis=1)
    return picked[:, None].astype(jnp.int32), cont.astype(jnp.int32)


def _next_inputs_rows(picked, stops, live, rows):
    """`_next_inputs` for the cache rows `rows` [n] alone (a narrow decode step): tokens
    [n, 1], lengths [n]."""
    return _next_inputs(picked[rows], stops[rows], live[rows])


@dataclass
class InFlight:
    """A chained decode step on the device whose sampled tokens the host has not read: its
    rows (as dispatched), the tokens, and its entry in the scheduler's step log."""
    seqs: tuple
    picked: object
    log_at: int


class DecodeChain:
    """Dispatches chained decode steps through the engine's runner and sampler, over the
    scheduler's sequences and the memory's cache. `enabled`: the plan's chain_decode (off: no
    step is ever chained); `inbox_empty`: whether nothing waits in the engine's inbox."""

    def __init__(self, *, runner, sampler, sched, mem, inbox_empty, context_tokens: int,
                 enabled: bool):
        self.runner, self.sampler, self.sched, self.mem = runner, sampler, sched, mem
        self.B, self.context_tokens = runner.B, context_tokens
        self._inbox_empty = inbox_empty
        self.enabled = enabled
        self._next_inputs = jax.jit(_next_inputs)
        self._next_inputs_rows = jax.jit(_next_inputs_rows)
        # the device's stop ids, live rows and (narrow) row ids of the last chained row set: a
        # chain's steps reuse them instead of building and copying them each step
        self._rows: tuple[tuple, object, object, object] | None = None
        self.steps = 0  # decode steps dispatched before the last one's tokens were read

    def may_chain(self, seqs) -> bool:
        """Whether the decode step after the one of `seqs` may go before its tokens are read."""
        running = self.sched.running
        return (self.enabled and self._inbox_empty() and not self.sched.waiting
                and all(s.status is SeqStatus.DECODING for s in running)
                and set(running) <= set(seqs)
                and all(s.payload.constraint is None and s.payload.logprobs is None
                        and not s.payload.cancelled.is_set()
                        and len(s.payload.stop_ids) <= CHAIN_STOP_IDS for s in seqs))

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the token in flight for `seq` (not yet read) will be its last."""
        done = len(seq.output_ids) + 1
        return done >= seq.max_tokens or len(seq.prompt_ids) + done >= self.context_tokens

    def dispatch(self, seqs, picked) -> InFlight | None:
        """Dispatch the decode step after the one whose sampled tokens `picked` (on the
        device, unread) are for `seqs`; None where it may not be chained (`may_chain`)."""
        if not self.may_chain(seqs):
            return None
        nxt = tuple(s for s in seqs
                    if s.status is SeqStatus.DECODING and not self._ends_by_length(s))
        # only where the pages are there without evicting a stored state: the synced path
        # would release the pages of rows that end at K first
        if not nxt or not all(s.table.can_append(1) for s in nxt):
            return None
        rows = [None] * self.B
        for s in nxt:
            rows[s.slot] = s
        key = tuple((s.slot, s.seq_id) for s in nxt)
        if self._rows is None or self._rows[0] != key:
            stops = np.full((self.B, CHAIN_STOP_IDS), -1, np.int32)
            live = np.zeros((self.B,), bool)
            for s in nxt:
                ids = sorted(s.payload.stop_ids)
                stops[s.slot, :len(ids)] = ids
                live[s.slot] = True
            rows_dev = None
            if self.runner.narrow("decode", len(nxt)):
                rows_dev = jax.device_put(np.array([s.slot for s in nxt], np.int32))
            self._rows = (key, jax.device_put(stops), jax.device_put(live), rows_dev)
        self.sched.step_log.append(("decode", tuple(s.seq_id for s in nxt)))
        log_at = len(self.sched.step_log) - 1
        self.mem.prepare(nxt, 1)
        _, stops_dev, live_dev, rows_dev = self._rows
        if rows_dev is None:
            tokens, lengths = self._next_inputs(picked, stops_dev, live_dev)
        else:
            tokens, lengths = self._next_inputs_rows(picked, stops_dev, live_dev, rows_dev)
        logits, _, self.mem.cache = self.runner.forward(tokens, self.mem.cache, lengths,
                                                        rows_dev)
        nxt_picked, _ = self.sampler.sample(logits[:, 0], rows, ahead=1)
        self.steps += 1
        return InFlight(nxt, nxt_picked, log_at)

    def settle_log(self, inf: InFlight) -> None:
        """Once the step before `inf` is read (its entry is the log's last): rows that ended
        there were never fed by `inf` (length 0): its log entry lists the rows the synced
        path's step would have had, and goes when none is left."""
        ids = tuple(s.seq_id for s in inf.seqs if s.status is SeqStatus.DECODING)
        if ids:
            self.sched.step_log[inf.log_at] = ("decode", ids)
        else:  # every row ended at K: a step the synced path never runs (its rows all at 0)
            del self.sched.step_log[inf.log_at]

    def warm(self, picked) -> None:
        """Compile the chained steps' inputs for tokens `picked` [B] (as `dispatch` makes
        them for every row and for each narrow decode step's rows), rather than on a first
        request."""
        stops = jnp.full((self.B, CHAIN_STOP_IDS), -1, jnp.int32)
        live = jnp.zeros((self.B,), bool)
        jax.block_until_ready(self._next_inputs(picked, stops, live))
        for n, w in self.runner.shapes():
            if w == 1 and n < self.B:  # a narrow decode step's
                jax.block_until_ready(self._next_inputs_rows(
                    picked, stops, live, jax.device_put(np.zeros((n,), np.int32))))
