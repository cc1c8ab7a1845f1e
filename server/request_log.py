"""The JSONL request log: one JSON object per line, append-only, 0600, rotated by size.

It never holds prompt or output text, and never a key: a field whose name says it might is
refused (ValueError: a programming error, caught by the tests), and strings are capped in length.

Identity: the principal name is an operator's label, not a secret, but it is logged as a short
domain-tagged digest like every other identity (`principal_digest(name)` recomputes it for
grepping). The session key (`prompt_cache_key`) is a capability: only a digest scoped by the
principal is logged. Bearer keys never reach the log: no function here takes one.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from datetime import datetime, timezone
from pathlib import Path

EVENTS = frozenset({"server_start", "request_start", "request_rejected", "request_done",
                    "request_error", "server_stop", "checkpoint_saved", "checkpoint_refused",
                    "checkpoint_skipped", "checkpoint_restore", "executable_rejected",
                    "executable_unloadable", "executable_unserializable", "executable_unsaved",
                    "executables_saved"})


# ---- identity digests -------------------------------------------------------------------------
def _digest(tag: str, *parts: str) -> str:
    h = hashlib.sha256(f"ninfer-log/{tag}".encode())
    for p in parts:  # length-prefixed: ("ab", "c") and ("a", "bc") differ
        b = p.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "big") + b)
    return h.hexdigest()[:16]


def principal_digest(principal: str | None) -> str | None:
    return None if principal is None else "p-" + _digest("principal", principal)


def session_digest(principal: str | None, session: str | None) -> str | None:
    """The digest of a session (prompt_cache_key) of the principal named `principal`."""
    return session_digest_of(principal_digest(principal), session)


def session_digest_of(principal_dig: str | None, session: str | None) -> str | None:
    """The same, from the principal's digest: sessions are namespaced per principal."""
    return None if session is None else "s-" + _digest("session", principal_dig or "", session)


# ---- the request log --------------------------------------------------------------------------
# Name parts that say "this field may hold text or a secret". A part is exempt only when the name
# ends in a unit (prompt_tokens, output_bytes) and the value is a number.
_FORBIDDEN = frozenset({"text", "prompt", "prompts", "input", "inputs", "output", "outputs",
                        "content", "contents", "instructions", "instruction", "key", "keys",
                        "authorization", "auth", "bearer", "secret", "password", "message",
                        "messages", "body", "header", "headers", "delta", "token"})
_UNITS = frozenset({"tokens", "bytes", "chars", "count", "s", "ms"})
_MAX_STR = 200  # ids, codes, model names; anything longer is text that has no place here


def _check_field(name: str, value, where: str = "") -> None:
    parts = [p for p in re.split(r"[^a-z0-9]+", name.lower()) if p]
    if not parts:
        raise ValueError(f"request log: empty field name {where}{name!r}")
    numeric = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
    if _FORBIDDEN.intersection(parts) and not (parts[-1] in _UNITS and numeric):
        raise ValueError(f"request log: field {where}{name!r} may carry text or a secret")
    if isinstance(value, str) and len(value) > _MAX_STR:
        raise ValueError(f"request log: field {where}{name!r} is a {len(value)}-char string")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_field(str(k), v, f"{where}{name}.")
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_field(name, v, where)
    elif not (value is None or isinstance(value, (bool, int, float, str))):
        raise ValueError(f"request log: field {where}{name!r} has type {type(value).__name__}")


def rfc3339_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class RequestLog:
    """Append-only JSONL, mode 0600. Each record is one write(2) of one whole line on an O_APPEND
    descriptor, under a lock (the event loop and the engine thread both write), so a reader never
    sees half a line and nothing waits in a buffer. At `max_bytes` the file rotates: path.1 ..
    path.<backups> (oldest dropped), so at most backups + 1 files exist."""

    def __init__(self, path: str | os.PathLike, *, max_bytes: int = 64 << 20, backups: int = 5):
        if max_bytes < 1 or backups < 0:
            raise ValueError("max_bytes must be >= 1 and backups >= 0")
        self.path = Path(path)
        self.max_bytes, self.backups = max_bytes, backups
        self._lock = threading.Lock()
        self._closed = False
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size

    def _open(self) -> int:
        # O_NOFOLLOW: a symlink planted at the log path cannot redirect our writes.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # a pre-existing file with looser bits is tightened
        return fd

    def write(self, event: str, /, **fields) -> None:
        """Append one record {ts, event, **fields}. ValueError for a field that may carry text
        or a secret, an unknown event, or a value that is not JSON scalars/lists/dicts."""
        if event not in EVENTS:
            raise ValueError(f"request log: unknown event {event!r}")
        for reserved in ("ts", "event"):
            if reserved in fields:
                raise ValueError(f"request log: field {reserved!r} is set by the log")
        for name, value in fields.items():
            _check_field(name, value)
        record = {"ts": rfc3339_now(), "event": event, **fields}
        line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
        with self._lock:
            if self._closed:
                raise ValueError("request log is closed")
            if self._fd < 0:  # an earlier rotation failed to reopen: try again
                self._fd = self._open()
                self._size = os.fstat(self._fd).st_size
            if self._size and self._size + len(line) > self.max_bytes:
                self._rotate()
            view = memoryview(line)
            while view:  # a regular file takes it whole; loop anyway rather than assume
                view = view[os.write(self._fd, view):]
            self._size += len(line)

    def _rotate(self) -> None:
        """Shift path -> path.1 -> ... -> path.<backups>; the oldest falls off. Single writer
        process: the lock serializes this process's threads only."""
        os.close(self._fd)
        self._fd = -1
        try:
            if self.backups == 0:
                os.unlink(self.path)
            else:
                for i in range(self.backups - 1, 0, -1):
                    src = self.path.with_name(f"{self.path.name}.{i}")
                    if src.exists():
                        os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
                os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        finally:  # even when a rename failed, keep appending to whatever file is at `path`
            self._fd = self._open()
            self._size = os.fstat(self._fd).st_size

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> "RequestLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
