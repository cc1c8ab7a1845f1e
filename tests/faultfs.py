"""Real storage faults for server tests: a small tmpfs that fills up under a server's state
directory, an immutable file that no one can delete, bytes flipped in a real database file."""
from __future__ import annotations

import contextlib
import errno
import os
import shlex
import sqlite3
import subprocess
from pathlib import Path


def tmpfs_prefix(state_dir: Path, size: str, models: Path) -> tuple[str, ...]:
    """A command prefix that runs the server in a mount namespace of its own, with a `size`
    tmpfs mounted on its state directory (the embedded model linked in from `models`). Root
    mounts in a private mount namespace, another user through a user namespace. The server
    keeps the prefix's pid (each step execs), so `/proc/<pid>/root` shows its view."""
    ns = (("unshare", "--mount", "--propagation", "private") if os.geteuid() == 0
          else ("unshare", "--user", "--map-root-user", "--mount"))
    state = shlex.quote(str(state_dir))
    script = (f"mount -t tmpfs -o size={size},mode=0700 ninfer-faults {state} && "
              f"ln -s {shlex.quote(str(models))} {state}/models && exec \"$@\"")
    return (*ns, "sh", "-c", script, "sh")


def view(pid: int, path: Path) -> Path:
    """`path` as the process `pid` sees it (inside its mount namespace)."""
    return Path(f"/proc/{pid}/root{path}")


@contextlib.contextmanager
def filled(directory: Path):
    """Fill the filesystem holding `directory` to the last byte; free it on exit."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    try:
        yield filler
    finally:
        filler.unlink()


@contextlib.contextmanager
def undeletable(path: Path):
    """Make `path` impossible to delete, for root too: the immutable attribute as root (what
    an admin or a read-only medium does), a read-only parent directory for another user."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True)
        undo = ["chattr", "-i", str(path)]
    else:
        path.parent.chmod(0o500)
        undo = None
    try:
        yield
    finally:
        if undo:
            subprocess.run(undo, check=True)
        else:
            path.parent.chmod(0o700)


def flip_text(db: Path, marker: bytes) -> None:
    """Change one byte of `marker` where it is stored in the database file `db`."""
    data = bytearray(db.read_bytes())
    at = data.find(marker)
    assert at >= 0, "the marker is not in the database file"
    assert data.find(marker, at + 1) < 0, "the marker is in the file twice"
    data[at] ^= 0x01
    db.write_bytes(bytes(data))


def smash_table_root(db: Path, table: str) -> None:
    """Overwrite the root B-tree page of `table` with garbage, as a bad sector would."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?",
                            (table,)).fetchone()[0]
    finally:
        conn.close()
    with open(db, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(bytes((i * 37 + 11) % 256 for i in range(page_size)))
