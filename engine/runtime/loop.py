"""The engine thread's loop: submissions in, one device step at a time, tokens out.

Each iteration moves what other threads put in the `Inbox` into the scheduler (or runs it:
commands, forgets), expires requests that waited too long, admits what fits (beginning each
admitted sequence's state: fresh, or continued from a stored one), finishes cancelled
sequences, and runs the scheduler's next step: a prefill piece or a decode step through the
model runner, then the sampling of the rows that are ready. Each row's token is accepted
(emitted, or it ends the sequence); a finished sequence's state is stored for reuse. Decode
steps may be chained (engine/runtime/chain.py): while one is in flight, the loop only chains
the next and reads it.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import jax
import numpy as np

from engine.runtime.chain import DecodeChain, InFlight
from engine.runtime.request import DoneEvent, GenerationRequest, TokenEvent
from engine.runtime.scheduler import QueueFull, SeqStatus, Sequence

log = logging.getLogger("ninfer.engine")


class Inbox:
    """What other threads hand the engine thread: sequences to schedule (each `reserve`d
    first: counted as pending until admitted, at most `max_queue`), commands (callables run
    between steps), ("forget" | "forget_session", principal, key) tuples, and None: stop."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.pending = 0

    def reserve(self) -> None:
        """Count a sequence about to be put in as pending; QueueFull when max_queue already
        wait."""
        with self._lock:
            if self.pending >= self.max_queue:
                raise QueueFull(f"{self.pending} requests already waiting")
            self.pending += 1

    def put(self, item) -> None:
        self._q.put(item)

    def admitted(self) -> None:
        """A submitted sequence left the wait: admitted, or expired."""
        with self._lock:
            self.pending -= 1

    def empty(self) -> bool:
        return self._q.empty()

    def get(self, block: bool):
        """The next item (waiting up to 50 ms when `block`); queue.Empty when there is none."""
        return self._q.get(timeout=0.05) if block else self._q.get_nowait()


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
