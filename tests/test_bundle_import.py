"""An import streams its pages: the bundle's check keeps only its small entries in memory, the
store reads each page from the bundle again as it writes it (checking it once more), and pages
written for a generation not yet published are safe from collection; a bundle changed during
the import publishes nothing. In-process, with the real CheckpointStore and bundle files (the
whole import with real servers: tests/test_session_transfer.py)."""
from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest

from server.checkpoints import quota
from server.checkpoints.bundle import read_bundle, write_bundle
from server.checkpoints.checkpoint_store import CheckpointStore
from server.checkpoints.fingerprint import fingerprint_digest
from server.checkpoints.publish import SaveInput
from server.checkpoints.status import SessionStatus
from tests.test_checkpoint_store import FP_A, PAGE

KEY = bytes(range(32))


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(tmp_path / "ck", quota_bytes=1 << 30, io_threads=3)
    yield s
    s.close()


def make_bundle(path, n_pages: int):
    rng = np.random.default_rng(n_pages)
    pages = [rng.integers(0, 256, 4096, np.uint8).tobytes() for _ in range(n_pages)]
    digests = [hashlib.sha256(p).hexdigest() for p in pages]
    tokens = np.arange(n_pages * PAGE, dtype="<i4").tobytes()
    state = rng.integers(0, 256, 8192, np.uint8).tobytes()
    header = {"principal": "alice", "session": "s", "created_at": round(time.time(), 3),
              "fingerprint": FP_A, "fingerprint_sha256": fingerprint_digest(FP_A),
              "checkpoint": {"generation": "0", "head_response_id": "resp_1",
                             "frontier_tokens": n_pages * PAGE, "page_size": PAGE,
                             "pages": digests}}
    entries = ([("checkpoint/tokens.bin", tokens, None), ("checkpoint/state.bin", state, None)]
               + [(f"pages/{d}", p, d) for d, p in zip(digests, pages)]
               + [("responses.json", b"{}", None)])
    write_bundle(path, KEY, header, entries)
    return pages, digests


def save_input(b) -> SaveInput:
    c = b.header["checkpoint"]
    return SaveInput(np.frombuffer(b.data["checkpoint/tokens.bin"], "<i4"), PAGE,
                     [None] * len(c["pages"]), list(c["pages"]),
                     b.data["checkpoint/state.bin"], c["head_response_id"])


def test_pages_are_read_again_one_at_a_time_as_they_are_written(tmp_path, store):
    pages, digests = make_bundle(tmp_path / "b.bundle", 40)
    with read_bundle(tmp_path / "b.bundle", KEY) as b:
        assert set(b.data) == {"checkpoint/tokens.bin", "checkpoint/state.bin",
                               "responses.json"}  # no page held in memory
        assert len(b.pages) == 40
        reads = []

        def read_page(d, buf):
            reads.append(d)
            return b.read_page(d, buf)
        res = store.save_streamed("alice", "s", save_input(b), FP_A, read_page, b.page_size)
    assert res.status == SessionStatus.SAVED and res.pages_written == 40
    assert res.pages_reused == 0 and res.bytes_written >= 40 * 4096
    assert sorted(reads) == sorted(digests)  # each page read once, when written
    got = store.load("alice", "s", FP_A)
    assert got.state == "available" and [bytes(p) for p in got.pages] == pages
    assert b.fd == -1  # the context manager closed the bundle


def test_a_bundle_changed_during_the_import_publishes_nothing(tmp_path, store):
    pages, digests = make_bundle(tmp_path / "b.bundle", 40)
    b = read_bundle(tmp_path / "b.bundle", KEY)  # verified
    off, _ = b.pages[f"pages/{digests[30]}"]
    with open(tmp_path / "b.bundle", "r+b") as f:  # then changed in place
        f.seek(off + 10)
        f.write(bytes([pages[30][10] ^ 1]))
    with b, pytest.raises(ValueError, match=f"page {digests[30][:16]}: its bytes are not"):
        store.save_streamed("alice", "s", save_input(b), FP_A, b.read_page, b.page_size)
    assert store.load("alice", "s", FP_A).state == "missing"
    assert store.pending_pages == set()
    quota.collect_pages(store)  # the pages written before the change: listed nowhere
    assert not [n for d in os.listdir(store.pages_dir) for n in os.listdir(store.pages_dir / d)]


def test_pages_written_for_a_generation_not_yet_published_survive_collection(store):
    d = "ab" + "0" * 62
    path = store.page_path(d)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_bytes(b"x" * 4096)
    store.pending_pages = {d}
    quota.collect_pages(store)
    assert path.exists()
    store.pending_pages = set()
    quota.collect_pages(store)
    assert not path.exists()


def test_a_full_disk_refuses_the_import_as_save_does(tmp_path):
    """ENOSPC while the pages are written: REFUSED with its reason, nothing published."""
    from server.checkpoints.files import Faults

    make_bundle(tmp_path / "b.bundle", 8)
    full = CheckpointStore(tmp_path / "ck", quota_bytes=1 << 30, faults=Faults("enospc"))
    try:
        with read_bundle(tmp_path / "b.bundle", KEY) as b:
            res = full.save_streamed("alice", "s", save_input(b), FP_A, b.read_page,
                                     b.page_size)
        assert (res.status, res.reason) == (SessionStatus.REFUSED, "enospc")
        assert full.load("alice", "s", FP_A).state == "missing" and not full.pending_pages
    finally:
        full.close()
