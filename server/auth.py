"""Bearer keys: a 0600 key file mapping keys to principals, constant-time lookup.

Key file format, one entry per line (blank lines and `#` comments ignored):

    <principal> <key> [admin]

A line with a single token is a key for the principal `default`. `admin` after the key lets
that principal see the whole server's figures in `/metrics` and `/v1/ninfer/status` (every
principal's activity, the engine's pools, checkpoints, storage faults); any other principal
sees only its own. A file with one principal needs no mark: the server's figures are its own. On first run, when no key file
exists, one is created with a fresh 256-bit key for `default`.

Rotation: edit the file (replace a principal's key, or list a new key beside the old one for a
grace period, then remove the old one). A running server notices within a second
(`ReloadingKeyRing`) and rereads it; the principal, and with it every session, response and
checkpoint, stays the same. A file that becomes unsafe or malformed fails closed: no key is
accepted until it is fixed.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path


class KeyFileError(RuntimeError):
    """A key file that is unsafe or malformed: the server refuses to start."""


@dataclass(frozen=True)
class KeyRing:
    entries: tuple[tuple[str, bytes], ...]  # (principal, key bytes)
    admins: frozenset[str] = frozenset()    # principals marked `admin`

    def sees_all(self, principal: str | None) -> bool:
        """Whether `principal` may see the whole server's figures: marked admin, or the only
        principal there is."""
        if principal is None:
            return False
        return principal in self.admins or {p for p, _ in self.entries} == {principal}

    def principal_for(self, presented: str | None) -> str | None:
        """The principal owning `presented`, comparing every key in constant time."""
        if not presented:
            return None
        given = presented.encode()
        found = None
        for principal, key in self.entries:
            # No early exit: the time taken does not depend on which key (if any) matched.
            if hmac.compare_digest(given, key):
                found = principal
        return found


def create_key_file(path: Path) -> str:
    """Create `path` with a fresh key for `default`, mode 0600, atomically; return the key."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = "nk-" + secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, f"default {key}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.link(tmp, path)  # fails if another process created the file meanwhile: never overwrite
    os.unlink(tmp)
    return key


def load_key_file(path: Path) -> KeyRing:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise KeyFileError(f"key file {path} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"key file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise KeyFileError(f"key file {path} is readable or writable by group/others "
                           f"(mode {stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}")
    entries, admins = [], set()
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) == 1:
            principal, key = "default", parts[0]
        elif len(parts) == 2 or (len(parts) == 3 and parts[2] == "admin"):
            principal, key = parts[:2]
            if len(parts) == 3:
                admins.add(principal)
        else:
            raise KeyFileError(f"key file {path}, line {n}: expected '<principal> <key>' or "
                               "'<principal> <key> admin'")
        if len(key) < 16:
            raise KeyFileError(f"key file {path}, line {n}: key shorter than 16 characters")
        entries.append((principal, key.encode()))
    if not entries:
        raise KeyFileError(f"key file {path} holds no keys")
    keys = [k for _, k in entries]
    if len(set(keys)) != len(keys):
        raise KeyFileError(f"key file {path}: the same key is listed twice")
    return KeyRing(tuple(entries), frozenset(admins))


def ensure_key_file(path: Path) -> tuple[KeyRing, bool]:
    """Load the key file, creating it first if absent. Returns (keys, created)."""
    created = False
    if not path.exists():
        try:
            create_key_file(path)
            created = True
        except FileExistsError:
            pass
    return load_key_file(path), created


class ReloadingKeyRing:
    """A KeyRing that follows its file: checked at most once per `interval_s`, reread when its
    identity, mode or content changed."""

    def __init__(self, path: Path, ring: KeyRing, interval_s: float = 1.0):
        self.path = Path(path)
        self._ring: KeyRing | None = ring
        self._interval = interval_s
        self._checked = time.monotonic()
        self._sig = self._signature()
        self._lock = threading.Lock()

    def _signature(self):
        """The file's identity, mode and content digest: a key swapped in place that keeps the
        size and the modification time is still noticed (the file is a few lines)."""
        try:
            st = self.path.stat()
            digest = hashlib.sha256(self.path.read_bytes()).digest()
        except OSError:
            return None
        return (st.st_ino, st.st_mode, digest)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < self._interval:
            return
        with self._lock:
            self._checked = now
            sig = self._signature()
            if sig == self._sig:
                return
            self._sig = sig
            try:
                self._ring = load_key_file(self.path)
                print(f"ninfer: key file {self.path} reloaded "
                      f"({len(self._ring.entries)} keys)", file=sys.stderr, flush=True)
            except KeyFileError as e:
                self._ring = None  # fail closed until the file is fixed
                print(f"ninfer: key file refused, no key is accepted until it is fixed: {e}",
                      file=sys.stderr, flush=True)

    @property
    def entries(self) -> tuple[tuple[str, bytes], ...]:
        self._refresh()
        return () if self._ring is None else self._ring.entries

    def principal_for(self, presented: str | None) -> str | None:
        self._refresh()
        ring = self._ring
        return None if ring is None else ring.principal_for(presented)

    def sees_all(self, principal: str | None) -> bool:
        self._refresh()
        ring = self._ring
        return ring is not None and ring.sees_all(principal)
