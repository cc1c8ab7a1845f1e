"""Chained decode steps (the plan's chain_decode): the next step dispatched before the host reads
the last one's tokens.

While only decode steps of the same rows can follow (nothing waiting or prefilling, no
constraint, no request asking for log-probabilities, no command or submission in the inbox), step K + 1 is dispatched with step K's
sampled tokens still on the device, and only then are K's tokens read and accepted: the host's
dispatch and token work run while the device computes, where the synced path leaves the device
idle for both (0.7-0.8 ms a 27B decode step on the H200). The results are the synced path's:
K + 1 feeds a row exactly the token the synced path would feed it (a stop token, tested on the
device, and a row ending at its budget get length 0, which leaves its state alone), with the
same sampling key and step; a row that ended at K is dropped from K + 1's log entry and its
K + 1 token is never read.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from engine.runtime.scheduler import SeqStatus, Sequence

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
