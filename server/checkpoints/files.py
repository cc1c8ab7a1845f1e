"""Durable file primitives for the checkpoint store: every write is new-file, fsync, rename,
fsync of the directory. Fault injection for tests lives here and only here.

Payloads are any buffers (bytes, memoryview, C-contiguous numpy arrays) or sequences of them
(written back to back, never concatenated). Many files are written from a thread pool: the
write and fsync syscalls release the GIL, and concurrent fsyncs let the filesystem batch its
journal commits; a file still becomes visible under its final name only after its own fsync,
and every directory touched is fsync'd once after all renames.

A load reads with O_DIRECT wherever it can (`read_into` into `aligned_bytes` buffers): the disk
writes the pages straight into the buffers they are verified in, with no page-cache copy (on
2 cores that copy is a third of a cold restore's CPU; docs/benchmarks/README.md), and a restore
of GBs does not push the rest of the page cache (the model's file among it) out. What the page
cache already holds (a checkpoint written minutes ago) is copied from it first, without waiting
on the disk (RWF_NOWAIT): O_DIRECT would read it from the disk again. A buffer or a file that
O_DIRECT cannot take (unaligned, a filesystem such as tmpfs) is read as before.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import secrets
from pathlib import Path

import numpy as np

DIRECT_ALIGN = 4096  # O_DIRECT's alignment of buffer addresses, lengths and file offsets
# files read each way by read_into (from the page cache, O_DIRECT, buffered): tests and probes
READS = {"cached": 0, "direct": 0, "buffered": 0}


class Faults:
    """Injected failures, from NINFER_CHECKPOINT_FAULTS (comma-separated): `enospc` makes
    every payload write fail with ENOSPC, as a full disk would."""

    def __init__(self, spec: str = ""):
        self.enabled = {s.strip() for s in spec.split(",") if s.strip()}

    def check_write(self) -> None:
        if "enospc" in self.enabled:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def as_parts(data) -> list[memoryview]:
    """A payload as a list of flat byte views (no copies): one buffer or a sequence of them."""
    parts = data if isinstance(data, (list, tuple)) else [data]
    out = []
    for p in parts:
        v = memoryview(p)
        if not v.c_contiguous:
            raise ValueError("checkpoint payloads must be C-contiguous buffers")
        out.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
    return out


def nbytes(data) -> int:
    return sum(v.nbytes for v in as_parts(data))


def wait_all(futures) -> list:
    """The futures' results in order, after every one finished; the first error is raised
    only then (so no task is still writing when the caller cleans up)."""
    first, out = None, []
    for f in futures:
        try:
            out.append(f.result())
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out.append(None)
            first = first or e
    if first is not None:
        raise first
    return out


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dirs(paths, pool=None) -> None:
    paths = sorted(set(paths))
    if pool is None or len(paths) < 2:
        for d in paths:
            fsync_dir(d)
    else:
        wait_all([pool.submit(fsync_dir, d) for d in paths])


def write_new(path: Path, data, faults: Faults | None = None) -> None:
    """Create `path` (it must not exist), write `data` (a buffer or a sequence of buffers),
    fsync. The caller fsyncs the dir."""
    if faults is not None:
        faults.check_write()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        for view in as_parts(data):
            while view:
                n = os.write(fd, view)
                view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_file(path: Path, data, faults: Faults | None = None) -> None:
    """Write `path` atomically: a temporary name in the same directory, fsync, rename over
    `path`, fsync the directory. A crash leaves the old file or the new one, never a mix."""
    publish_files([(path, data)], faults)


def _publish_one(path: Path, data, faults) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")
    try:
        write_new(tmp, data, faults)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def publish_files(items, faults: Faults | None = None, pool=None) -> None:
    """`publish_file` for many new files: each is written and fsync'd under a temporary name
    and only then renamed (on `pool`'s threads when given, concurrently); after all of them,
    every directory touched is fsync'd once (not once per file). On an error the first one
    is raised after every task ended; files already renamed stay (content-addressed pages:
    unreferenced, collected later)."""
    items = list(items)
    if pool is None or len(items) < 2:
        for path, data in items:
            _publish_one(path, data, faults)
    else:
        wait_all([pool.submit(_publish_one, path, data, faults) for path, data in items])
    fsync_dirs({path.parent for path, _ in items}, pool)


def mkdir_synced(path: Path) -> None:
    if path.is_dir():
        return
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fsync_dir(path.parent)


def mkdirs_synced(paths, pool=None) -> None:
    """Create the missing directories among `paths`, then fsync each parent once."""
    parents = set()
    for p in paths:
        if not p.is_dir():
            p.mkdir(mode=0o700, parents=True, exist_ok=True)
            parents.add(p.parent)
    fsync_dirs(parents, pool)


def read_file(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.read()
    finally:
        if fd >= 0:
            os.close(fd)


def aligned_bytes(n: int) -> np.ndarray:
    """n bytes (uint8) of fresh anonymous memory whose address is page-aligned, so that views
    into it at multiples of DIRECT_ALIGN can take O_DIRECT reads."""
    return np.frombuffer(mmap.mmap(-1, n), np.uint8) if n else np.empty(0, np.uint8)


def _direct_ok(views) -> bool:
    for v in views:
        if v.nbytes % DIRECT_ALIGN or v.readonly:
            return False
        if ctypes.addressof(ctypes.c_char.from_buffer(v)) % DIRECT_ALIGN:
            return False
    return True


def read_into(path: Path, views) -> bool:
    """Fill `views` (one buffer or a list, in order) with the whole of `path` (no symlinks).
    False when the file's size is not exactly their total (nothing is trusted then);
    FileNotFoundError when it is absent. What the page cache holds is copied from it (a
    checkpoint read soon after it was written: a restore after an eviction); the rest with
    O_DIRECT when every view allows it and the filesystem does (the module's docstring),
    otherwise through the page cache."""
    views = [memoryview(v).cast("B") for v in (views if isinstance(views, list) else [views])]
    views = [v for v in views if v.nbytes]
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = sum(v.nbytes for v in views)
        if os.fstat(fd).st_size != size:
            return False
        if not (views and _direct_ok(views)):
            READS["buffered"] += 1
            return _fill(fd, views, 0, size, None)
        off = _cached(fd, views, size)
        if off == size:
            READS["cached"] += 1
            return os.fstat(fd).st_size == size
        try:
            direct = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this filesystem takes no O_DIRECT
                raise
            READS["buffered"] += 1
            return _fill(fd, _advance(views, off), off, size, None)
        try:
            READS["direct"] += 1
            return _fill(direct, _advance(views, off), off, size, path)
        finally:
            os.close(direct)
    finally:
        os.close(fd)


def _cached(fd: int, views: list, size: int) -> int:
    """How much of the file's start the page cache gave without waiting for the disk (read
    into `views`), rounded down to DIRECT_ALIGN unless it is all of it: 0 when nothing of it
    is cached or this kernel or filesystem cannot tell (RWF_NOWAIT)."""
    try:
        n = os.preadv(fd, views, 0, os.RWF_NOWAIT)
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP/EINVAL: cannot ask without waiting
        return 0
    return n if n == size else n - n % DIRECT_ALIGN


def _advance(views: list, n: int) -> list:
    """`views` less their first n bytes."""
    out = list(views)
    while out and n >= out[0].nbytes:
        n -= out[0].nbytes
        out.pop(0)
    if n:
        out[0] = out[0][n:]
    return out


def _fill(fd: int, views: list, off: int, size: int, direct_path: Path | None) -> bool:
    """Read from offset `off` until `views` are full (one preadv for all of a page's slices;
    short reads resume). False when the file shrank or grew under us (not the file the size
    check saw). `direct_path`: fd is O_DIRECT on that file; a read left at an unaligned
    offset, where O_DIRECT cannot resume, finishes through the page cache."""
    while views:
        n = os.preadv(fd, views, off)
        if n == 0:
            return False  # shrank under us
        off += n
        views = _advance(views, n)
        if direct_path is not None and off % DIRECT_ALIGN and views:
            fd2 = os.open(direct_path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                return _fill(fd2, views, off, size, None)
            finally:
                os.close(fd2)
    return os.fstat(fd).st_size == size


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (0 if it is gone)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except FileNotFoundError:
                continue
            total += st.st_size
    return total
