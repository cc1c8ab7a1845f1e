"""The read side of the checkpoint store: one generation read and verified end to end (its
tag, owner, fingerprint, manifest, and every page's and payload's sha256) before any of it is
returned. Called by `CheckpointStore.load` under the store's lock; the reads run on its pool.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from server.checkpoints.files import (DIRECT_ALIGN, aligned_bytes, read_file, read_into,
                                      wait_all)
from server.checkpoints.status import SessionStatus
from server.checkpoints.tags import principal_digest, tag_ok


@dataclass
class LoadResult:
    state: SessionStatus          # one of LOAD_STATES
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


class Corrupt(Exception):
    """A generation that failed verification; `bad_pages` are pages whose bytes are wrong."""

    def __init__(self, reason: str, bad_page: str | None = None, bad_pages=()):
        super().__init__(reason)
        self.reason = reason
        self.bad_pages = ([bad_page] if bad_page else []) + [p for p in bad_pages
                                                            if p != bad_page]


def read_generation(store, principal, ns, gdir: Path, fp: str, prompt, page_layout, t):
    """The generation at `gdir`, verified: a LoadResult (AVAILABLE, its `timings` left to the
    caller), (INCOMPATIBLE, its fingerprint), or "not_prefix" when its tokens are not a
    strict prefix of `prompt`. Raises Corrupt. `t.lap(stage)` after each stage."""
    try:
        mbytes = read_file(gdir / "manifest.json")
        tag = read_file(gdir / "manifest.mac").decode("ascii", "replace")
    except FileNotFoundError:
        raise Corrupt("manifest_missing") from None
    if not tag_ok(store.tag_key(principal), mbytes, tag):
        raise Corrupt("tag_invalid")
    try:
        m = json.loads(mbytes)
        if (m["type"] != "ninfer.checkpoint" or m["principal"] != principal_digest(principal)
                or m["session"] != ns or m["generation"] != gdir.name):
            raise Corrupt("owner_mismatch")
        if m["fingerprint_sha256"] != fp:
            return (SessionStatus.INCOMPATIBLE, m.get("fingerprint") or {})
        files = {f["path"]: f for f in m["files"]}
        tokens_b = _verified(gdir / "tokens.bin", files["tokens.bin"])
        tokens = np.frombuffer(tokens_b, "<i4").astype(np.int32)
        n = tokens.shape[0]
        if n != m["frontier_tokens"] or len(m["pages"]) != -(-n // m["page_size"]):
            raise Corrupt("manifest_inconsistent")
        if prompt is not None and not (n < prompt.shape[0]
                                       and np.array_equal(prompt[:n], tokens)):
            return "not_prefix"
        t.lap("manifest_and_tokens")
        entries = [files["state.bin"]] + list(m["pages"])
        paths = [gdir / "state.bin"] + [store.page_path(p["sha256"]) for p in m["pages"]]
        sizes = [int(e["bytes"]) for e in entries]
        digests = [str(e["sha256"]) for e in entries]
        if min(sizes) < 0:
            raise Corrupt("manifest_invalid")
    except (KeyError, TypeError, ValueError):
        raise Corrupt("manifest_invalid") from None
    # every page and the image, read into preallocated buffers and verified on the pool:
    # nothing is returned (or installed) unless all of them match the manifest
    staged = None
    laid = None
    if page_layout is not None and len(sizes) > 1 and len(set(sizes[1:])) == 1:
        head = memoryview(aligned_bytes(sizes[0])).cast("B")
        laid = page_layout(len(sizes) - 1, sizes[1])  # may hold bounded memory: try below
    # page-aligned buffers, each file's at an aligned offset: the reads can be O_DIRECT
    if laid is not None:
        staged, page_views = laid
        views = [head] + list(page_views)
    else:
        starts = np.cumsum([0] + [-(-s // DIRECT_ALIGN) * DIRECT_ALIGN for s in sizes])
        buf = memoryview(aligned_bytes(int(starts[-1]))).cast("B")
        views = [buf[int(o):int(o) + size] for o, size in zip(starts, sizes)]
    t.lap("alloc")
    # a handle that takes page reports (StagedPages.page_ready) hears of each page as soon
    # as it verified: its host-to-device transfers start while later pages are read. One
    # that streams through bounded memory hands out page views lazily and is told of a
    # failed read at once (`abandon`: readers waiting for room give up) and, once every read
    # is over, that the load failed (`abort`: the room is freed).
    ready = getattr(staged, "page_ready", None)
    abandon, abort = getattr(staged, "abandon", None), getattr(staged, "abort", None)
    done = [None] + [None if ready is None else functools.partial(ready, i)
                     for i in range(len(paths) - 1)]
    try:  # a failed read abandons (waiting readers give up); once all are over, abort
        checks = wait_all([store.io_pool.submit(_read_verify, path, view, digest, then,
                                                abandon)
                           for path, view, digest, then in zip(paths, views, digests, done)])
    except BaseException:
        if abort is not None:
            abort()
        raise
    t.lap("read_verify")
    bad = [i for i, c in enumerate(checks) if c is not None]
    if bad:
        if abort is not None:
            abort()
        real = [j for j in bad if checks[j] != "aborted"]
        if not real:  # the handle gave up (a failed device transfer), not the files
            raise RuntimeError(f"staging the pages failed: {getattr(staged, 'error', None)!r}")
        i = real[0]  # the first failure in file order names the reason
        wrong = [digests[j] for j in bad if j > 0 and checks[j] == "hash_mismatch"]
        raise Corrupt(f"{checks[i]}:{paths[i].name[:16]}", bad_pages=wrong)
    return LoadResult(SessionStatus.AVAILABLE, SessionStatus.RESTORED, gdir.name, tokens,
                      views[1:], digests[1:], views[0], m["head_response_id"],
                      len(tokens_b) + sum(sizes), staged)


def _verified(path: Path, entry: dict, bad_page: str | None = None) -> bytes:
    try:
        data = read_file(path)
    except FileNotFoundError:
        raise Corrupt(f"missing:{path.name[:16]}", None) from None
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise Corrupt(f"hash_mismatch:{path.name[:16]}", bad_page)
    return data


def _read_verify(path: Path, view, digest: str, then=None, fail=None) -> str | None:
    """Read `path` into `view` (a buffer, a list of buffers filled in order, or a callable
    giving that list, or None when the load was abandoned) and check its sha256: None,
    "missing", "hash_mismatch" or "aborted". `then()` runs after a match; `fail()` after
    anything else, an exception included."""
    try:
        status = _read_check(path, view, digest)
    except BaseException:
        if fail is not None:
            fail()
        raise
    if status is None and then is not None:
        then()
    elif status is not None and fail is not None:
        fail()
    return status


def _read_check(path: Path, view, digest: str) -> str | None:
    if callable(view):
        view = view()
        if view is None:
            return "aborted"
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
    return None
