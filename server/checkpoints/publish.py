"""The write side of the checkpoint store: what a save takes and returns, its manifest, and the
publish protocol (docs/checkpoints.md) that makes a generation visible all at once.

Called by `CheckpointStore.save` under the store's lock; the files are written on its pool.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from server.checkpoints.files import (as_parts, fsync_dir, mkdir_synced, mkdirs_synced,
                                      publish_file, publish_files, wait_all, write_new)
from server.checkpoints.fingerprint import SCHEMA, fingerprint_digest
from server.checkpoints.status import SessionStatus
from server.checkpoints.tags import manifest_tag, principal_digest

# The publish protocol's steps, in order (`on_step` hears each name as it completes).
STEPS = ("staging_created", "pages_written", "payload_written", "manifest_written",
         "mac_written", "staging_synced", "renamed", "current_replaced", "pruned")


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
    status: SessionStatus         # SAVED | REFUSED
    reason: str | None = None
    generation: str | None = None
    bytes_written: int = 0
    pages_written: int = 0
    pages_reused: int = 0
    evicted: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def sha256_parts(data) -> str:
    """The sha256 of a payload (one buffer or a sequence of them, hashed back to back)."""
    h = hashlib.sha256()
    for v in as_parts(data):
        h.update(v)
    return h.hexdigest()


def manifest_bytes(principal, ns, gen, fingerprint, inp: SaveInput, tokens, digests, sizes,
                   new_bytes, new_count, file_sha, state_len) -> bytes:
    """The generation's manifest: owner, fingerprint, and every file's size and sha256."""
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


def publish_generation(store, principal, staging: Path, gen: str, new_pages: dict,
                       tokens: bytes, state, manifest: bytes, step, t) -> None:
    """The publish protocol (the store's module docstring); `step(name)` after each step,
    `t.lap(stage)` after each stage. The new pages and the staging payloads are written
    concurrently on the store's pool (each file fsync'd before it is renamed or referenced);
    the manifest is written only after every one of them (and every page directory) is
    durable."""
    pool, faults = store.io_pool, store.faults
    sdir = staging.parent
    mkdir_synced(sdir / "generations")
    staging.mkdir(mode=0o700)
    fsync_dir(sdir)
    step("staging_created")
    mkdirs_synced({store.page_path(d).parent for d in new_pages}, pool)
    payload = [pool.submit(write_new, staging / "tokens.bin", tokens, faults),
               pool.submit(write_new, staging / "state.bin", state, faults)]
    try:
        publish_files([(store.page_path(d), data) for d, data in new_pages.items()],
                      faults, pool)
    except BaseException:
        for f in payload:  # no task may still be writing when the caller cleans up
            f.exception()
        raise
    t.lap("pages")
    step("pages_written")
    wait_all(payload)
    t.lap("payload")
    step("payload_written")
    write_new(staging / "manifest.json", manifest, faults)
    step("manifest_written")
    tag = manifest_tag(store.tag_key(principal), manifest)
    write_new(staging / "manifest.mac", (tag + "\n").encode(), faults)
    step("mac_written")
    fsync_dir(staging)
    step("staging_synced")
    os.rename(staging, sdir / "generations" / gen)
    fsync_dir(sdir / "generations")
    step("renamed")
    publish_file(sdir / "current", (gen + "\n").encode())
    step("current_replaced")
    t.lap("manifest_and_publish")
