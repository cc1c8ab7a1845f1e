"""A bounded host arena that a restore's pages stream through on their way to the device.

Without it a restore stages the whole session on the host (checkpoint_io.StagedPages): 8.6 GB
for a 128K-token session of the 27B, far over the lane's `checkpoint_staging_bytes`, and in
fresh memory whose first touch (page faults, ~0.5 s a GB here) costs more than reading the
disk. The arena is that many bytes, allocated and faulted in once (on a thread at start) and
kept: the planner counts it as resident host memory.

A restore takes the arena whole (one streamed restore at a time: they share the disk anyway)
and splits it into slots of `slot_pages` pages (a power of two up to RUN_PAGES, so the scatter
runs have the shapes `prepare_restore` compiled), at least four slots where the pages allow.
Run k of the session's pages gets a slot when it is first read into (in run order, so a
later run never holds the slot an earlier one waits for); when all of its pages verified, its
arrays are copied to the device (never aliased: the slot is reused) and the slot is free
again. Any failed read aborts the restore: waiting readers give up (`StagingAborted`) and the
arena is released; so it is too when the last run is on the device.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import jax
import numpy as np

from engine.runtime.checkpoint_io import RUN_PAGES, _arrays, _chunks, _replace_arrays, _scatter
from engine.runtime.pages import PageTable

PORT_TIMEOUT_S = 120.0  # a call on the engine thread (reserve, write a run) waits this long

ALIGN = 4096  # each array's rows in a slot start page-aligned, so reads into them can be direct
MIN_SLOTS = 4  # slots a restore is split into where the arena holds that many pages


class StagingAborted(Exception):
    """The restore this read belonged to failed elsewhere; nothing was read."""


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slot_plan(arena_bytes: int, spec) -> tuple[int, int] | None:
    """(slot_pages, slots) for pages of `spec` in an arena of `arena_bytes`: the longest
    power-of-two run (up to RUN_PAGES) that leaves MIN_SLOTS slots, or fewer slots where even
    one-page runs cannot; None when the arena cannot hold one (aligned) page."""
    rows = [int(np.prod(s)) * d.itemsize for s, d in spec]
    fit = arena_bytes // sum(rows)
    if fit < 1:
        return None
    pages = 1 << (min(RUN_PAGES, max(1, fit // MIN_SLOTS)).bit_length() - 1)
    while pages > 1 and arena_bytes // slot_stride(rows, pages) < MIN_SLOTS:
        pages //= 2
    slots = arena_bytes // slot_stride(rows, pages)
    return (pages, slots) if slots else None


def slot_stride(rows, pages: int) -> int:
    """Bytes of one slot: per array, `pages` rows of its page slice, each region aligned."""
    return sum(_up(pages * r) for r in rows)


@dataclass(eq=False)
class PoolReservation:
    """Fresh pool pages held for a restore in flight: no snapshot names them, so nothing
    reads them while its runs are written in; the install takes the table over. `live` goes
    false on the engine thread when the pages go back, so a run's write queued behind that
    never lands in pages another sequence may hold by then."""
    table: PageTable
    page_ids: np.ndarray
    live: bool = True


def release_pages(res: PoolReservation) -> None:
    """Engine thread: the reserved pages back to the pool (once)."""
    if res.live:
        res.live = False
        res.table.release()


def reserve_pages(mem, n_pages: int) -> PoolReservation | None:
    """Engine thread: `n_pages` fresh pages (stored states evicted for room, as an install
    would), or None when running sequences hold too many."""
    while not mem.alloc.can_allocate(n_pages):
        if not mem._evict_one():
            return None
    table = PageTable(mem.alloc)
    table.append(n_pages * mem.page_size)
    return PoolReservation(table, np.asarray(table.pages, np.int32))


def write_run(mem, res: PoolReservation, start: int, stop: int, data) -> None:
    """Engine thread: a run's arrays (on the device) into its reserved pages, unless they
    went back meanwhile (an aborted restore)."""
    if not res.live:
        return
    arrays = _scatter(_arrays(mem.cache.pool), jax.device_put(res.page_ids[start:stop]), data)
    mem.cache = mem.cache._replace(pool=_replace_arrays(mem.cache.pool, arrays))


class StagingArena:
    """`nbytes` of host memory from `alloc(nbytes)` (the checkpoint store's page-aligned
    allocator), faulted in by `start()` on a thread; `layout(spec)` is the store's
    `page_layout` for restores through it."""

    def __init__(self, nbytes: int, alloc):
        self.nbytes, self._alloc = int(nbytes), alloc
        self._buf = None
        self._ready = threading.Event()
        self._busy = threading.Lock()
        self.counts = {"restores": 0, "runs": 0}

    def start(self) -> "StagingArena":
        threading.Thread(target=self._fault_in, name="ninfer-staging", daemon=True).start()
        return self

    def _fault_in(self) -> None:
        try:
            buf = self._alloc(self.nbytes)
            buf[::ALIGN] = 0  # one write a page: the kernel backs all of it now, not mid-restore
            self._buf = buf
        finally:
            self._ready.set()

    def layout(self, spec, fallback, port=None):
        """`page_layout(n_pages, page_bytes)` for CheckpointStore.load: (StreamedPages, one
        lazy view per page) when the arena holds this runtime's pages, else `fallback`'s
        answer (a whole-session StagedPages layout). With the engine's CheckpointPort, the
        pages go into pool pages reserved first, run by run, so the device holds no copy of
        the session either; without room for them, `fallback` too."""
        def make(n: int, page_bytes: int):
            plan = slot_plan(self.nbytes, spec)
            if page_bytes != sum(int(np.prod(s)) * d.itemsize for s, d in spec):
                return None
            self._ready.wait()
            if plan is None or self._buf is None:
                return fallback(n, page_bytes)
            self._busy.acquire()
            try:
                res = None if port is None else port.reserve(n).result(PORT_TIMEOUT_S)
            except BaseException:
                self._busy.release()
                raise
            if port is not None and res is None:
                self._busy.release()
                return fallback(n, page_bytes)
            self.counts["restores"] += 1
            staged = StreamedPages(self, spec, n, *plan, port=port, reservation=res)
            return staged, [staged.lazy_views(i) for i in range(n)]
        return make


class StreamedPages:
    """A restore's pages through a StagingArena; the interface import_snapshot and the
    checkpoint manager use of a StagedPages (n, spec, runs, page_ready, to_device,
    device_chunks), with page views handed out lazily (`lazy_views(i)()` blocks until page
    i's run has a slot), `abandon()` when a read failed (any thread: readers waiting for a
    slot give up) and `abort()` once a failed load's reads are all over (the arena and the
    reserved pages go back). The arena is released only when no reader can still write into
    it: by the last run's page_ready, by abort, or by to_device when a transfer failed."""

    def __init__(self, arena: StagingArena, spec, n: int, slot_pages: int, slots: int,
                 port=None, reservation: PoolReservation | None = None):
        self.arena, self.spec, self.n = arena, spec, n
        self._port, self.reservation = port, reservation
        self.page_bytes = sum(int(np.prod(s)) * d.itemsize for s, d in spec)
        self.runs = _chunks(n, slot_pages)
        self._rows = [int(np.prod(s)) * d.itemsize for s, d in spec]
        stride = slot_stride(self._rows, slot_pages)
        self._slots = []
        for k in range(slots):
            off, arrays = k * stride, []
            for rows in self._rows:
                arrays.append(arena._buf[off:off + slot_pages * rows].reshape(slot_pages, rows))
                off += _up(slot_pages * rows)
            self._slots.append(arrays)
        self._free = list(range(slots))
        self._slot_of: dict[int, int] = {}
        self._next = 0  # the next run to take a slot
        self._left = [stop - start for start, stop in self.runs]
        self._run_of = np.repeat(np.arange(len(self.runs)), self._left)
        self._started: list = [None] * len(self.runs)
        self.device_chunks = None
        self.error: BaseException | None = None  # a failed transfer or write
        self._aborted = self._released = False
        self._cv = threading.Condition()

    def lazy_views(self, i: int):
        """A callable giving `views(i)`, or None once the restore was aborted (the store's
        lazy-view protocol: it knows nothing of StagingAborted)."""
        def get():
            try:
                return self.views(i)
            except StagingAborted:
                return None
        return get

    def views(self, i: int) -> list[memoryview]:
        """Page i's slices in its run's slot, in page-byte order; blocks until the run has
        one. Raises StagingAborted once the restore failed."""
        k = int(self._run_of[i])
        with self._cv:
            while k not in self._slot_of:
                if self._aborted:
                    raise StagingAborted()
                if k == self._next and self._free:
                    self._slot_of[k] = self._free.pop()
                    self._next += 1
                    self._cv.notify_all()
                    break
                self._cv.wait()
            slot = self._slots[self._slot_of[k]]
        j = i - self.runs[k][0]
        return [memoryview(a[j]) for a in slot]

    def page_ready(self, i: int) -> None:
        """Page i verified (a reader thread): the run's last page copies the run to the
        device, then frees its slot."""
        k = int(self._run_of[i])
        with self._cv:
            self._left[k] -= 1
            if self._left[k]:
                return
        start, stop = self.runs[k]
        try:
            slot = self._slots[self._slot_of[k]]
            data = self.transfer([r[:stop - start].view(d).reshape((stop - start,) + tuple(s))
                                  for r, (s, d) in zip(slot, self.spec)])
            res = self.reservation
            if res is not None:  # into the pool now: no device copy is kept
                self._port.write(res, start, stop, data).result(PORT_TIMEOUT_S)
                data = True
            self._started[k] = data
        except Exception as e:  # noqa: BLE001 - reported by to_device
            self.error = e
            self.abandon()
        with self._cv:
            self._free.append(self._slot_of.pop(k))
            self.arena.counts["runs"] += 1
            self._cv.notify_all()
            if all(x is not None for x in self._started):  # every read is over
                self._release()

    @staticmethod
    def transfer(host: list[np.ndarray]) -> list:
        """A run's arrays (views of its slot) on the device, the copy finished, so the slot
        can be reused."""
        if jax.default_backend() == "cpu":  # a CPU "device" array may alias host memory
            host = [h.copy() for h in host]  # (even with may_alias=False): copy it first
        return jax.block_until_ready([jax.device_put(h) for h in host])

    def abandon(self) -> None:
        """A read failed (any thread): readers waiting for a slot give up."""
        with self._cv:
            self._aborted = True
            self._cv.notify_all()

    def abort(self) -> None:
        """The load failed and none of its reads is still running: the arena is free again
        and the reserved pool pages go back."""
        self.abandon()
        with self._cv:
            self._release()
        self._give_back()

    def _give_back(self) -> None:
        with self._cv:
            res, self.reservation = self.reservation, None
        if res is not None:
            self._port.release(res)

    def _release(self) -> None:  # under self._cv
        if not self._released:
            self._released = True
            self.arena._busy.release()

    def to_device(self) -> "StreamedPages":
        """Every run is on the device (or in its reserved pool pages) once every page
        verified: page_ready put it there."""
        if self.error is not None or any(x is None for x in self._started):
            with self._cv:  # the load returned: its reads are over
                self._release()
            self._give_back()
            raise RuntimeError(f"streamed restore incomplete: {self.error!r}")
        self.device_chunks = None if self.reservation is not None else list(self._started)
        return self
