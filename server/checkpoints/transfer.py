"""Moving a session between servers: export its newest verified checkpoint generation and its
stored responses into a bundle (`bundle.py`), and import a bundle into a checkpoint store and a
response store.

Export reads the state directory without the store's lock (a serving process may hold it):
generation directories are immutable once published, so a generation is read and verified end
to end by the store's own `read_generation` (tag under the state directory's secret, owner,
every page's and payload's sha256); a generation that fails, or whose pages are collected
meanwhile, is skipped for the next one.

Import verifies the whole bundle first (`read_bundle`), then the owner, the fingerprint against
the receiving runtime's and the response rows against the receiving database; only then does it
write: the checkpoint through `CheckpointStore.save_streamed` (each page read from the bundle
again, checked and written one at a time, then the normal publish protocol, tagged with the
receiver's secret), then the responses in one transaction. If that transaction fails, the
generation just published is removed again, so no half of an import stays.
"""
from __future__ import annotations

import json
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from server import response_rows
from server.checkpoints import quota
from server.checkpoints.bundle import Bundle, BundleError, read_bundle, write_bundle
from server.checkpoints.files import publish_file, read_file
from server.checkpoints.fingerprint import (SCHEMA, differing_fields, engine_build_id,
                                            fingerprint_digest)
from server.checkpoints.publish import SaveInput
from server.checkpoints.status import SessionStatus
from server.checkpoints.tags import principal_key, session_namespace
from server.checkpoints.verify import Corrupt, LoadResult, read_generation

RUNTIME_RECORD = "runtime.json"  # <checkpoints>/runtime.json: the last server's fingerprint


class _Reader:
    """What `read_generation` needs of a store, for reading one without its lock."""

    def __init__(self, root: Path, pool):
        self.root, self.io_pool = Path(root), pool
        self._master = read_file(self.root / "secret")

    def tag_key(self, principal: str) -> bytes:
        return principal_key(self._master, principal)

    def page_path(self, digest: str) -> Path:
        return self.root / "pages" / digest[:2] / digest


class _Laps:
    def lap(self, name: str) -> None:
        pass


def export_session(state_dir: Path, principal: str, session: str, out: Path,
                   key: bytes, pool) -> dict:
    """Write the bundle of (principal, session) to `out`; returns what it holds."""
    header, entries, info = session_entries(state_dir, principal, session, pool)
    size = write_bundle(out, key, header, entries, pool)
    return {"bundle": str(out), "bytes": size, **info}


def session_entries(state_dir: Path, principal: str, session: str, pool):
    """The newest verified generation of (principal, session) and its stored responses, as a
    bundle's header and entries ((name, buffer, sha256 or None)), and a summary."""
    state_dir = Path(state_dir)
    root = state_dir / "checkpoints"
    if not (root / "secret").is_file():
        raise BundleError(f"{root}: no checkpoint store here")
    reader = _Reader(root, pool)
    ns = session_namespace(principal, session)
    sdir = root / "sessions" / ns
    res = m = None
    for gen in quota.generations_newest_first(sdir):
        m = quota.read_manifest(sdir / "generations" / gen)
        if m is None:
            continue
        try:
            res = read_generation(reader, principal, ns, sdir / "generations" / gen,
                                  m.get("fingerprint_sha256"), None, None, _Laps())
        except Corrupt:
            res = None
        if isinstance(res, LoadResult):
            break
        res = None
    if res is None:
        raise BundleError(f"no verified checkpoint of this session under {root} "
                          "(save it first: `./ninfer ctl save`)")
    digests = list(res.page_digests)
    rows = response_rows.export_session(state_dir / "responses.db", principal, session)
    tokens = np.ascontiguousarray(res.tokens, "<i4").tobytes()
    state_sha = next(f["sha256"] for f in m["files"] if f["path"] == "state.bin")
    entries = [("checkpoint/tokens.bin", tokens, None),  # verified: their digests are known
               ("checkpoint/state.bin", res.state_bytes, state_sha)]
    seen = set()
    for d, view in zip(digests, res.pages):
        if d not in seen:
            seen.add(d)
            entries.append((f"pages/{d}", view, d))
    entries.append(("responses.json", response_rows.encode(rows), None))
    header = {"principal": principal, "session": session, "created_at": round(time.time(), 3),
              "fingerprint": m["fingerprint"], "fingerprint_sha256": m["fingerprint_sha256"],
              "checkpoint": {"generation": res.generation,
                             "head_response_id": res.head_response_id,
                             "frontier_tokens": int(res.tokens.shape[0]),
                             "page_size": m["page_size"], "pages": digests}}
    return header, entries, {"generation": res.generation,
                             "frontier_tokens": int(res.tokens.shape[0]),
                             "pages": len(digests), "responses": len(rows["responses"])}


def record_runtime(store_root: Path, fingerprint: dict) -> None:
    """Keep the serving runtime's fingerprint beside the store: a stopped-server import checks
    a bundle against it (`expected_fingerprint`)."""
    data = json.dumps(fingerprint, sort_keys=True, indent=1).encode()
    path = Path(store_root) / RUNTIME_RECORD
    try:
        if path.is_file() and read_file(path) == data:
            return
    except OSError:
        pass
    publish_file(path, data)


def expected_fingerprint(store_root: Path) -> tuple[dict, bool]:
    """What a runtime started on this state directory would restore: the last server's
    recorded fingerprint with the fields this code decides (schema, engine build, JAX
    versions) computed now. The flag says whether a record existed (else only those fields)."""
    here = {"checkpoint_schema": SCHEMA, "engine_build": engine_build_id(),
            "jax": metadata.version("jax"), "jaxlib": metadata.version("jaxlib")}
    try:
        recorded = json.loads(read_file(Path(store_root) / RUNTIME_RECORD))
    except (OSError, ValueError):
        return here, False
    return {**recorded, **here}, True


def fingerprint_refusal(theirs: dict, ours: dict, complete: bool) -> str | None:
    """Why a bundle's fingerprint cannot be restored here (naming the fields), or None."""
    if complete:
        differs = differing_fields(theirs, ours)
    else:
        differs = sorted(k for k in ours if theirs.get(k) != ours[k])
    if not differs:
        return None
    return f"fingerprint field(s) {', '.join(differs)} differ from this runtime's"


def verify_for_import(path: Path, key: bytes, expected_fp: dict, complete: bool,
                      principal: str | None, rstore) -> tuple[Bundle, dict]:
    """Every check an import makes before it writes; returns the bundle (open: close it)
    and its rows."""
    b = read_bundle(path, key)
    try:
        return b, _check(b, path, expected_fp, complete, principal, rstore)
    except BaseException:
        b.close()
        raise


def _check(b: Bundle, path: Path, expected_fp: dict, complete: bool, principal: str | None,
           rstore) -> dict:
    where, h = str(path), b.header
    if principal is not None and b.principal != principal:
        raise BundleError(f"{where}: bundle.json principal is another principal's, "
                          f"not {principal!r}")
    why = fingerprint_refusal(h["fingerprint"], expected_fp, complete)
    if why:
        raise BundleError(f"{where}: bundle.json {why}")
    try:
        c = h["checkpoint"]
        if h["fingerprint_sha256"] != fingerprint_digest(h["fingerprint"]):
            raise BundleError(f"{where}: bundle.json fingerprint_sha256 does not match")
        n = int(c["frontier_tokens"])
        if len(b.data["checkpoint/tokens.bin"]) != 4 * n or len(c["pages"]) != -(
                -n // int(c["page_size"])):
            raise BundleError(f"{where}: checkpoint/tokens.bin disagrees with bundle.json "
                              "frontier_tokens/pages")
        # read_bundle checked every entry's bytes against the sha256 the (authenticated)
        # header lists for it, so a page is its digest when the header says so: no second hash
        listed = {e["path"]: e["sha256"] for e in h["entries"]}
        for d in c["pages"]:
            if f"pages/{d}" not in b.pages or listed.get(f"pages/{d}") != d:
                raise BundleError(f"{where}: entry pages/{str(d)[:16]}: missing or not its "
                                  "digest")
        b.data["checkpoint/state.bin"]  # noqa: B018 - presence
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"{where}: bundle.json checkpoint is malformed ({e})") from None
    try:
        rows = response_rows.decode(b.data.get("responses.json", b""), where)
        response_rows.check_import(rstore, rows, where)
    except ValueError as e:
        raise BundleError(str(e)) from None
    return rows


def import_session(path: Path, key: bytes, store, rstore, expected_fp: dict, complete: bool,
                   principal: str | None = None) -> dict:
    """Verify the bundle at `path` completely, then publish it (`publish_verified`)."""
    b, rows = verify_for_import(path, key, expected_fp, complete, principal, rstore)
    with b:
        return publish_verified(b, rows, store, rstore, path)


def publish_verified(b: Bundle, rows: dict, store, rstore, path: Path) -> dict:
    """A verified bundle's checkpoint into `store` (a CheckpointStore; its pages read from
    the bundle one at a time as they are written, `save_streamed`) and its responses into
    `rstore` (a ResponseStore)."""
    c = b.header["checkpoint"]
    inp = SaveInput(tokens=np.frombuffer(b.data["checkpoint/tokens.bin"], "<i4"),
                    page_size=int(c["page_size"]), pages=[None] * len(c["pages"]),
                    digests=list(c["pages"]), state=b.data["checkpoint/state.bin"],
                    head_response_id=c["head_response_id"])
    try:
        res = store.save_streamed(b.principal, b.session, inp, b.header["fingerprint"],
                                  b.read_page, b.page_size)
    except ValueError as e:  # a page's bytes are not its digest: checked before, so changed
        raise BundleError(f"{path}: {e}: the bundle changed while it was imported") from None
    if res.status != SessionStatus.SAVED:
        raise BundleError(f"{path}: the checkpoint store refused the import: {res.reason}")
    try:
        added = response_rows.import_session(rstore, b.principal, b.session, rows)
    except BaseException:
        store.drop_response(b.principal, b.session, c["head_response_id"])
        raise
    return {"principal": b.principal, "generation": res.generation,
            "frontier_tokens": int(c["frontier_tokens"]), "pages": len(c["pages"]),
            "pages_written": res.pages_written, "responses": added,
            "head_response_id": c["head_response_id"]}
