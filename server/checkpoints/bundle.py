"""The session bundle: one session's checkpoint and stored responses in a file that can leave
the machine (`./ninfer checkpoints export|import`, format: docs/checkpoints.md "Moving a
session").

A bundle is a plain (ustar) tar archive, so `tar tvf` lists it:

    bundle.json          what the bundle holds: owner, fingerprint, the checkpoint's manifest
                         fields and every other entry's path, size and sha256
    checkpoint/tokens.bin, checkpoint/state.bin, pages/<sha256>, responses.json
    bundle.mac           hex HMAC-SHA256 over "ninfer/session-bundle/v1\\0" + bundle.json,
                         keyed by the transfer key

Checkpoint tags are keyed by a secret of the state directory that wrote them, so another server
cannot verify them; the transfer key (32 random bytes the owner creates once and gives to both
servers) authenticates the bundle instead, and the importer tags what it publishes with its own
state directory's secret. `read_bundle` checks everything (entry names and types, the tag, every
entry's size and sha256, nothing missing or extra) before returning any of it: an importer
that writes only after it returned never writes from a bundle that fails a check. It keeps only
the small entries; the pages, hashed as they stream past, are read again one at a time when
they are written (`Bundle.read_page`, checked once more), so an import of a 128K-token session
does not hold its 8 GB in memory.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from server.checkpoints.files import fsync_dir
from server.checkpoints.tags import load_master_secret

BUNDLE_TYPE = "ninfer.session-bundle"
BUNDLE_SCHEMA = 1
HEADER, MAC = "bundle.json", "bundle.mac"
_MAC_DOMAIN = b"ninfer/session-bundle/v1\0"
# every name a bundle may hold: no directories, no "..", nothing absolute
_ENTRY = re.compile(r"(checkpoint/(tokens|state)\.bin|pages/[0-9a-f]{64}|responses\.json)")
_SHA = re.compile(r"[0-9a-f]{64}")
TRANSFER_KEY_NAME = "transfer-key"


class BundleError(ValueError):
    """A bundle refused; the message names the file and the entry or field."""


def default_transfer_key(state_dir: Path) -> Path:
    return Path(state_dir) / "secrets" / TRANSFER_KEY_NAME


def create_transfer_key(path: Path) -> Path:
    """A new 32-byte transfer key at `path` (0600, its directory 0700); never overwrites."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        raise FileExistsError(f"{path} exists; a transfer key is never overwritten")
    load_master_secret(path)  # O_EXCL create, 0600, fsync'd
    fsync_dir(path.parent)
    return path


def read_transfer_key(path: Path) -> bytes:
    """The transfer key at `path`: it must exist, be 0600 and hold 32 bytes."""
    path = Path(path)
    if not path.is_file() or path.is_symlink():
        raise BundleError(f"no transfer key at {path} (create one with "
                          "`./ninfer checkpoints transfer-key`)")
    try:
        return load_master_secret(path)
    except (PermissionError, ValueError) as e:
        raise BundleError(f"transfer key: {e}") from None


def _mac(key: bytes, header: bytes) -> str:
    return hmac.new(key, _MAC_DOMAIN + header, hashlib.sha256).hexdigest()


def _tar_member(name: str, size: int, mtime: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o600, mtime
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def sign_header(key: bytes, header: dict, entries: list, pool=None):
    """`header` completed with the entries' names, sizes and sha256 (hashed here, on `pool`
    when given, where an entry's digest is None): its canonical bytes, their tag under the
    transfer key, and the entries' byte views. The bytes a bundle's bundle.json holds, and a
    replica's manifest."""
    for name, _, _ in entries:
        if not _ENTRY.fullmatch(name):
            raise ValueError(f"not a bundle entry name: {name!r}")
    views = [memoryview(data).cast("B") for _, data, _ in entries]
    todo = [i for i, (_, _, sha) in enumerate(entries) if sha is None]
    run = pool.map if pool is not None else map
    hashed = dict(zip(todo, run(lambda i: hashlib.sha256(views[i]).hexdigest(), todo)))
    listed = [{"path": name, "bytes": views[i].nbytes, "sha256": sha or hashed[i]}
              for i, (name, _, sha) in enumerate(entries)]
    head = dict(header, type=BUNDLE_TYPE, schema=BUNDLE_SCHEMA, entries=listed)
    head_b = json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
    return head_b, _mac(key, head_b), views


def write_bundle(out: Path, key: bytes, header: dict, entries: list, pool=None) -> int:
    """Write the bundle atomically (a temporary file beside `out`, fsync, rename, fsync the
    directory). `entries` are (name, buffer, sha256 or None: hashed here, on `pool` when
    given); `header` gains their sizes and digests. Each payload goes to the file in one
    write, no copy. Returns the bundle's size in bytes."""
    out = Path(out)
    head_b, tag, views = sign_header(key, header, entries, pool)
    listed = json.loads(head_b)["entries"]
    members = ([(HEADER, memoryview(head_b))] + [(e["path"], v) for e, v in zip(listed, views)]
               + [(MAC, memoryview((tag + "\n").encode()))])
    mtime = int(header["created_at"])
    tmp = out.with_name(f".tmp-{out.name}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        total = 0
        for name, view in members:  # ustar: header block, data, zero padding to 512
            pad = -view.nbytes % tarfile.BLOCKSIZE
            _write_all(fd, _tar_member(name, view.nbytes, mtime))
            _write_all(fd, view)
            _write_all(fd, bytes(pad))
            total += tarfile.BLOCKSIZE + view.nbytes + pad
        end = 2 * tarfile.BLOCKSIZE  # two zero blocks, then up to a whole record
        end += -(total + end) % tarfile.RECORDSIZE
        _write_all(fd, bytes(end))
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, out)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out.parent)
    return out.stat().st_size


def verify_header(key: bytes, head_b: bytes, tag: bytes | str, where: str) -> dict:
    """The header `head_b` parsed, once `tag` verifies it under the transfer key and every
    entry it lists has a bundle entry name, a size and a sha256 (BundleError naming `where`)."""
    if isinstance(tag, bytes):
        tag = tag.decode("ascii", "replace")
    if not hmac.compare_digest(_mac(key, head_b), tag.strip()):
        raise BundleError(f"{where}: {MAC} does not verify {HEADER}: a wrong transfer key, "
                          "or the bundle was altered")
    try:
        head = json.loads(head_b)
        if head["type"] != BUNDLE_TYPE or head["schema"] != BUNDLE_SCHEMA:
            raise BundleError(f"{where}: {HEADER}: type/schema {head['type']}/"
                              f"{head['schema']} is not {BUNDLE_TYPE}/{BUNDLE_SCHEMA}")
        for e in head["entries"]:
            if not (_ENTRY.fullmatch(e["path"]) and _SHA.fullmatch(e["sha256"])
                    and int(e["bytes"]) >= 0):
                raise BundleError(f"{where}: {HEADER} lists {e['path']!r}, not a bundle entry")
        for name in ("principal", "session", "fingerprint"):
            head[name]  # noqa: B018 - presence
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"{where}: {HEADER} is malformed ({e})") from None
    return head


@dataclass
class Bundle:
    """A bundle that passed every check: its header, the bytes of its small entries (the
    checkpoint's tokens and state image, the responses) and, for each page, where it lies in
    the file (`pages`: name -> (offset, size)), read again only when it is written
    (`read_page`, which checks it once more: the file may have changed since). Close it, or
    use it as a context manager: it holds the file open."""
    header: dict
    data: dict[str, bytes | bytearray]
    pages: dict[str, tuple[int, int]] = field(default_factory=dict)
    fd: int = -1
    where: str = ""

    @property
    def principal(self) -> str:
        return self.header["principal"]

    @property
    def session(self) -> str:
        return self.header["session"]

    def read_page(self, digest: str, buf: bytearray) -> memoryview:
        """Entry pages/<digest> read into `buf` (at least page_size(digest) bytes, reused by
        the caller: no allocation a page). Its size is checked here; its bytes against the
        digest by the store that writes it (CheckpointStore.save_streamed), once."""
        off, size = self.pages[f"pages/{digest}"]
        view = memoryview(buf)[:size]
        done = 0
        while done < size:
            n = os.preadv(self.fd, [view[done:]], off + done)
            if n <= 0:
                break
            done += n
        if done != size:
            raise BundleError(f"{self.where}: entry pages/{digest[:16]} changed while it was "
                              "imported")
        return view

    def page_size(self, digest: str) -> int:
        return self.pages[f"pages/{digest}"][1]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Bundle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


READ_CHUNK = 8 << 20  # a page entry is hashed in pieces of this size: memory stays bounded


def read_bundle(path: Path, key: bytes) -> Bundle:
    """Read and verify the bundle at `path` completely, holding at most its small entries and
    a few pieces of the pages in memory (pages are hashed as they are read, then dropped);
    raises BundleError naming the file and the entry (or field) that failed."""
    path = Path(path)
    where = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise BundleError(f"{where}: no such file") from None
    except OSError as e:
        raise BundleError(f"{where}: cannot open: {e.strerror}") from None
    try:
        b = _scan(fd, key, where)
    except BaseException:
        os.close(fd)
        raise
    return b


def _scan(fd: int, key: bytes, where: str) -> Bundle:
    size = os.fstat(fd).st_size
    data: dict[str, bytes | bytearray] = {}
    spans: dict[str, tuple[int, int]] = {}
    try:
        with os.fdopen(os.dup(fd), "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
            for m in tar:  # headers only: tarfile seeks over each member's data
                name = m.name
                if not m.isreg():
                    raise BundleError(f"{where}: entry {name!r} is not a regular file "
                                      "(links and directories are refused)")
                if name.startswith("/") or ".." in name.split("/") or not (
                        name in (HEADER, MAC) or _ENTRY.fullmatch(name)):
                    raise BundleError(f"{where}: entry {name!r} is not a bundle entry name")
                if name in spans:
                    raise BundleError(f"{where}: entry {name!r} appears twice")
                if m.offset_data + m.size > size:
                    raise BundleError(f"{where}: entry {name!r} is truncated")
                spans[name] = (m.offset_data, m.size)
    except tarfile.TarError as e:
        raise BundleError(f"{where}: not a complete bundle ({e})") from None
    except (EOFError, OSError) as e:
        raise BundleError(f"{where}: truncated or unreadable ({e})") from None
    for name in (HEADER, MAC):
        if name not in spans:
            raise BundleError(f"{where}: entry {name} is missing (truncated bundle?)")
    head_b, tag = (os.pread(fd, spans[n][1], spans[n][0]) for n in (HEADER, MAC))
    head = verify_header(key, head_b, tag, where)
    del spans[HEADER], spans[MAC]
    listed = {e["path"]: e for e in head["entries"]}
    for name in sorted(set(listed) | set(spans)):
        if name not in spans:
            raise BundleError(f"{where}: entry {name} is missing (truncated bundle?)")
        if name not in listed:
            raise BundleError(f"{where}: entry {name} is not listed in {HEADER}")
    names = sorted(spans)
    with ThreadPoolExecutor(min(8, (os.cpu_count() or 1) + 2)) as pool:
        sums = list(pool.map(lambda n: _hash_span(fd, *spans[n], keep=not n.startswith(
            "pages/")), names))
    pages = {}
    for name, (sha, body) in zip(names, sums):
        e = listed[name]
        if spans[name][1] != e["bytes"] or sha != e["sha256"]:
            raise BundleError(f"{where}: entry {name}: size or sha256 differs from {HEADER}")
        if name.startswith("pages/"):
            pages[name] = spans[name]
        else:
            data[name] = body
    return Bundle(head, data, pages, fd, where)


def _hash_span(fd: int, off: int, size: int, keep: bool) -> tuple[str, bytearray | None]:
    """sha256 of `size` bytes at `off`, read in pieces into one buffer (the whole entry's
    when `keep`, which is returned, else one piece's, reused)."""
    h = hashlib.sha256()
    buf = bytearray(size if keep else min(size, READ_CHUNK))
    view, done = memoryview(buf), 0
    while done < size:
        n = min(READ_CHUNK, size - done)
        piece = view[done:done + n] if keep else view[:n]
        got = os.preadv(fd, [piece], off + done)
        if got <= 0:
            break  # shrank under us: the sha256 will not match
        h.update(piece[:got])
        done += got
    return h.hexdigest(), (buf if keep else None)
