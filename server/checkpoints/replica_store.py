"""The replica directory: where `./ninfer checkpoints replica serve` keeps the sessions pushed
to it (a local disk or a mounted share; never a live checkpoint root).

    objects/<sha256[:2]>/<sha256>   every object a manifest lists: pages, state images, tokens,
                                    stored responses, named by their content's sha256
    sessions/<namespace>/manifest   the session's newest manifest: bundle.mac's hex tag, a
                                    newline, then bundle.json's bytes

A replica holds no secret of its own and never re-tags anything: a manifest is the bundle
header that the pushing server signed with the transfer key, kept byte for byte, so `pull`
rebuilds the very bundle that `export` would have written and hands it to `import`, which
verifies it again and tags it under the receiving state directory's secret. The replica needs
the transfer key only to verify what it accepts.

Writes follow the store's publish protocol: an object is verified in memory (its sha256 and
size against the verified manifest), then written under a temporary name, fsync'd, renamed and
its directory fsync'd; the manifest is published the same way, last, only once every object
it lists is in place. A push that dies leaves at most verified objects no manifest names yet
(the next push does not send them again), never a visible half of a session.

Collection, after each publish: an object goes when no session's manifest lists it and no push
or pull in flight relies on it (`holding`), at once if the manifest just replaced listed it (a
superseded state image, tokens, responses, a partial last page), else once it is ORPHAN_GRACE_S
old (what a push that died left: kept that long so that the push can resume without sending
it again). One service per replica directory: another process's pushes are not seen.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from pathlib import Path

from server.checkpoints.bundle import BundleError, verify_header
from server.checkpoints.files import fsync_dir, mkdir_synced, publish_file, read_file
from server.checkpoints.tags import session_namespace

MANIFEST = "manifest"
ORPHAN_GRACE_S = 24 * 3600.0  # an object no manifest lists, kept for a push to resume
_NEEDED = ("checkpoint/tokens.bin", "checkpoint/state.bin", "responses.json")


def where_of(principal: str, session: str) -> str:
    return f"manifest of session {session!r} (principal {principal!r})"


def check_manifest(key: bytes, head_b: bytes, mac: str, where: str) -> dict:
    """The manifest parsed, once its tag verifies under the transfer key and its entries agree
    with its checkpoint (BundleError naming `where` and the entry otherwise)."""
    head = verify_header(key, head_b, mac, where)
    listed = {e["path"]: e for e in head["entries"]}
    if len(listed) != len(head["entries"]):
        raise BundleError(f"{where}: an entry is listed twice")
    for name in _NEEDED:
        if name not in listed:
            raise BundleError(f"{where}: entry {name} is not listed")
    try:
        pages = head["checkpoint"]["pages"]
        for d in pages:
            if f"pages/{d}" not in listed:
                raise BundleError(f"{where}: page {str(d)[:16]} is not listed")
    except (KeyError, TypeError) as e:
        raise BundleError(f"{where}: bundle.json checkpoint is malformed ({e})") from None
    for name, e in listed.items():
        if name.startswith("pages/") and name[6:] != e["sha256"]:
            raise BundleError(f"{where}: entry {name} is listed with another sha256")
    return head


def objects_of(head: dict) -> list[dict]:
    """The manifest's objects, one per digest, in its order: {path, bytes, sha256}."""
    seen, out = set(), []
    for e in head["entries"]:
        if e["sha256"] not in seen:
            seen.add(e["sha256"])
            out.append(e)
    return out


class ReplicaDir:
    """A replica directory, and what its service received since it started."""

    def __init__(self, root: Path, key: bytes):
        self.root, self.key = Path(root), key
        for d in (self.root, self.root / "objects", self.root / "sessions"):
            mkdir_synced(d)
        self._lock = threading.Lock()
        self.received: dict[str, int] = {}  # digest -> times received (complete, verified)
        self.bytes_received = 0
        self._holds: dict[int, frozenset] = {}  # pushes and pulls in flight: their digests
        self.collected = 0  # objects deleted by collection

    def object_path(self, sha: str) -> Path:
        return self.root / "objects" / sha[:2] / sha

    def session_dir(self, principal: str, session: str) -> Path:
        return self.root / "sessions" / session_namespace(principal, session)

    def missing(self, head: dict) -> list[str]:
        """The digests of the manifest's objects this directory lacks (or holds at another
        size: a file that is not the object is replaced)."""
        out = []
        for e in objects_of(head):
            p = self.object_path(e["sha256"])
            try:
                if p.stat().st_size == int(e["bytes"]) and not p.is_symlink():
                    continue
            except FileNotFoundError:
                pass
            out.append(e["sha256"])
        return out

    def put(self, entry: dict, data: bytes, where: str) -> int:
        """Store one object of a verified manifest after checking its bytes; returns how
        many objects this service has received."""
        name = entry["path"]
        if len(data) != int(entry["bytes"]):
            raise BundleError(f"{where}: entry {name}: {len(data)} bytes received, "
                              f"{entry['bytes']} listed (truncated stream?)")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise BundleError(f"{where}: entry {name}: sha256 differs from bundle.json "
                              "(altered in transit?)")
        path = self.object_path(entry["sha256"])
        mkdir_synced(path.parent)
        publish_file(path, data)
        with self._lock:
            self.received[entry["sha256"]] = self.received.get(entry["sha256"], 0) + 1
            self.bytes_received += len(data)
            return sum(self.received.values())

    @contextlib.contextmanager
    def holding(self, head: dict):
        """While in it, no object of `head` is collected (a push or pull in flight). Enter it
        before asking which objects are `missing`."""
        token = object()
        with self._lock:
            self._holds[id(token)] = frozenset(e["sha256"] for e in objects_of(head))
        try:
            yield
        finally:
            with self._lock:
                del self._holds[id(token)]

    def publish(self, head: dict, head_b: bytes, mac: str, where: str) -> Path:
        """Publish the manifest, once every object it lists is in place; then collect."""
        lacking = self.missing(head)
        if lacking:
            raise BundleError(f"{where}: {len(lacking)} object(s) not received, e.g. "
                              f"{lacking[0][:16]}; nothing published")
        sdir = self.session_dir(head["principal"], head["session"])
        mkdir_synced(sdir)
        old = self._listed(sdir / MANIFEST)
        publish_file(sdir / MANIFEST, mac.strip().encode() + b"\n" + head_b)
        self.collect(old)
        return sdir

    @staticmethod
    def _listed(manifest: Path) -> set[str] | None:
        """The digests a published manifest lists (it was verified when published); None
        when it is unreadable (then nothing may be collected)."""
        try:
            head = json.loads(read_file(manifest).partition(b"\n")[2])
            return {e["sha256"] for e in head["entries"]}
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def collect(self, superseded=frozenset(), now: float | None = None) -> int:
        """Delete the objects no manifest lists and nothing in flight holds: `superseded` ones
        at once, the rest once ORPHAN_GRACE_S old. Returns how many went."""
        now = time.time() if now is None else now
        listed: set[str] = set()
        for ns in _listdir(self.root / "sessions"):
            got = self._listed(self.root / "sessions" / ns / MANIFEST)
            if got is None:
                return 0  # a manifest we cannot read: keep everything it might list
            listed |= got
        superseded = set(superseded or ())
        gone, dirs = 0, set()
        with self._lock:  # no hold can start (nor `missing` be asked) while objects go
            held = set().union(*self._holds.values()) if self._holds else set()
            for sub in _listdir(self.root / "objects"):
                for name in _listdir(self.root / "objects" / sub):
                    if name in listed or name in held:
                        continue
                    path = self.root / "objects" / sub / name
                    try:
                        if name not in superseded and now - path.stat().st_mtime < ORPHAN_GRACE_S:
                            continue
                        path.unlink()
                    except FileNotFoundError:
                        continue
                    gone, _ = gone + 1, dirs.add(path.parent)
            self.collected += gone
        for d in dirs:
            fsync_dir(d)
        return gone

    def read_manifest(self, principal: str, session: str) -> tuple[bytes, str]:
        """(bundle.json's bytes, bundle.mac's tag) of the session; FileNotFoundError when
        the replica has none."""
        raw = read_file(self.session_dir(principal, session) / MANIFEST)
        mac, _, head_b = raw.partition(b"\n")
        return head_b, mac.decode("ascii", "replace")

    def stats(self) -> dict:
        with self._lock:
            return {"objects_received": sum(self.received.values()),
                    "distinct_objects": len(self.received), "objects_collected": self.collected,
                    "bytes_received": self.bytes_received,
                    "received_twice": sorted(d for d, n in self.received.items() if n > 1)}


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []


def dump_stats(replica: ReplicaDir, path: Path) -> None:
    publish_file(path, json.dumps(replica.stats(), sort_keys=True).encode())
