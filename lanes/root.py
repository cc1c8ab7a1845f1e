"""A lane state root: its layout, its pointers, its lock and its journal.

    <root>/.ninfer-lanes          marker: this directory is a lane root
    <root>/instances/<id>/        installed instances (lanes/instance.py); .tmp-<id> while copied
    <root>/current, previous      symlinks to instances/<id>, each replaced by a rename
    <root>/state/                 the server's state directory, shared by every instance
    <root>/systemd/               the lane's systemd user unit
    <root>/run/                   the managed server's pid record and its output
    <root>/lane.json              which lane this root serves
    <root>/journal.jsonl          append-only, one fsync'd JSON line per step
    <root>/lock                   flock: one lane command at a time changes the root
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import signal
import time
from contextlib import contextmanager
from pathlib import Path

from lanes.cli import EX_CONFIG
from lanes.instance import LaneError
from server.checkpoints.files import fsync_dir, publish_file

DEFAULT_ROOT = Path.home() / ".local" / "share" / "ninfer-lanes"
MARKER = ".ninfer-lanes"
POINTERS = ("current", "previous")
LANE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


class LaneRoot:
    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path or DEFAULT_ROOT).expanduser().absolute()
        self.instances = self.path / "instances"
        self.state = self.path / "state"
        self.systemd = self.path / "systemd"
        self.run = self.path / "run"
        self.journal = Journal(self.path / "journal.jsonl")

    def exists(self) -> bool:
        return (self.path / MARKER).is_file()

    def require(self) -> "LaneRoot":
        if not self.exists():
            what = "does not exist" if not self.path.exists() else "is not a lane root"
            raise LaneError(f"{self.path} {what}; `./ninfer lane install --root {self.path}` "
                            f"makes one", EX_CONFIG)
        return self

    def init(self) -> "LaneRoot":
        """Make the root (or accept an existing one); an unrelated non-empty directory is
        refused."""
        if self.exists():
            return self
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise LaneError(f"{self.path} exists and is not a lane root (no {MARKER}); choose "
                            f"an empty or new directory for --root", EX_CONFIG)
        self.path.mkdir(parents=True, exist_ok=True, mode=0o755)
        for d in (self.instances, self.systemd, self.run):
            d.mkdir(exist_ok=True, mode=0o755)
        self.state.mkdir(exist_ok=True, mode=0o700)
        publish_file(self.path / MARKER, b'{"format": 1}\n')
        return self

    def instance(self, iid: str) -> Path:
        return self.instances / iid

    # ---- pointers ------------------------------------------------------------------------
    def pointer(self, name: str) -> str | None:
        """The instance id a pointer names, or None."""
        try:
            target = os.readlink(self.path / name)
        except FileNotFoundError:
            return None
        parts = Path(target).parts
        if len(parts) != 2 or parts[0] != "instances":
            raise LaneError(f"{self.path / name} points at {target!r}, not at an instance")
        return parts[1]

    def set_pointers(self, current: str | None, previous: str | None) -> None:
        """`previous` first, then `current`, each atomically (a new symlink renamed over the
        old one), then the directory fsync'd. Idempotent."""
        for name, iid in (("previous", previous), ("current", current)):
            path = self.path / name
            if iid is None:
                if os.path.lexists(path):
                    path.unlink()
                continue
            if self.pointer(name) == iid:
                continue
            tmp = self.path / f".tmp-{name}-{secrets.token_hex(4)}"
            os.symlink(f"instances/{iid}", tmp)
            os.replace(tmp, path)
        fsync_dir(self.path)

    # ---- the lane ------------------------------------------------------------------------
    def lane(self) -> str | None:
        try:
            return json.loads((self.path / "lane.json").read_text())["lane"]
        except FileNotFoundError:
            return None

    def set_lane(self, lane: str) -> None:
        if self.lane() != lane:
            publish_file(self.path / "lane.json", json.dumps({"lane": lane}).encode() + b"\n")

    @contextmanager
    def lock(self, wait: bool = True):
        """Hold <root>/lock; yields False (without holding it) when `wait` is off and another
        lane command holds it. The kernel releases it when a process dies."""
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def sweep(self) -> list[str]:
        """Remove leftovers of interrupted work no journal entry needs any more: instance
        copies (instances/.tmp-*), pointer links and half-written files (.tmp-*). Call with
        the lock held and no unfinished journal entry."""
        from lanes.instance import force_rmtree

        gone = []
        for d in (self.instances, self.path, self.systemd, self.run):
            for p in d.glob(".tmp-*"):
                force_rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                gone.append(str(p.relative_to(self.path)))
        return gone


def validate_lane(lane: str, profiles: dict) -> str:
    if not LANE_NAME.match(lane or "") or lane not in profiles:
        raise LaneError(f"unknown lane {lane!r}; this instance's lanes: {sorted(profiles)}",
                        EX_CONFIG)
    return lane


class Journal:
    """Append-only JSONL: {"txn": n, "op": ..., "step": ..., ...}, one fsync'd line a step.
    A transaction is unfinished until its "done" or "aborted" line. `fault` is a test hook
    called with each step's name after the line is durable (lanes/lifecycle.py's
    --test-kill-after)."""

    END = ("done", "aborted")

    def __init__(self, path: Path, fault=None):
        self.path, self.fault = path, fault

    def records(self) -> list[dict]:
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for i, line in enumerate(lines):
            try:
                out.append(json.loads(line))
            except ValueError:
                if i != len(lines) - 1:  # only the last line can be torn (a crash mid-write)
                    raise LaneError(f"{self.path}: line {i + 1} is not JSON") from None
        return out

    def pending(self) -> list[dict] | None:
        """The records of the last transaction when it is unfinished, else None."""
        recs = self.records()
        if not recs or recs[-1]["step"] in self.END:
            return None
        return [r for r in recs if r["txn"] == recs[-1]["txn"]]

    def begin(self, op: str, **fields) -> int:
        recs = self.records()
        txn = recs[-1]["txn"] + 1 if recs else 1
        self.step(txn, "begin", op=op, **fields)
        return txn

    def step(self, txn: int, step: str, **fields) -> None:
        line = json.dumps({"txn": txn, "step": step, "t": round(time.time(), 3), **fields},
                          sort_keys=True).encode() + b"\n"
        new = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:
            fsync_dir(self.path.parent)
        if self.fault is not None:
            self.fault(step)


def kill_after(step: str):
    """The test hook: SIGKILL this process right after `step` is journaled."""
    def fault(name: str) -> None:
        if name == step:
            os.kill(os.getpid(), signal.SIGKILL)
    return fault
