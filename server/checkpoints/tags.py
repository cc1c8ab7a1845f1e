"""Checkpoint identities and origin tags.

Names on disk are digests, never raw principals or session keys: a session's directory is
SHA-256 over a domain tag, the principal and the prompt_cache_key (a capability).

The origin tag is HMAC-SHA256 over the exact manifest bytes. Its key is per principal, derived
from a 32-byte master secret kept in the checkpoint root (mode 0600, created once): keys in the
key file can rotate without orphaning a principal's checkpoints, and one principal's tag never
verifies for another (the principal is part of the derivation, and its digest is in the
manifest). Every input is domain-separated so no tag can be replayed in another role.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

_PRINCIPAL = b"ninfer/checkpoint/principal/v1\0"
_SESSION = b"ninfer/checkpoint/session/v1\0"
_TAG_KEY = b"ninfer/checkpoint/origin-key/v1\0"
_TAG = b"ninfer/checkpoint/manifest/v1\0"


def principal_digest(principal: str) -> str:
    return hashlib.sha256(_PRINCIPAL + principal.encode()).hexdigest()


def session_namespace(principal: str, session: str) -> str:
    """The directory name of (principal, prompt_cache_key) under `sessions/`."""
    h = hashlib.sha256(_SESSION + principal.encode() + b"\0" + session.encode())
    return h.hexdigest()


def load_master_secret(path: Path) -> bytes:
    """The master secret at `path`, created (0600, O_EXCL) if absent; refused if its mode is
    looser than 0600 or its size is wrong."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        st = os.stat(path, follow_symlinks=False)
        if st.st_mode & 0o077:
            raise PermissionError(f"{path} has mode {oct(st.st_mode & 0o777)}; must be 0600")
        data = path.read_bytes()
        if len(data) != 32:
            raise ValueError(f"{path}: {len(data)} bytes, expected a 32-byte secret")
        return data
    data = secrets.token_bytes(32)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return data


def state_secret(state_dir: Path, name: str) -> bytes:
    """The 32-byte secret <state_dir>/secrets/<name> (the directory 0700), created on first
    use and checked as load_master_secret checks it."""
    d = Path(state_dir) / "secrets"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return load_master_secret(d / name)


def principal_key(master: bytes, principal: str) -> bytes:
    return hmac.new(master, _TAG_KEY + principal.encode(), hashlib.sha256).digest()


def manifest_tag(key: bytes, manifest: bytes) -> str:
    return hmac.new(key, _TAG + manifest, hashlib.sha256).hexdigest()


def tag_ok(key: bytes, manifest: bytes, tag: str) -> bool:
    return hmac.compare_digest(manifest_tag(key, manifest), tag.strip())
