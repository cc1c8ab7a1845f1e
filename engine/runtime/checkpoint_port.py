"""The engine's checkpoint interface: what a checkpointer outside the engine is given and may
call, so that it never reaches into the engine's memory.

`EngineHooks`: the callbacks an engine is built with (`Engine(..., hooks=...)`), called on the
engine thread. `CheckpointPort` (`Engine.checkpoint`): the pool's page layout and the recurrent
state's layout, fixed for the engine's life (any thread), and the export and install of stored
states (engine/runtime/checkpoint_io.py), which run on the engine thread: `export` where the
caller is on it already (a hook), `export_stored` and `install` through `Engine.call`.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.runtime.checkpoint_io import (PageDigests, SnapshotExport, export_snapshot,
                                          import_snapshot, page_spec, prepare_restore)
from engine.runtime.memory import Snapshot
from engine.runtime.staging import release_pages, reserve_pages, write_run


@dataclass(frozen=True)
class EngineHooks:
    """before_evict(snapshot): on the engine thread, before the runtime drops a stored state to
    make room; the state can still be exported there (`CheckpointPort.export`)."""
    before_evict: Callable[[Snapshot], None] | None = None


@dataclass(frozen=True)
class StateLayout:
    """A stored state's recurrent-state image: conv [conv_shape] of conv_dtype and rec
    [rec_shape] fp32. As bytes: conv's then rec's, each C order."""
    conv_shape: tuple[int, ...]
    conv_dtype: np.dtype
    rec_shape: tuple[int, ...]

    def to_bytes(self, conv: np.ndarray, rec: np.ndarray) -> list[np.ndarray]:
        """The image's bytes as uint8 views of `conv` and `rec` (no copy where contiguous)."""
        return [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in (conv, rec)]

    def from_bytes(self, data) -> tuple[np.ndarray, np.ndarray]:
        """(conv, rec) viewed from an image's bytes (`to_bytes` joined), without copying."""
        conv_count = int(np.prod(self.conv_shape))
        conv = np.frombuffer(data, self.conv_dtype, count=conv_count).reshape(self.conv_shape)
        rec = np.frombuffer(data, np.float32, offset=conv_count * self.conv_dtype.itemsize)
        return conv, rec.reshape(self.rec_shape)


class CheckpointPort:
    """`mem`: the engine's Memory; `call`: `Engine.call` (runs a function of the engine on its
    thread between steps, returns a Future)."""

    def __init__(self, mem, call: Callable[[Callable], Future]):
        self._mem, self._call = mem, call
        self.page_size = mem.page_size
        # (shape, dtype) of each pool array's slice of one page: how page bytes are laid out
        self.page_spec = page_spec(mem.cache.pool)
        st = mem.states
        self.state_layout = StateLayout(tuple(st.conv_shape), np.dtype(st.conv_dtype),
                                        tuple(st.rec_shape))

    def export(self, snap: Snapshot, digests: PageDigests | None = None,
               session: str | None = None) -> SnapshotExport:
        """Host copies of `snap`'s state and of its pages whose digest `digests` does not know.
        Engine thread only: call it from a hook."""
        return export_snapshot(self._mem, snap, digests, session=session)

    def export_stored(self, principal: str, key: str, digests: PageDigests | None = None,
                      session: str | None = None) -> Future:
        """`export` of the stored state of `principal` under `key` (prefix.token_key), on the
        engine thread; the Future's result is None where no such state is stored."""
        def run(_engine):
            snap = self._mem.index.get(principal, key)
            return None if snap is None else self.export(snap, digests, session)
        return self._call(run)

    def install(self, principal: str, session: str | None, tokens, pages, conv: np.ndarray,
                rec: np.ndarray, digests: PageDigests | None = None,
                page_digests: list[str] | None = None) -> Future:
        """Install a state read from disk as a stored state of `principal`, on the engine
        thread (checkpoint_io.import_snapshot); the Future's result is its Snapshot, or None
        where the runtime has no room."""
        return self._call(lambda _engine: import_snapshot(
            self._mem, principal, session, tokens, pages, conv, rec, digests, page_digests))

    def reserve(self, n_pages: int) -> Future:
        """Fresh pool pages for a restore that writes its runs in as they verify
        (staging.reserve_pages, on the engine thread): a PoolReservation, or None without
        room. `install` of its StreamedPages takes them over; `release` gives them back."""
        return self._call(lambda _engine: reserve_pages(self._mem, n_pages))

    def write(self, reservation, start: int, stop: int, data) -> Future:
        """Pages [start, stop) of a reservation (device arrays, page-major) into the pool."""
        return self._call(lambda _engine: write_run(self._mem, reservation, start, stop, data))

    def release(self, reservation) -> Future:
        return self._call(lambda _engine: release_pages(reservation))

    def prepare_restore(self) -> int:
        """Compile ahead of time what a first restore would compile on its way to the first
        token (checkpoint_io.prepare_restore); reads only shapes: any thread. Returns how many
        executables it prepared."""
        return prepare_restore(self._mem)
