"""Quota, eviction order and page collection for the checkpoint store (called under its lock).

Eviction order, first to last (docs/checkpoints.md):
  1. abandoned staging directories and quarantined generations;
  2. superseded generations (not the newest of their session for their fingerprint);
  3. generations of other runtime fingerprints, oldest first (kept until then for a rollback);
  4. current generations of sessions not active in this process, least recently used first;
  5. current generations of other active sessions, least recently used first.
The session being saved is never evicted to make room for itself. After each eviction the
pages no manifest references any more are deleted; if the quota still cannot hold the new
generation, the save is refused and nothing else changes.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from server.checkpoints.files import fsync_dir, publish_file, tree_bytes


class QuotaExceeded(Exception):
    pass


def read_manifest(gdir: Path) -> dict | None:
    """The manifest as JSON, unverified: for bookkeeping only (never for restoring)."""
    try:
        return json.loads((gdir / "manifest.json").read_bytes())
    except (OSError, ValueError):
        return None


def generations_newest_first(sdir: Path) -> list[str]:
    """The session's generations: the `current` one first, then the others newest first."""
    gdir = sdir / "generations"
    try:
        names = sorted((n for n in os.listdir(gdir) if not n.startswith(".")), reverse=True)
    except FileNotFoundError:
        return []
    try:
        cur = (sdir / "current").read_text().strip()
    except FileNotFoundError:
        cur = None
    if cur in names:
        names.remove(cur)
        names.insert(0, cur)
    return names


def repoint_current(sdir: Path) -> None:
    """After generations were removed: `current` names the newest one left, or is gone."""
    gdir = sdir / "generations"
    try:
        names = sorted((n for n in os.listdir(gdir) if not n.startswith(".")), reverse=True)
    except FileNotFoundError:
        names = []
    try:
        cur = (sdir / "current").read_text().strip()
    except FileNotFoundError:
        cur = None
    if cur in names:
        return
    if names:
        publish_file(sdir / "current", (names[0] + "\n").encode())
    elif cur is not None:
        (sdir / "current").unlink(missing_ok=True)
        fsync_dir(sdir)


def remove_staging(store) -> int:
    n = 0
    for sdir in _session_dirs(store):
        for name in os.listdir(sdir):
            if name.startswith(".staging-") or name.startswith(".tmp-"):
                path = sdir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                n += 1
    return n


def prune_superseded(store, ns: str, newest: str) -> int:
    """Delete the session's older generations with the same fingerprint as `newest`."""
    sdir = store.sessions_dir / ns
    fp = (read_manifest(sdir / "generations" / newest) or {}).get("fingerprint_sha256")
    gone = 0
    for gen in generations_newest_first(sdir):
        m = read_manifest(sdir / "generations" / gen)
        if gen != newest and (m is None or m.get("fingerprint_sha256") == fp):
            shutil.rmtree(sdir / "generations" / gen)
            gone += 1
    if gone:
        fsync_dir(sdir / "generations")
        collect_pages(store)
    return gone


def collect_pages(store) -> int:
    """Delete page files that no generation's manifest lists (and stray temporary files),
    except those a streamed save wrote for the generation it is about to publish."""
    referenced = set(store.pending_pages)
    for sdir in _session_dirs(store):
        for gen in generations_newest_first(sdir):
            m = read_manifest(sdir / "generations" / gen)
            if m is None:  # unreadable: keep everything it might hold; it will be quarantined
                return 0
            referenced.update(p["sha256"] for p in m.get("pages", []))
    gone = 0
    for sub in _listdir(store.pages_dir):
        d = store.pages_dir / sub
        for name in _listdir(d):
            if name not in referenced:
                (d / name).unlink(missing_ok=True)
                gone += 1
    return gone


def make_room(store, need: int, *, keep: str, live: frozenset, fp_digest: str) -> list[str]:
    """Evict in the documented order until `need` more bytes fit; returns what was evicted
    (labels like 'quarantine', 'superseded', 'other_fingerprint', 'inactive', 'active')."""
    used = tree_bytes(store.root)
    if used + need <= store.quota_bytes:
        return []
    evicted = []
    for label, path in _candidates(store, keep, live, fp_digest):
        if not path.exists():
            continue
        shutil.rmtree(path)
        fsync_dir(path.parent)
        if path.parent.name == "generations":
            repoint_current(path.parent.parent)
            if not generations_newest_first(path.parent.parent):
                shutil.rmtree(path.parent.parent)
        collect_pages(store)
        evicted.append(label)
        used = tree_bytes(store.root)
        if used + need <= store.quota_bytes:
            return evicted
    raise QuotaExceeded(f"{need} bytes do not fit in {store.quota_bytes} ({used} used)")


def _candidates(store, keep: str, live: frozenset, fp_digest: str):
    for name in _listdir(store.quarantine_dir):
        yield "quarantine", store.quarantine_dir / name
    for sdir in _session_dirs(store):
        for name in os.listdir(sdir):
            if name.startswith(".staging-"):
                yield "staging", sdir / name
    gens = []  # (session dir, gen, fingerprint digest, last use)
    for sdir in _session_dirs(store):
        seen_fp = set()
        for gen in generations_newest_first(sdir):
            gdir = sdir / "generations" / gen
            m = read_manifest(gdir) or {}
            fp = m.get("fingerprint_sha256")
            if fp in seen_fp:
                yield "superseded", gdir
                continue
            seen_fp.add(fp)
            gens.append((sdir, gen, fp, _mtime(gdir)))
    others = sorted((g for g in gens if g[2] != fp_digest), key=lambda g: g[1])
    for sdir, gen, _, _ in others:
        yield "other_fingerprint", sdir / "generations" / gen
    mine = sorted((g for g in gens if g[2] == fp_digest and g[0].name != keep),
                  key=lambda g: g[3])
    for sdir, gen, _, _ in mine:
        if sdir.name not in live:
            yield "inactive", sdir / "generations" / gen
    for sdir, gen, _, _ in mine:
        if sdir.name in live:
            yield "active", sdir / "generations" / gen


def usage_stats(store) -> dict:
    sessions = _session_dirs(store)
    return {
        "bytes_used": tree_bytes(store.root), "quota_bytes": store.quota_bytes,
        "sessions": len(sessions),
        "generations": sum(len(generations_newest_first(s)) for s in sessions),
        "pages": sum(len(_listdir(store.pages_dir / d)) for d in _listdir(store.pages_dir)),
        "page_bytes": tree_bytes(store.pages_dir),
        "quarantined": len(_listdir(store.quarantine_dir)),
    }


def _session_dirs(store) -> list[Path]:
    return [store.sessions_dir / n for n in _listdir(store.sessions_dir)
            if (store.sessions_dir / n).is_dir()]


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
