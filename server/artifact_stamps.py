"""Verified-artifact stamps: a restart does not re-hash an artifact it already verified.

After every byte of an artifact was hashed (each part's sha256 and the file's, against the
pin when there is one), the server writes `<state>/verified/<sha256>.json`: the file's identity
(realpath, st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns), its sha256, and an HMAC-SHA256
over them with the 32-byte key `<state>/secrets/artifact-stamp.key` (0600, created once by the
same helper as the checkpoint and reasoning keys). A later load of the same path skips the hash
pass only when a stamp's HMAC verifies, every identity field equals the fstat of the file
descriptor the loader actually reads (a path swapped after the check is not the file it
stats), and its sha256 equals the expected pin. Anything else (no stamp, a corrupt or forged
one, another pin, any field different) means a full verification, as without stamps.

Why the identity is enough: any write to the file, and any chmod, chown, utime or rename of
it, sets its st_ctime to the current time, and an unprivileged user cannot set ctime back
(utime sets atime/mtime only; moving the clock needs privilege). So restoring mtime after
rewriting equal-sized content still changes ctime, and a replaced file has another inode.
A stamp is only written when ctime is at least RACY_MARGIN_S older than the moment the hash
pass started and the fstat after the pass equals the one before it: a write landing in the
same timestamp tick as the pre-hash stat could otherwise leave ctime unchanged while the
bytes hashed were not the bytes on disk (git's "racy clean" problem). A freshly written
artifact is therefore stamped on its second load, not its first.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
from pathlib import Path

from server.checkpoints.files import mkdir_synced, publish_file, read_file
from server.checkpoints.tags import state_secret

_TAG = b"ninfer/artifact/verified-stamp/v1\0"
_IDENTITY = ("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")
_FIELDS = {"version", "realpath", "sha256", *_IDENTITY}
RACY_MARGIN_S = 1.0


def _identity(path, st: os.stat_result) -> dict:
    ident = {k: int(getattr(st, k)) for k in _IDENTITY}
    return {"version": 1, "realpath": os.path.realpath(path), **ident}


def _is_sha(text) -> bool:
    return isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdef" for c in text)


class ArtifactStamps:
    """The stamps of one state directory. `lookup` and `record` never raise for a bad stamp or
    a failed write: either way the answer is "verify in full"."""

    def __init__(self, state_dir: Path):
        state_dir = Path(state_dir)
        self._key = state_secret(state_dir, "artifact-stamp.key")
        self.dir = state_dir / "verified"

    def _tag(self, fields: dict) -> str:
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._key, _TAG + blob, hashlib.sha256).hexdigest()

    def lookup(self, path, st: os.stat_result, expected_sha256: str | None) -> str | None:
        """The sha256 a valid stamp vouches for the file `st` (fstat of the open descriptor) at
        `path`, or None. Without a pin, any valid stamp of this exact file counts."""
        if expected_sha256 is not None:
            if not _is_sha(expected_sha256.lower()):
                return None
            candidates = [self.dir / f"{expected_sha256.lower()}.json"]
        else:
            candidates = sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []
        want = _identity(path, st)
        for stamp in candidates:
            fields = self._read(stamp)
            if fields is None or fields["sha256"] != stamp.stem:
                continue
            if all(fields[k] == v for k, v in want.items()):
                return fields["sha256"]
        return None

    def _read(self, stamp: Path) -> dict | None:
        try:
            data = json.loads(read_file(stamp))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or set(data) != _FIELDS | {"hmac"}:
            return None
        tag = data.pop("hmac")
        if not isinstance(tag, str) or not hmac.compare_digest(self._tag(data), tag):
            return None
        return data if _is_sha(data["sha256"]) else None

    def record(self, path, before: os.stat_result, after: os.stat_result, sha256: str,
               hash_started_ns: int) -> bool:
        """Stamp a file whose every byte was just verified to have `sha256`. `before`/`after`:
        fstat of the descriptor read, taken before and after the hash pass; hash_started_ns:
        time.time_ns() when the pass began. Returns whether a stamp was written."""
        fields = _identity(path, before)
        if fields != _identity(path, after) or not _is_sha(sha256):
            return False  # changed while it was being hashed: nothing to vouch for
        if before.st_ctime_ns > hash_started_ns - int(RACY_MARGIN_S * 1e9):
            return False  # changed too recently to tell a later change apart (module doc)
        fields["sha256"] = sha256
        body = {**fields, "hmac": self._tag(fields)}
        try:
            mkdir_synced(self.dir)
            publish_file(self.dir / f"{sha256}.json",
                         json.dumps(body, sort_keys=True, indent=1).encode() + b"\n")
        except OSError as e:  # the next load verifies in full again; serving is not affected
            print(f"ninfer: could not write the verified-artifact stamp in {self.dir}: "
                  f"{e.strerror or e}", file=sys.stderr, flush=True)
            return False
        return True
