"""The on-disk checkpoint store (format and protocol: docs/checkpoints.md).

    <root>/secret                               master secret for origin tags (0600)
    <root>/pages/<aa>/<sha256>                  KV pages, content-addressed, shared
    <root>/sessions/<ns>/current                name of the current generation
    <root>/sessions/<ns>/generations/<gen>/     tokens.bin state.bin manifest.json manifest.mac
    <root>/sessions/<ns>/.staging-<gen>/        a generation being written
    <root>/quarantine/<ns16>-<gen>-<reason>/    generations that failed verification

Publish: new pages (each new-file, fsync, rename; then each page directory fsync'd once) and
the staging directory's payloads, manifest (last: it lists every file's size and sha256), its
tag, a directory fsync, one rename into `generations/`, and an atomic replace of `current`. A
crash at any point leaves the previous generation current and whole; a generation directory is
never partial.

Throughput: hashing, page writes and fsyncs, and a load's reads and verification run on a
thread pool (sha256, read, write and fsync release the GIL); a load reads every page into one
preallocated buffer (no per-page bytes objects) and verifies all of them before returning any.

Single writer: the store holds an exclusive flock on <root>/lock while open, and one in-process
lock serialises saves, loads, deletions and page collection (so a collected page is never one a
generation being written or read refers to).
"""
from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from server.checkpoints import quota
from server.checkpoints.files import (Faults, as_parts, fsync_dir, mkdir_synced, mkdirs_synced,
                                      nbytes, publish_file, publish_files, read_file, read_into,
                                      wait_all, write_new)
from server.checkpoints.fingerprint import SCHEMA, differing_fields, fingerprint_digest
from server.checkpoints.tags import (load_master_secret, manifest_tag, principal_digest,
                                     principal_key, session_namespace, tag_ok)

STEPS = ("staging_created", "pages_written", "payload_written", "manifest_written",
         "mac_written", "staging_synced", "renamed", "current_replaced", "pruned")
LOAD_STATES = ("available", "missing", "incompatible", "corrupt")


class StoreBusy(RuntimeError):
    """Another process holds this checkpoint root."""


@dataclass
class SaveInput:
    """One state to save. `pages[i]` is None when `digests[i]` names a page already on disk;
    on success the store fills in every digest (in place). Pages and the state are buffers
    (bytes, memoryview, C-contiguous arrays); the state may be a sequence of buffers (conv,
    rec), written back to back without being joined."""
    tokens: np.ndarray            # int32 [n]
    page_size: int
    pages: list
    digests: list
    state: object                 # the recurrent-state image: conv bytes then rec bytes
    head_response_id: str | None = None


@dataclass
class SaveResult:
    status: str                   # saved | refused
    reason: str | None = None
    generation: str | None = None
    bytes_written: int = 0
    pages_written: int = 0
    pages_reused: int = 0
    evicted: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadResult:
    state: str                    # one of LOAD_STATES
    reason: str
    generation: str | None = None
    tokens: np.ndarray | None = None
    pages: list | None = None     # memoryviews into one buffer, every one verified
    page_digests: list | None = None
    state_bytes: memoryview | None = None
    head_response_id: str | None = None
    bytes_read: int = 0
    staged: object = None         # the page_layout handle the pages were read into, if any
    timings: dict | None = None   # the load's stages, seconds
    differs: list | None = None   # incompatible: the fingerprint fields that differ


class _Corrupt(Exception):
    def __init__(self, reason: str, bad_page: str | None = None, bad_pages=()):
        super().__init__(reason)
        self.reason = reason
        self.bad_pages = ([bad_page] if bad_page else []) + [p for p in bad_pages
                                                            if p != bad_page]


def default_io_threads() -> int:
    return min(32, (os.cpu_count() or 1) + 4)


def _sha256(data) -> str:
    h = hashlib.sha256()
    for v in as_parts(data):
        h.update(v)
    return h.hexdigest()


class CheckpointStore:
    def __init__(self, root: Path, *, quota_bytes: int, faults: Faults | None = None,
                 io_threads: int | None = None):
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.pages_dir = self.root / "pages"
        self.sessions_dir = self.root / "sessions"
        self.quarantine_dir = self.root / "quarantine"
        for d in (self.pages_dir, self.sessions_dir, self.quarantine_dir):
            d.mkdir(mode=0o700, exist_ok=True)
        self._lockf = open(self.root / "lock", "a+")
        try:
            fcntl.flock(self._lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lockf.close()
            raise StoreBusy(f"{self.root} is in use by another process") from None
        self._master = load_master_secret(self.root / "secret")
        self.quota_bytes = quota_bytes
        self.faults = faults or Faults()
        self._lock = threading.RLock()
        self._last_ms = 0
        self._pool = ThreadPoolExecutor(io_threads or default_io_threads(),
                                        thread_name_prefix="ninfer-ckio")
        self.last_timings: dict[str, float] = {}  # the last save's or load's stages, seconds
        with self._lock:
            quota.remove_staging(self)  # no save is in progress: leftovers are abandoned

    def close(self) -> None:
        self._lockf.close()
        self._pool.shutdown(wait=True)

    # ---- names ---------------------------------------------------------------------------
    def session_dir(self, principal: str, session: str) -> Path:
        return self.sessions_dir / session_namespace(principal, session)

    def page_path(self, digest: str) -> Path:
        return self.pages_dir / digest[:2] / digest

    def _new_generation_name(self) -> str:
        self._last_ms = max(int(time.time() * 1000), self._last_ms + 1)
        return f"{self._last_ms:013d}"

    # ---- save ----------------------------------------------------------------------------
    def save(self, principal: str, session: str, inp: SaveInput, fingerprint: dict, *,
             live: frozenset = frozenset(), on_step=None) -> SaveResult:
        """Publish a new generation of (principal, session); refuses (never raises) on a full
        quota, a disk error or a page it was told is on disk but is not."""
        step = on_step or (lambda name: None)
        ns = session_namespace(principal, session)
        t = _Timer()
        digests = list(inp.digests)
        new_pages: dict[str, object] = {}
        tokens = np.ascontiguousarray(inp.tokens, dtype="<i4").tobytes()
        state_len = nbytes(inp.state)
        todo = [i for i, data in enumerate(inp.pages) if data is not None]
        hashed = wait_all([self._pool.submit(_sha256, inp.pages[i]) for i in todo]
                          + [self._pool.submit(_sha256, inp.state)])
        for i, d in zip(todo, hashed):
            digests[i] = d
        file_sha = {"tokens.bin": _sha256(tokens), "state.bin": hashed[-1]}
        t.lap("hash")
        with self._lock:
            sizes = []
            for i, d in enumerate(digests):
                if inp.pages[i] is not None:
                    sizes.append(nbytes(inp.pages[i]))
                    if d not in new_pages and not self.page_path(d).exists():
                        new_pages[d] = inp.pages[i]
                elif d is None or not self.page_path(d).exists():
                    return SaveResult("refused", "page_missing")
                else:
                    sizes.append(self.page_path(d).stat().st_size)
            new_bytes = sum(nbytes(b) for b in new_pages.values())
            need = new_bytes + len(tokens) + state_len + 8192
            try:
                evicted = quota.make_room(self, need, keep=ns, live=live,
                                          fp_digest=fingerprint_digest(fingerprint))
            except quota.QuotaExceeded:
                return SaveResult("refused", "quota")
            t.lap("quota")
            gen = self._new_generation_name()
            staging = self.sessions_dir / ns / f".staging-{gen}"
            try:
                manifest = self._manifest(principal, ns, gen, fingerprint, inp, tokens,
                                          digests, sizes, new_bytes, len(new_pages), file_sha,
                                          state_len)
                self._publish(principal, staging, gen, new_pages, tokens, inp.state, manifest,
                              step, t)
            except OSError as e:
                shutil.rmtree(staging, ignore_errors=True)
                return SaveResult("refused", errno.errorcode.get(e.errno, "io_error").lower())
            quota.prune_superseded(self, ns, gen)
            step("pruned")
            t.lap("prune")
            self.last_timings = t.done()
            inp.digests[:] = digests
            written = new_bytes + len(tokens) + state_len
            return SaveResult("saved", None, gen, written, len(new_pages),
                              len(digests) - len(new_pages), evicted)

    def _publish(self, principal, staging: Path, gen: str, new_pages: dict, tokens: bytes,
                 state, manifest: bytes, step, t=None) -> None:
        """The publish protocol (module docstring); `step(name)` after each step. The new
        pages and the staging payloads are written concurrently on the pool (each file fsync'd
        before it is renamed or referenced); the manifest is written only after every one of
        them (and every page directory) is durable."""
        t = t or _Timer()
        sdir = staging.parent
        mkdir_synced(sdir / "generations")
        staging.mkdir(mode=0o700)
        fsync_dir(sdir)
        step("staging_created")
        mkdirs_synced({self.page_path(d).parent for d in new_pages}, self._pool)
        payload = [self._pool.submit(write_new, staging / "tokens.bin", tokens, self.faults),
                   self._pool.submit(write_new, staging / "state.bin", state, self.faults)]
        try:
            publish_files([(self.page_path(d), data) for d, data in new_pages.items()],
                          self.faults, self._pool)
        except BaseException:
            for f in payload:  # no task may still be writing when the caller cleans up
                f.exception()
            raise
        t.lap("pages")
        step("pages_written")
        wait_all(payload)
        t.lap("payload")
        step("payload_written")
        write_new(staging / "manifest.json", manifest, self.faults)
        step("manifest_written")
        tag = manifest_tag(principal_key(self._master, principal), manifest)
        write_new(staging / "manifest.mac", (tag + "\n").encode(), self.faults)
        step("mac_written")
        fsync_dir(staging)
        step("staging_synced")
        os.rename(staging, sdir / "generations" / gen)
        fsync_dir(sdir / "generations")
        step("renamed")
        publish_file(sdir / "current", (gen + "\n").encode())
        step("current_replaced")
        t.lap("manifest_and_publish")

    def _manifest(self, principal, ns, gen, fingerprint, inp, tokens, digests, sizes,
                  new_bytes, new_count, file_sha, state_len) -> bytes:
        files = [{"path": "tokens.bin", "bytes": len(tokens), "sha256": file_sha["tokens.bin"]},
                 {"path": "state.bin", "bytes": state_len, "sha256": file_sha["state.bin"]}]
        body = {
            "type": "ninfer.checkpoint", "schema": SCHEMA,
            "principal": principal_digest(principal), "session": ns, "generation": gen,
            "created_at": round(time.time(), 3),
            "fingerprint": fingerprint, "fingerprint_sha256": fingerprint_digest(fingerprint),
            "head_response_id": inp.head_response_id,
            "frontier_tokens": int(len(tokens) // 4), "page_size": inp.page_size,
            "files": files,
            "pages": [{"sha256": d, "bytes": s} for d, s in zip(digests, sizes)],
            "payload_bytes": sum(f["bytes"] for f in files) + sum(sizes),
            "bytes_written": new_bytes + len(tokens) + state_len,
            "pages_written": new_count,
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    # ---- load ----------------------------------------------------------------------------
    def load(self, principal: str, session: str, fingerprint: dict,
             prompt_ids=None, page_layout=None) -> LoadResult:
        """The newest generation of (principal, session) made by this runtime whose tokens
        are a strict prefix of `prompt_ids` (any, if None), verified end to end. A generation
        failing verification is quarantined and reported `corrupt`.

        `page_layout(n_pages, page_bytes)`, when given, returns (handle, views) where views[i]
        are the writable buffers page i's bytes go to, in order (so a page is read straight
        into the engine's staging layout), or None for the default. The result then carries
        the handle as `staged` and `pages` are those per-page view lists. Either way a view is
        filled from the file and verified before the result says `available`; after a
        failure its contents mean nothing."""
        ns = session_namespace(principal, session)
        sdir = self.sessions_dir / ns
        fp = fingerprint_digest(fingerprint)
        prompt = None if prompt_ids is None else np.asarray(prompt_ids, np.int32)
        with self._lock:
            order = quota.generations_newest_first(sdir)
            if not order:
                return LoadResult("missing", "no_checkpoint")
            seen_other_fp = not_prefix = False
            differs = None  # of the newest generation of another fingerprint
            for gen in order:
                gdir = sdir / "generations" / gen
                try:
                    res = self._load_generation(principal, ns, gdir, fp, prompt, page_layout)
                except _Corrupt as c:
                    self.quarantine(sdir, gen, c.reason, bad_pages=c.bad_pages)
                    return LoadResult("corrupt", c.reason, gen)
                if isinstance(res, tuple):  # ("incompatible", its fingerprint)
                    seen_other_fp = True
                    if differs is None:
                        differs = differing_fields(res[1], fingerprint)
                elif res == "not_prefix":
                    not_prefix = True
                else:
                    os.utime(gdir)  # last use, for the quota's eviction order
                    return res
            if seen_other_fp and not not_prefix:
                return LoadResult("incompatible", "fingerprint_mismatch", differs=differs)
            return LoadResult("missing", "not_prefix" if not_prefix else "no_checkpoint")

    def _load_generation(self, principal, ns, gdir: Path, fp: str, prompt, page_layout=None):
        t = _Timer()
        try:
            mbytes = read_file(gdir / "manifest.json")
            tag = read_file(gdir / "manifest.mac").decode("ascii", "replace")
        except FileNotFoundError:
            raise _Corrupt("manifest_missing") from None
        if not tag_ok(principal_key(self._master, principal), mbytes, tag):
            raise _Corrupt("tag_invalid")
        try:
            m = json.loads(mbytes)
            if (m["type"] != "ninfer.checkpoint" or m["principal"] != principal_digest(principal)
                    or m["session"] != ns or m["generation"] != gdir.name):
                raise _Corrupt("owner_mismatch")
            if m["fingerprint_sha256"] != fp:
                return ("incompatible", m.get("fingerprint") or {})
            files = {f["path"]: f for f in m["files"]}
            tokens_b = self._verified(gdir / "tokens.bin", files["tokens.bin"])
            tokens = np.frombuffer(tokens_b, "<i4").astype(np.int32)
            n = tokens.shape[0]
            if n != m["frontier_tokens"] or len(m["pages"]) != -(-n // m["page_size"]):
                raise _Corrupt("manifest_inconsistent")
            if prompt is not None and not (n < prompt.shape[0]
                                           and np.array_equal(prompt[:n], tokens)):
                return "not_prefix"
            t.lap("manifest_and_tokens")
            entries = [files["state.bin"]] + list(m["pages"])
            paths = [gdir / "state.bin"] + [self.page_path(p["sha256"]) for p in m["pages"]]
            sizes = [int(e["bytes"]) for e in entries]
            digests = [str(e["sha256"]) for e in entries]
            if min(sizes) < 0:
                raise _Corrupt("manifest_invalid")
        except (KeyError, TypeError, ValueError):
            raise _Corrupt("manifest_invalid") from None
        # every page and the image, read into preallocated buffers and verified on the pool:
        # nothing is returned (or installed) unless all of them match the manifest
        staged = None
        laid = None
        if page_layout is not None and len(sizes) > 1 and len(set(sizes[1:])) == 1:
            laid = page_layout(len(sizes) - 1, sizes[1])
        if laid is not None:
            staged, page_views = laid
            views = [memoryview(np.empty(sizes[0], np.uint8)).cast("B")] + list(page_views)
        else:
            buf = memoryview(np.empty(sum(sizes), np.uint8)).cast("B")
            views, off = [], 0
            for size in sizes:
                views.append(buf[off:off + size])
                off += size
        t.lap("alloc")
        # a handle that takes page reports (StagedPages.page_ready) hears of each page as soon
        # as it verified: its host-to-device transfers start while later pages are read
        ready = getattr(staged, "page_ready", None)
        done = [None] + [None if ready is None else functools.partial(ready, i)
                         for i in range(len(paths) - 1)]
        checks = wait_all([self._pool.submit(_read_verify, path, view, digest, then)
                           for path, view, digest, then in zip(paths, views, digests, done)])
        t.lap("read_verify")
        bad = [i for i, c in enumerate(checks) if c is not None]
        if bad:
            i = bad[0]  # the first failure in file order names the reason
            wrong = [digests[j] for j in bad if j > 0 and checks[j] == "hash_mismatch"]
            raise _Corrupt(f"{checks[i]}:{paths[i].name[:16]}", bad_pages=wrong)
        self.last_timings = t.done()
        return LoadResult("available", "restored", gdir.name, tokens, views[1:],
                          digests[1:], views[0], m["head_response_id"],
                          len(tokens_b) + sum(sizes), staged, dict(self.last_timings))

    @staticmethod
    def _verified(path: Path, entry: dict, bad_page: str | None = None) -> bytes:
        try:
            data = read_file(path)
        except FileNotFoundError:
            raise _Corrupt(f"missing:{path.name[:16]}", None) from None
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise _Corrupt(f"hash_mismatch:{path.name[:16]}", bad_page)
        return data

    def quarantine(self, sdir: Path, gen: str, reason: str, bad_page: str | None = None,
                   bad_pages=()) -> None:
        """Move a generation that failed verification out of the way (kept for inspection,
        first to go under quota pressure); pages whose bytes are wrong are deleted so the next
        save writes them again."""
        src = sdir / "generations" / gen
        dst = self.quarantine_dir / f"{sdir.name[:16]}-{gen}-{reason.split(':')[0]}"
        if src.exists():
            os.rename(src, dst)
            fsync_dir(src.parent)
            fsync_dir(self.quarantine_dir)
        for page in ([bad_page] if bad_page else []) + list(bad_pages):
            self.page_path(page).unlink(missing_ok=True)
        quota.repoint_current(sdir)

    # ---- deletion --------------------------------------------------------------------------
    def purge(self, principal: str, session: str) -> int:
        """Delete every generation of the session and the pages no one else references."""
        sdir = self.sessions_dir / session_namespace(principal, session)
        with self._lock:
            n = len(quota.generations_newest_first(sdir))
            if sdir.exists():
                shutil.rmtree(sdir)
                fsync_dir(self.sessions_dir)
            for name in os.listdir(self.quarantine_dir):  # quarantined copies hold it too
                if name.startswith(sdir.name[:16] + "-"):
                    shutil.rmtree(self.quarantine_dir / name)
            quota.collect_pages(self)
            return n

    def drop_response(self, principal: str, session: str, response_id: str) -> int:
        """Delete the generations whose state follows `response_id` (it was deleted)."""
        sdir = self.sessions_dir / session_namespace(principal, session)
        with self._lock:
            gone = 0
            for gen in quota.generations_newest_first(sdir):
                m = quota.read_manifest(sdir / "generations" / gen)
                if m is not None and m.get("head_response_id") == response_id:
                    shutil.rmtree(sdir / "generations" / gen)
                    gone += 1
            for name in os.listdir(self.quarantine_dir):
                m = quota.read_manifest(self.quarantine_dir / name)
                if name.startswith(sdir.name[:16] + "-") and (
                        m is None or m.get("head_response_id") == response_id):
                    shutil.rmtree(self.quarantine_dir / name)  # unreadable: may hold it
            if gone:
                fsync_dir(sdir / "generations")
                quota.repoint_current(sdir)
                quota.collect_pages(self)
            return gone

    def stats(self) -> dict:
        with self._lock:
            return quota.usage_stats(self)


def _read_verify(path: Path, view, digest: str, then=None) -> str | None:
    """Read `path` into `view` (a buffer, or a list of buffers filled in order) and check its
    sha256: None, "missing" or "hash_mismatch". `then()` runs after a match."""
    views = view if isinstance(view, list) else [view]
    try:
        ok = read_into(path, views)
    except FileNotFoundError:
        return "missing"
    if not ok:
        return "hash_mismatch"
    h = hashlib.sha256()
    for v in views:
        h.update(v)
    if h.hexdigest() != digest:
        return "hash_mismatch"
    if then is not None:
        then()
    return None


class _Timer:
    """Stage durations of one save or load (CheckpointStore.last_timings)."""

    def __init__(self):
        self.t0 = self.t = time.perf_counter()
        self.stages: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = self.stages.get(name, 0.0) + now - self.t
        self.t = now

    def done(self) -> dict[str, float]:
        self.stages["total"] = time.perf_counter() - self.t0
        return self.stages
