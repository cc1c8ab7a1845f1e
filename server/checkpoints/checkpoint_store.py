"""The on-disk checkpoint store (format and protocol: docs/checkpoints.md).

    <root>/secret                               master secret for origin tags (0600)
    <root>/pages/<aa>/<sha256>                  KV pages, content-addressed, shared
    <root>/sessions/<ns>/current                name of the current generation
    <root>/sessions/<ns>/generations/<gen>/     tokens.bin state.bin manifest.json manifest.mac
    <root>/sessions/<ns>/.staging-<gen>/        a generation being written
    <root>/quarantine/<ns16>-<gen>-<reason>/    generations that failed verification

Publish (`publish.py`): new pages (each new-file, fsync, rename; then each page directory
fsync'd once) and the staging directory's payloads, manifest (last: it lists every file's size
and sha256), its tag, a directory fsync, one rename into `generations/`, and an atomic replace of
`current`. A crash at any point leaves the previous generation current and whole; a generation
directory is never partial.

Throughput: hashing, page writes and fsyncs, and a load's reads and verification (`verify.py`)
run on a thread pool (sha256, read, write and fsync release the GIL); a load reads every page
into one preallocated, page-aligned buffer (no per-page bytes objects; O_DIRECT where the
filesystem takes it, files.py) and verifies all of them before returning any.

Single writer: the store holds an exclusive flock on <root>/lock while open, and one in-process
lock serialises saves, loads, deletions and page collection (so a collected page is never one a
generation being written or read refers to).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from server.checkpoints import quota
from server.checkpoints.files import (Faults, fsync_dir, mkdirs_synced, nbytes, publish_files,
                                      wait_all)
from server.checkpoints.fingerprint import differing_fields, fingerprint_digest
from server.checkpoints.publish import (SaveInput, SaveResult, manifest_bytes,
                                        publish_generation, sha256_parts)
from server.checkpoints.status import SessionStatus
from server.checkpoints.tags import load_master_secret, principal_key, session_namespace
from server.checkpoints.verify import Corrupt, LoadResult, read_generation


class StoreBusy(RuntimeError):
    """Another process holds this checkpoint root."""


def default_io_threads() -> int:
    return min(32, (os.cpu_count() or 1) + 4)


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
        self.io_threads = io_threads or default_io_threads()
        self.io_pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="ninfer-ckio")
        self.last_timings: dict[str, float] = {}  # the last save's or load's stages, seconds
        self.pending_pages: set[str] = set()  # written by save_streamed, not yet listed
        with self._lock:
            quota.remove_staging(self)  # no save is in progress: leftovers are abandoned

    def close(self) -> None:
        self._lockf.close()
        self.io_pool.shutdown(wait=True)

    # ---- names ---------------------------------------------------------------------------
    def session_dir(self, principal: str, session: str) -> Path:
        return self.sessions_dir / session_namespace(principal, session)

    def page_path(self, digest: str) -> Path:
        return self.pages_dir / digest[:2] / digest

    def tag_key(self, principal: str) -> bytes:
        """The key of `principal`'s manifest tags (derived from the master secret)."""
        return principal_key(self._master, principal)

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
        t = StageTimer()
        digests = list(inp.digests)
        new_pages: dict[str, object] = {}
        tokens = np.ascontiguousarray(inp.tokens, dtype="<i4").tobytes()
        state_len = nbytes(inp.state)
        todo = [i for i, data in enumerate(inp.pages) if data is not None]
        hashed = wait_all([self.io_pool.submit(sha256_parts, inp.pages[i]) for i in todo]
                          + [self.io_pool.submit(sha256_parts, inp.state)])
        for i, d in zip(todo, hashed):
            digests[i] = d
        file_sha = {"tokens.bin": sha256_parts(tokens), "state.bin": hashed[-1]}
        t.lap("hash")
        with self._lock:
            sizes = []
            for i, d in enumerate(digests):
                if inp.pages[i] is not None:
                    sizes.append(nbytes(inp.pages[i]))
                    if d not in new_pages and not self.page_path(d).exists():
                        new_pages[d] = inp.pages[i]
                elif d is None or not self.page_path(d).exists():
                    return SaveResult(SessionStatus.REFUSED, "page_missing")
                else:
                    sizes.append(self.page_path(d).stat().st_size)
            new_bytes = sum(nbytes(b) for b in new_pages.values())
            need = new_bytes + len(tokens) + state_len + 8192
            try:
                evicted = quota.make_room(self, need, keep=ns, live=live,
                                          fp_digest=fingerprint_digest(fingerprint))
            except quota.QuotaExceeded:
                return SaveResult(SessionStatus.REFUSED, "quota")
            t.lap("quota")
            gen = self._new_generation_name()
            staging = self.sessions_dir / ns / f".staging-{gen}"
            try:
                manifest = manifest_bytes(principal, ns, gen, fingerprint, inp, tokens,
                                          digests, sizes, new_bytes, len(new_pages), file_sha,
                                          state_len)
                publish_generation(self, principal, staging, gen, new_pages, tokens,
                                   inp.state, manifest, step, t)
            except OSError as e:
                shutil.rmtree(staging, ignore_errors=True)
                reason = errno.errorcode.get(e.errno, "io_error").lower()
                return SaveResult(SessionStatus.REFUSED, reason)
            quota.prune_superseded(self, ns, gen)
            step("pruned")
            t.lap("prune")
            self.last_timings = t.done()
            inp.digests[:] = digests
            written = new_bytes + len(tokens) + state_len
            return SaveResult(SessionStatus.SAVED, None, gen, written, len(new_pages),
                              len(digests) - len(new_pages), evicted)

    def save_streamed(self, principal: str, session: str, inp: SaveInput, fingerprint: dict,
                      read_page, page_size) -> SaveResult:
        """`save` of a state whose pages come one at a time from `read_page(digest, buf)`
        (an import from a bundle: never all in memory; the page read into `buf`, a buffer of
        at least `page_size(digest)` bytes reused from one page to the next).
        `inp.pages` are all None and `inp.digests` all given. Under the store's lock: room for
        every byte made first (the quota's order), then each page not on disk read, checked
        against its digest and written (content-addressed, kept from collection until the
        generation lists it; a failure leaves only pages no manifest lists, collected later),
        a few at a time, then the generation published by `save`. Refuses like `save`; a page
        whose bytes are not its digest raises (the bundle changed while it was imported)."""
        with self._lock:
            todo = [d for d in dict.fromkeys(inp.digests) if not self.page_path(d).exists()]
            need = (sum(page_size(d) for d in todo) + 4 * len(inp.tokens)
                    + nbytes(inp.state) + 8192)
            try:
                quota.make_room(self, need, keep=session_namespace(principal, session),
                                live=frozenset(), fp_digest=fingerprint_digest(fingerprint))
            except quota.QuotaExceeded:
                return SaveResult(SessionStatus.REFUSED, "quota")
            self.pending_pages = set(todo)
            try:
                mkdirs_synced({self.page_path(d).parent for d in todo}, self.io_pool)
                bufs = [bytearray(max(map(page_size, todo), default=0))
                        for _ in range(min(self.io_threads, len(todo)))]  # reused, window by window
                for start in range(0, len(todo), len(bufs) or 1):
                    part = todo[start:start + len(bufs)]
                    data = wait_all([self.io_pool.submit(_checked, d, read_page, buf)
                                     for d, buf in zip(part, bufs)])
                    publish_files([(self.page_path(d), x) for d, x in zip(part, data)],
                                  self.faults, self.io_pool)
                res = self.save(principal, session, inp, fingerprint)
            except OSError as e:  # as save: a full disk or an I/O error refuses, never raises
                return SaveResult(SessionStatus.REFUSED,
                                  errno.errorcode.get(e.errno, "io_error").lower())
            finally:
                self.pending_pages = set()
            if res.status == SessionStatus.SAVED:  # the pages written here count as written
                res.pages_written += len(todo)
                res.pages_reused -= len(todo)
                res.bytes_written += sum(map(page_size, todo))
            return res

    # ---- load ----------------------------------------------------------------------------
    def load(self, principal: str, session: str, fingerprint: dict,
             prompt_ids=None, page_layout=None) -> LoadResult:
        """The newest generation of (principal, session) made by this runtime whose tokens
        are a strict prefix of `prompt_ids` (any, if None), verified end to end. A generation
        failing verification is quarantined and reported CORRUPT.

        `page_layout(n_pages, page_bytes)`, when given, returns (handle, views) where views[i]
        are the writable buffers page i's bytes go to, in order (so a page is read straight
        into the engine's staging layout), or None for the default. The result then carries
        the handle as `staged` and `pages` are those per-page view lists. Either way a view is
        filled from the file and verified before the result says AVAILABLE; after a
        failure its contents mean nothing."""
        ns = session_namespace(principal, session)
        sdir = self.sessions_dir / ns
        fp = fingerprint_digest(fingerprint)
        prompt = None if prompt_ids is None else np.asarray(prompt_ids, np.int32)
        with self._lock:
            order = quota.generations_newest_first(sdir)
            if not order:
                return LoadResult(SessionStatus.MISSING, "no_checkpoint")
            seen_other_fp = not_prefix = False
            differs = None  # of the newest generation of another fingerprint
            for gen in order:
                gdir = sdir / "generations" / gen
                t = StageTimer()
                try:
                    res = read_generation(self, principal, ns, gdir, fp, prompt, page_layout, t)
                except Corrupt as c:
                    self.quarantine(sdir, gen, c.reason, bad_pages=c.bad_pages)
                    return LoadResult(SessionStatus.CORRUPT, c.reason, gen)
                if isinstance(res, tuple):  # (INCOMPATIBLE, its fingerprint)
                    seen_other_fp = True
                    if differs is None:
                        differs = differing_fields(res[1], fingerprint)
                elif res == "not_prefix":
                    not_prefix = True
                else:
                    self.last_timings = t.done()
                    res.timings = dict(self.last_timings)
                    os.utime(gdir)  # last use, for the quota's eviction order
                    return res
            if seen_other_fp and not not_prefix:
                return LoadResult(SessionStatus.INCOMPATIBLE, "fingerprint_mismatch",
                                  differs=differs)
            return LoadResult(SessionStatus.MISSING,
                              "not_prefix" if not_prefix else "no_checkpoint")

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


class StageTimer:
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


def _checked(digest: str, read_page, buf):
    data = read_page(digest, buf)
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"page {digest[:16]}: its bytes are not its digest")
    return data
