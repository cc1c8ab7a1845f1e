"""Durable file primitives for the checkpoint store: every write is new-file, fsync, rename,
fsync of the directory. Fault injection for tests lives here and only here."""
from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path


class Faults:
    """Injected failures, from NINFER_CHECKPOINT_FAULTS (comma-separated): `enospc` makes
    every payload write fail with ENOSPC, as a full disk would."""

    def __init__(self, spec: str = ""):
        self.enabled = {s.strip() for s in spec.split(",") if s.strip()}

    def check_write(self) -> None:
        if "enospc" in self.enabled:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new(path: Path, data: bytes, faults: Faults | None = None) -> None:
    """Create `path` (it must not exist), write `data`, fsync. The caller fsyncs the dir."""
    if faults is not None:
        faults.check_write()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_file(path: Path, data: bytes, faults: Faults | None = None) -> None:
    """Write `path` atomically: a temporary name in the same directory, fsync, rename over
    `path`, fsync the directory. A crash leaves the old file or the new one, never a mix."""
    publish_files([(path, data)], faults)


def publish_files(items, faults: Faults | None = None) -> None:
    """`publish_file` for many new files: each is written and fsync'd under a temporary name
    and renamed, then every directory touched is fsync'd once (not once per file)."""
    dirs = set()
    for path, data in items:
        tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")
        try:
            write_new(tmp, data, faults)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dirs.add(path.parent)
    for d in sorted(dirs):
        fsync_dir(d)


def mkdir_synced(path: Path) -> None:
    if path.is_dir():
        return
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fsync_dir(path.parent)


def read_file(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.read()
    finally:
        if fd >= 0:
            os.close(fd)


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
