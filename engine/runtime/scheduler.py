"""Scheduling: which sequences run, and what the next device step is.

Pure host logic, no arrays. A sequence moves WAITING -> PREFILLING -> DECODING -> FINISHED (or
is cancelled / expires on the way) only through the named transitions below. Each loop iteration
of the engine asks for the next step: one batched decode step for every decoding sequence, then
one prefill chunk of the oldest prefilling sequence. So a long prefill never freezes a stream
that is already decoding: between two prefill chunks of B there is always a decode step of A.

Admission reserves prompt + output tokens of KV capacity; a request that cannot be admitted
waits in a bounded queue until its pending deadline. Other threads hand their submissions and
commands to the engine thread through the `Inbox`.
"""
from __future__ import annotations

import enum
import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


class QueueFull(Exception):
    """The wait queue is full: the server answers 429 server_overloaded."""


_ids = itertools.count()


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


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[object], None]
    payload: object = None  # what the runner needs (sampling params, stop ids, ...)
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SeqStatus = SeqStatus.WAITING
    enqueued_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    computed: int = 0        # prompt tokens already in the model state
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None  # batch row while running
    breakpoint: int = 0      # a prefill chunk never crosses this prompt index (a snapshot point)
    finish_reason: str | None = None

    @property
    def reserved_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_tokens

    @property
    def prefill_remaining(self) -> int:
        return len(self.prompt_ids) - self.computed


# Prefill pieces shorter than this run as one right-padded piece of this width (64: the
# attention kernels' query tile), so a remainder costs one forward call and no shape of its own.
MIN_PIECE = 64
# A remainder of at most this many short pieces runs as short pieces: a piece 8 wide costs
# 19-20 ms on a 32K session and a padded 64-wide one 47 ms on the H200, 60 on the H100
# (docs/benchmarks/short_piece.json), so two short ones still cost less and three do not.
SHORT_PIECES = 2


@dataclass(frozen=True)
class Step:
    kind: str                      # "decode" | "prefill"
    seqs: tuple[Sequence, ...]
    start: int = 0                 # prefill: first prompt index of the chunk
    size: int = 0                  # prefill: tokens in the chunk (the row's valid length)
    width: int = 1                 # tokens per row of the forward call: size plus right padding


class Scheduler:
    def __init__(self, *, max_concurrency: int, max_queue: int, queue_timeout_s: float,
                 capacity_tokens: int, prefill_chunk: int, short_piece: int = 0):
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.capacity_tokens = capacity_tokens
        self.prefill_chunk = prefill_chunk
        self.short_piece = short_piece  # the plan's short_piece (engine/plan.py)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_concurrency))
        self.reserved = 0
        self.step_log: list[tuple[str, tuple[int, ...]]] = []  # (kind, seq ids), for tests
        self._decode_turn = True

    # ---- submission -----------------------------------------------------------------------
    def can_submit(self) -> bool:
        return len(self.waiting) < self.max_queue

    def submit(self, seq: Sequence) -> None:
        if not self.can_submit():
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        if seq.reserved_tokens > self.capacity_tokens:
            raise ValueError("request larger than the KV capacity")  # the server checks first
        self.waiting.append(seq)

    # ---- admission ------------------------------------------------------------------------
    def can_admit(self, seq: Sequence) -> bool:
        return bool(self.free_slots) and \
            self.reserved + seq.reserved_tokens <= self.capacity_tokens

    def admit(self) -> list[Sequence]:
        """Move waiting sequences (in arrival order) into free slots while capacity allows."""
        admitted = []
        while self.waiting and self.can_admit(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            seq.status = SeqStatus.PREFILLING
            seq.admitted_at = time.monotonic()
            self.reserved += seq.reserved_tokens
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def expire(self, now: float | None = None) -> list[Sequence]:
        """Remove waiting sequences past their pending deadline or cancelled; returns them."""
        now = time.monotonic() if now is None else now
        gone = [s for s in self.waiting
                if now - s.enqueued_at > self.queue_timeout_s or _cancelled(s)]
        for s in gone:
            self.waiting.remove(s)
            s.status = SeqStatus.FINISHED
            s.finish_reason = "cancelled" if _cancelled(s) else "queue_timeout"
        return gone

    # ---- steps ----------------------------------------------------------------------------
    def next_step(self) -> Step | None:
        decoding = tuple(s for s in self.running if s.status is SeqStatus.DECODING)
        prefilling = [s for s in self.running if s.status is SeqStatus.PREFILLING]
        # Alternate: a decode step of every decoding stream, then one prefill chunk.
        if decoding and (self._decode_turn or not prefilling):
            self._decode_turn = False
            step = Step("decode", decoding)
        elif prefilling:
            self._decode_turn = True
            seq = prefilling[0]
            limit = seq.prefill_remaining
            if seq.computed < seq.breakpoint:
                limit = min(limit, seq.breakpoint - seq.computed)
            size, width = piece(limit, self.prefill_chunk, self.short_piece)
            step = Step("prefill", (seq,), start=seq.computed, size=size, width=width)
        else:
            return None
        self.step_log.append((step.kind, tuple(s.seq_id for s in step.seqs)))
        return step

    def prefilled(self, seq: Sequence, n: int) -> None:
        seq.computed += n
        if seq.prefill_remaining == 0:
            seq.status = SeqStatus.DECODING

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        self.free_slots.sort()
        self.reserved -= seq.reserved_tokens

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running


def _cancelled(seq: Sequence) -> bool:
    flag = getattr(seq.payload, "cancelled", None)
    return bool(flag is not None and flag.is_set())


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def piece(remaining: int, chunk: int, short: int = 0) -> tuple[int, int]:
    """(size, width) of the next prefill piece: the largest power of two <= min(remaining,
    chunk) while that is at least the floor (MIN_PIECE, or the chunk if smaller), else all of
    the remaining tokens in one piece padded to the floor; or, with `short` (a plan's
    short_piece), a remainder of at most SHORT_PIECES * short tokens in pieces `short` wide.
    A bounded set of compiled widths, and at most SHORT_PIECES forward calls for a remainder
    below the floor."""
    floor = min(MIN_PIECE, _pow2_floor(chunk))
    n = min(remaining, chunk)
    if short < floor and n <= SHORT_PIECES * short:
        return min(n, short), short
    if n >= floor:
        size = _pow2_floor(n)
        return size, size
    return n, floor


def piece_widths(chunk: int, short: int = 0) -> list[int]:
    """Every width `piece` can return for this chunk (and short piece width), largest first
    (what warmup compiles)."""
    floor, w = min(MIN_PIECE, _pow2_floor(chunk)), _pow2_floor(chunk)
    widths = []
    while w >= floor:
        widths.append(w)
        w >>= 1
    return widths + ([short] if 0 < short < floor else [])
