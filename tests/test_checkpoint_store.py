"""The checkpoint store on real files, without a model: publish protocol under SIGKILL at every
step (in a child process that holds only the store), verification (flipped bytes, tampered
manifests, another principal's tag), fingerprints, quota eviction order, ENOSPC, deletion."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from server.checkpoints import quota
from server.checkpoints.checkpoint_store import CheckpointStore, StoreBusy
from server.checkpoints.files import Faults
from server.checkpoints.publish import STEPS, SaveInput
from server.checkpoints.tags import manifest_tag, principal_key, session_namespace

REPO = Path(__file__).resolve().parent.parent
PAGE = 64
FP_A = {"artifact_sha256": "a" * 64, "profile_sha256": "1" * 64}
FP_B = {"artifact_sha256": "a" * 64, "profile_sha256": "2" * 64}


def page_bytes(seed: int, i: int, fill: int = 0) -> bytes:
    return np.random.default_rng([seed, i, fill]).integers(0, 255, 1024, np.uint8).tobytes()


def make_input(n_tokens: int, seed: int = 0, known: dict | None = None) -> SaveInput:
    """A state of `n_tokens` tokens; page i's bytes depend on (seed, i). `known`: page index ->
    digest already on disk (its bytes are not passed)."""
    n_pages = -(-n_tokens // PAGE)
    partial = n_tokens % PAGE  # a partial last page holds a different tail in every state
    pages = [None if known and i in known else
             page_bytes(seed, i, n_tokens if partial and i == n_pages - 1 else 0)
             for i in range(n_pages)]
    digests = [known.get(i) if known else None for i in range(n_pages)]
    return SaveInput(np.arange(n_tokens, dtype=np.int32) + seed, PAGE, pages, digests,
                     bytes([seed % 256]) * 4096, head_response_id=f"resp_{seed}_{n_tokens}")


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(tmp_path / "ck", quota_bytes=1 << 30)
    yield s
    s.close()


def prompt_after(inp: SaveInput, extra: int = 5) -> np.ndarray:
    return np.concatenate([inp.tokens, np.full((extra,), 7, np.int32)])


def test_round_trip_and_a_new_turn_writes_only_its_new_pages(store):
    first = make_input(300)
    r1 = store.save("alice", "s", first, FP_A)
    assert r1.status == "saved" and r1.pages_written == 5 and r1.pages_reused == 0
    got = store.load("alice", "s", FP_A, prompt_after(first))
    assert got.state == "available" and got.generation == r1.generation
    assert np.array_equal(got.tokens, first.tokens) and got.state_bytes == first.state
    assert got.pages == first.pages and got.head_response_id == first.head_response_id
    # the next turn: 300 -> 500 tokens; pages 0-3 are full and known, page 4 was partial
    second = make_input(500, known={i: first.digests[i] for i in range(4)})
    r2 = store.save("alice", "s", second, FP_A)
    assert r2.status == "saved" and r2.pages_written == 4 and r2.pages_reused == 4
    assert r2.bytes_written == 4 * 1024 + 500 * 4 + 4096
    # the superseded generation is gone, and so is its partial page no one references
    sdir = store.session_dir("alice", "s")
    assert quota.generations_newest_first(sdir) == [r2.generation]
    assert not store.page_path(first.digests[4]).exists()
    # a prompt that does not extend the state is a miss; so is another session or principal
    assert store.load("alice", "s", FP_A, first.tokens[:10]).reason == "not_prefix"
    assert store.load("alice", "other", FP_A, prompt_after(second)).state == "missing"
    assert store.load("bob", "s", FP_A, prompt_after(second)).state == "missing"
    # pages are shared between sessions: the same bytes are stored once
    r3 = store.save("alice", "t", make_input(500), FP_A)
    assert r3.pages_written == 0 and r3.pages_reused == 8


def test_single_writer_and_secret_mode(tmp_path, store):
    with pytest.raises(StoreBusy):
        CheckpointStore(store.root, quota_bytes=1 << 30)
    assert (store.root / "secret").stat().st_mode & 0o777 == 0o600
    store.close()
    (store.root / "secret").chmod(0o644)
    with pytest.raises(PermissionError):
        CheckpointStore(store.root, quota_bytes=1 << 30)


_CHILD = r"""
import os, signal, sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from server.checkpoints.checkpoint_store import CheckpointStore
from tests.test_checkpoint_store import FP_A, make_input
store = CheckpointStore(Path({root!r}), quota_bytes=1 << 30)
if {step!r} == "setup":
    assert store.save("alice", "s", make_input(300, seed=1), FP_A).status == "saved"
    sys.exit(0)
def on_step(name):
    if name == {step!r}:
        os.kill(os.getpid(), signal.SIGKILL)
store.save("alice", "s", make_input(700, seed=2), FP_A, on_step=on_step)
sys.exit(5)
"""


@pytest.mark.parametrize("step", STEPS)
def test_sigkill_at_each_publish_step_leaves_the_previous_generation(tmp_path, step):
    root = tmp_path / "ck"

    def child(s):
        return subprocess.run([sys.executable, "-c", _CHILD.format(repo=str(REPO),
                                                                   root=str(root), step=s)],
                              cwd=REPO, capture_output=True, text=True)

    assert child("setup").returncode == 0
    p = child(step)
    assert p.returncode == -signal.SIGKILL, p.stderr
    store = CheckpointStore(root, quota_bytes=1 << 30)  # a new process: staging is abandoned
    try:
        new = make_input(700, seed=2)
        got = store.load("alice", "s", FP_A, prompt_after(new))
        published = STEPS.index(step) >= STEPS.index("current_replaced")
        if published:
            assert got.state == "available" and np.array_equal(got.tokens, new.tokens)
        else:  # the old state stays current and whole; the new one is invisible, or (renamed
            # but not yet current) complete and verified: never partial
            if step == "renamed" and got.state == "available":
                assert got.pages == new.pages and got.state_bytes == new.state
            else:
                assert got.reason == "not_prefix"
            old = make_input(300, seed=1)
            got = store.load("alice", "s", FP_A, prompt_after(old))
            assert got.state == "available" and got.pages == old.pages
        sdir = store.session_dir("alice", "s")
        assert not [n for n in os.listdir(sdir) if n.startswith(".staging")]
        for gen in quota.generations_newest_first(sdir):  # every visible generation is whole
            assert (sdir / "generations" / gen / "manifest.mac").exists()
    finally:
        store.close()


@pytest.mark.parametrize("target", ["tokens.bin", "state.bin", "page", "manifest.json"])
def test_a_flipped_byte_is_detected_and_quarantined(store, target):
    inp = make_input(300)
    gen = store.save("alice", "s", inp, FP_A).generation
    gdir = store.session_dir("alice", "s") / "generations" / gen
    path = store.page_path(inp.digests[2]) if target == "page" else gdir / target
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    got = store.load("alice", "s", FP_A, prompt_after(inp))
    assert got.state == "corrupt" and got.pages is None
    assert got.reason.startswith("tag_invalid" if target == "manifest.json" else "hash_mismatch")
    assert not gdir.exists() and len(os.listdir(store.quarantine_dir)) == 1
    if target == "page":
        assert not path.exists()  # deleted: the next save writes it again
    assert store.load("alice", "s", FP_A, prompt_after(inp)).state == "missing"
    # a new save works again and restores
    assert store.save("alice", "s", make_input(300), FP_A).status == "saved"
    assert store.load("alice", "s", FP_A, prompt_after(inp)).state == "available"


def test_tampered_manifest_and_another_principals_tag_are_refused(store):
    inp = make_input(300)
    gen = store.save("alice", "s", inp, FP_A).generation
    gdir = store.session_dir("alice", "s") / "generations" / gen
    m = json.loads((gdir / "manifest.json").read_bytes())
    # 1. an edit that keeps the JSON valid (a longer frontier), with the old tag
    m["head_response_id"] = "resp_forged"
    (gdir / "manifest.json").write_bytes(json.dumps(m, sort_keys=True,
                                                    separators=(",", ":")).encode())
    got = store.load("alice", "s", FP_A, prompt_after(inp))
    assert (got.state, got.reason) == ("corrupt", "tag_invalid")
    # 2. a generation tagged with bob's key, placed in alice's session
    gen = store.save("alice", "s", inp, FP_A).generation
    gdir = store.session_dir("alice", "s") / "generations" / gen
    mbytes = (gdir / "manifest.json").read_bytes()
    (gdir / "manifest.mac").write_text(manifest_tag(principal_key(store._master, "bob"),
                                                    mbytes) + "\n")
    got = store.load("alice", "s", FP_A, prompt_after(inp))
    assert (got.state, got.reason) == ("corrupt", "tag_invalid")
    # 3. bob's own valid generation copied into alice's session: tag fails for alice
    bob_gen = store.save("bob", "s", inp, FP_A).generation
    src = store.session_dir("bob", "s") / "generations" / bob_gen
    dst = store.session_dir("alice", "s") / "generations" / bob_gen
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.rename(src, dst)
    assert store.load("alice", "s", FP_A, prompt_after(inp)).reason == "tag_invalid"


def test_fingerprint_change_is_incompatible_and_switching_back_restores(store):
    a = make_input(300, seed=1)
    store.save("alice", "s", a, FP_A)
    got = store.load("alice", "s", FP_B, prompt_after(a))
    assert (got.state, got.reason) == ("incompatible", "fingerprint_mismatch")
    b = make_input(600, seed=1)  # the session went on under FP_B (recomputed, saved)
    assert store.save("alice", "s", b, FP_B).status == "saved"
    assert store.load("alice", "s", FP_B, prompt_after(b)).tokens.shape[0] == 600
    back = store.load("alice", "s", FP_A, prompt_after(b))  # rollback: the FP_A state
    assert back.state == "available" and back.tokens.shape[0] == 300


def test_quota_evicts_in_the_documented_order_and_keeps_the_live_session(tmp_path):
    store = CheckpointStore(tmp_path / "ck", quota_bytes=1 << 30)
    one = 5 * 1024 + 300 * 4 + 4096 + 2048  # one 300-token generation with its manifest
    store.save("alice", "old-fp", make_input(300, seed=1), FP_B)
    store.save("alice", "inactive-1", make_input(300, seed=2), FP_A)
    store.save("alice", "inactive-2", make_input(300, seed=3), FP_A)
    store.save("alice", "active", make_input(300, seed=4), FP_A)
    (store.quarantine_dir / "x-1-tag_invalid").mkdir()
    (store.quarantine_dir / "x-1-tag_invalid" / "junk").write_bytes(b"\0" * 3000)
    live = frozenset({session_namespace("alice", "active"), session_namespace("alice", "new")})
    order = []
    for seed in (5, 6, 7, 8):  # each new save needs room for one more generation
        store.quota_bytes = quota.tree_bytes(store.root) + one - 3000 * (seed == 5)
        r = store.save("alice", "new", make_input(300, seed=seed), FP_A, live=live)
        assert r.status == "saved", r
        order += r.evicted
    assert order[:3] == ["quarantine", "other_fingerprint", "inactive"]
    assert order[3:] == ["inactive"] or order[3:] == ["inactive", "active"][:len(order) - 3]
    left = lambda s: store.load("alice", s, FP_A, None).state  # noqa: E731
    assert left("inactive-1") == "missing"  # least recently used first
    assert left("new") == "available"
    # when nothing else can go, a save that cannot fit is refused and changes nothing
    store.quota_bytes = 1000
    r = store.save("alice", "new", make_input(900, seed=9), FP_A, live=live)
    assert (r.status, r.reason) == ("refused", "quota")
    assert store.load("alice", "new", FP_A, None).state == "available"
    # page collection: every page file on disk is referenced by a manifest
    referenced = {p["sha256"] for s in os.listdir(store.sessions_dir)
                  for g in quota.generations_newest_first(store.sessions_dir / s)
                  for p in quota.read_manifest(store.sessions_dir / s / "generations" / g)["pages"]}
    on_disk = {n for d in os.listdir(store.pages_dir) for n in os.listdir(store.pages_dir / d)}
    assert on_disk == referenced
    store.close()


def test_enospc_is_refused_cleanly_and_the_previous_generation_stays(tmp_path):
    store = CheckpointStore(tmp_path / "ck", quota_bytes=1 << 30)
    old = make_input(300)
    store.save("alice", "s", old, FP_A)
    store.faults = Faults("enospc")
    r = store.save("alice", "s", make_input(700, seed=3), FP_A)
    assert (r.status, r.reason) == ("refused", "enospc")
    assert store.load("alice", "s", FP_A, prompt_after(old)).state == "available"
    sdir = store.session_dir("alice", "s")
    assert not [n for n in os.listdir(sdir) if n.startswith(".")]
    store.close()


def test_purge_and_response_delete_remove_content(store):
    a, b = make_input(300, seed=1), make_input(300, seed=2)
    store.save("alice", "s", a, FP_A)
    store.save("alice", "t", b, FP_A)
    assert store.drop_response("alice", "s", "resp_other") == 0
    assert store.drop_response("alice", "s", a.head_response_id) == 1
    assert store.load("alice", "s", FP_A, prompt_after(a)).state == "missing"
    gen = store.save("alice", "t", make_input(300, seed=3), FP_A).generation
    tokens = store.session_dir("alice", "t") / "generations" / gen / "tokens.bin"
    tokens.write_bytes(b"\0" + tokens.read_bytes()[1:])
    assert store.load("alice", "t", FP_A, None).state == "corrupt"  # now in quarantine
    assert len(os.listdir(store.quarantine_dir)) == 1
    assert store.purge("alice", "t") == 0  # its only generation was quarantined
    assert not store.session_dir("alice", "t").exists()
    assert os.listdir(store.quarantine_dir) == []  # the quarantined copy went too
    assert quota.usage_stats(store)["pages"] == 0  # nothing references any page


# ---- the parallel save and load paths -----------------------------------------------------

@pytest.mark.parametrize("flip", [[0], [3], [4], [1, 3]])
def test_parallel_verification_quarantines_any_flipped_page(store, flip):
    """Pages are read and verified concurrently: one flipped byte in any page (or in several)
    still fails the whole load, names the first bad page in page order, quarantines the
    generation and deletes every page whose bytes are wrong (and only those)."""
    inp = make_input(300)  # 5 pages, the last one partial
    gen = store.save("alice", "s", inp, FP_A).generation
    for i in flip:
        path = store.page_path(inp.digests[i])
        data = bytearray(path.read_bytes())
        data[(i * 97) % len(data)] ^= 0x80
        path.write_bytes(bytes(data))
    got = store.load("alice", "s", FP_A, prompt_after(inp))
    assert (got.state, got.generation, got.pages) == ("corrupt", gen, None)
    assert got.reason == f"hash_mismatch:{inp.digests[flip[0]][:16]}"
    assert len(os.listdir(store.quarantine_dir)) == 1
    for i, d in enumerate(inp.digests):
        assert store.page_path(d).exists() == (i not in flip)
    # the next save rewrites exactly the deleted pages, and restores
    r = store.save("alice", "s", make_input(300), FP_A)
    assert (r.status, r.pages_written) == ("saved", len(flip))
    assert store.load("alice", "s", FP_A, prompt_after(inp)).pages == inp.pages


def test_a_truncated_or_missing_page_fails_the_load(store):
    inp = make_input(300)
    store.save("alice", "s", inp, FP_A)
    store.page_path(inp.digests[1]).write_bytes(b"short")
    got = store.load("alice", "s", FP_A, prompt_after(inp))
    assert (got.state, got.reason) == ("corrupt", f"hash_mismatch:{inp.digests[1][:16]}")
    inp = make_input(300, seed=4)
    store.save("alice", "t", inp, FP_A)
    store.page_path(inp.digests[2]).unlink()
    got = store.load("alice", "t", FP_A, prompt_after(inp))
    assert (got.state, got.reason) == ("corrupt", f"missing:{inp.digests[2][:16]}")


def test_state_in_parts_and_page_buffers_are_written_as_one(store):
    """The state may come as several buffers (conv, rec) and pages as memoryviews or arrays:
    the files hold their bytes back to back, exactly as if they had been joined."""
    inp = make_input(300)
    joined = inp.state
    parts = SaveInput(inp.tokens, PAGE, [np.frombuffer(p, np.uint8) if i % 2 else memoryview(p)
                                         for i, p in enumerate(inp.pages)],
                      [None] * 5, [joined[:1000], np.frombuffer(joined[1000:], np.uint8)],
                      inp.head_response_id)
    r = store.save("alice", "s", parts, FP_A)
    assert r.status == "saved" and r.bytes_written == 5 * 1024 + 300 * 4 + len(joined)
    got = store.load("alice", "s", FP_A, prompt_after(inp))
    assert got.state == "available" and got.state_bytes == joined and got.pages == inp.pages
    assert store.save("alice", "t", inp, FP_A).pages_reused == 5  # the same pages
    assert inp.digests == parts.digests
    assert store.load("alice", "t", FP_A, prompt_after(inp)).page_digests == parts.digests


def test_load_into_a_page_layout(store):
    """page_layout: each page read straight into the caller's buffers (split as the engine's
    arrays are), verified; a layout for another page size falls back to the default."""
    inp = make_input(300)
    store.save("alice", "s", inp, FP_A)
    made = []

    def layout(n, page_bytes):
        if page_bytes != 1024:
            return None
        bufs = [np.zeros((n, 256), np.uint8), np.zeros((n, 768), np.uint8)]
        made.append(bufs)
        return "handle", [[memoryview(bufs[0][i]), memoryview(bufs[1][i])] for i in range(n)]

    got = store.load("alice", "s", FP_A, prompt_after(inp), page_layout=layout)
    assert got.state == "available" and got.staged == "handle" and len(made) == 1
    k, v = made[0]
    assert [k[i].tobytes() + v[i].tobytes() for i in range(5)] == inp.pages
    assert got.state_bytes == inp.state
    other = store.load("alice", "s", FP_A, prompt_after(inp), page_layout=lambda n, b: None)
    assert other.staged is None and other.pages == inp.pages
    # a flipped byte is found in the split layout too
    path = store.page_path(inp.digests[3])
    data = bytearray(path.read_bytes())
    data[1000] ^= 1  # in the second buffer of the page
    path.write_bytes(bytes(data))
    got = store.load("alice", "s", FP_A, prompt_after(inp), page_layout=layout)
    assert (got.state, got.reason) == ("corrupt", f"hash_mismatch:{inp.digests[3][:16]}")


def test_a_failed_page_write_among_many_refuses_and_leaves_nothing(tmp_path, monkeypatch):
    """Pages are written on the pool: when one write fails, every other task still ends
    before the staging directory is removed; the save is refused, no temporary file is left,
    the previous generation stays current, and the next save works."""
    from server.checkpoints import files

    store = CheckpointStore(tmp_path / "ck", quota_bytes=1 << 30, io_threads=4)
    try:
        old = make_input(300, seed=1)
        store.save("alice", "s", old, FP_A)
        real, calls = files.write_new, []

        def flaky(path, data, faults=None):
            calls.append(path)
            if len(calls) == 6:
                raise OSError(errno.EIO, "injected")
            return real(path, data, faults)

        monkeypatch.setattr(files, "write_new", flaky)
        r = store.save("alice", "s", make_input(1000, seed=2), FP_A)
        assert (r.status, r.reason) == ("refused", "eio") and len(calls) > 6
        monkeypatch.setattr(files, "write_new", real)
        sdir = store.session_dir("alice", "s")
        assert not [n for n in os.listdir(sdir) if n.startswith(".")]
        assert not [n for d in os.listdir(store.pages_dir)
                    for n in os.listdir(store.pages_dir / d) if n.startswith(".tmp-")]
        got = store.load("alice", "s", FP_A, prompt_after(old))
        assert got.state == "available" and got.pages == old.pages
        new = make_input(1000, seed=2)
        assert store.save("alice", "s", new, FP_A).status == "saved"
        assert store.load("alice", "s", FP_A, prompt_after(new)).pages == new.pages
    finally:
        store.close()


_CHILD_MID_PAGES = r"""
import os, signal, sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from server.checkpoints import files, publish
from server.checkpoints.checkpoint_store import CheckpointStore
from tests.test_checkpoint_store import FP_A, make_input
store = CheckpointStore(Path({root!r}), quota_bytes=1 << 30, io_threads=4)
if {setup!r}:
    assert store.save("alice", "s", make_input(300, seed=1), FP_A).status == "saved"
    sys.exit(0)
real, n = files.write_new, [0]
def write_new(path, data, faults=None):
    n[0] += 1
    if n[0] == {kill_at!r}:  # other page writes are in flight on the pool
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, data, faults)
files.write_new = publish.write_new = write_new  # page files, then tokens/state too
store.save("alice", "s", make_input(2000, seed=2), FP_A)
sys.exit(5)
"""


@pytest.mark.parametrize("kill_at", [3, 20, 33])
def test_sigkill_while_pages_are_written_in_parallel_leaves_nothing_visible(tmp_path, kill_at):
    """A crash in the middle of the concurrent page writes (before any manifest exists): the
    new generation is invisible, the previous one current and whole, and the store's next
    open removes the staging directory; stray page temporaries are collected, never read."""
    root = tmp_path / "ck"

    def child(setup):
        return subprocess.run([sys.executable, "-c", _CHILD_MID_PAGES.format(
            repo=str(REPO), root=str(root), setup=setup, kill_at=kill_at)],
            cwd=REPO, capture_output=True, text=True)

    assert child(True).returncode == 0
    p = child(False)
    assert p.returncode == -signal.SIGKILL, p.stderr
    store = CheckpointStore(root, quota_bytes=1 << 30)
    try:
        sdir = store.session_dir("alice", "s")
        assert not [n for n in os.listdir(sdir) if n.startswith(".staging")]
        assert quota.generations_newest_first(sdir) and len(
            quota.generations_newest_first(sdir)) == 1
        new = make_input(2000, seed=2)
        assert store.load("alice", "s", FP_A, prompt_after(new)).reason == "not_prefix"
        old = make_input(300, seed=1)
        got = store.load("alice", "s", FP_A, prompt_after(old))
        assert got.state == "available" and got.pages == old.pages
        assert store.save("alice", "s", new, FP_A).status == "saved"
        assert store.load("alice", "s", FP_A, prompt_after(new)).pages == new.pages
        assert not [n for d in os.listdir(store.pages_dir)
                    for n in os.listdir(store.pages_dir / d) if n.startswith(".tmp-")]
    finally:
        store.close()


def evict(paths) -> None:
    """Out of the page cache (written back first, so the pages are clean and can go)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def store_paths(store) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(store.root) for n in names
            if not n.endswith(".lock")]


def test_loads_read_with_o_direct_where_the_buffers_and_the_filesystem_allow(tmp_path, store):
    """read_into takes O_DIRECT for page-aligned buffers on a filesystem that has it, reads an
    unaligned buffer, or a file on a filesystem that refuses O_DIRECT, through the page cache,
    and either way refuses a file whose size is not the buffers' total; a whole load goes the
    direct way here (ext4 under CI)."""
    from server.checkpoints import files

    data = np.random.default_rng(5).integers(0, 256, 3 * 4096, np.uint8).tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    evict([path])  # a cached file is copied from the page cache (the test after this one)
    before = dict(files.READS)
    buf = files.aligned_bytes(3 * 4096)
    assert files.read_into(path, [memoryview(buf)[:4096], memoryview(buf)[4096:]])
    assert bytes(buf) == data and files.READS["direct"] == before["direct"] + 1
    odd = bytearray(3 * 4096 + 1)  # a bytearray's address is not page-aligned
    assert files.read_into(path, memoryview(odd)[1:]) and bytes(odd[1:]) == data
    assert files.READS["buffered"] == before["buffered"] + 1
    assert not files.read_into(path, files.aligned_bytes(4 * 4096))  # the size differs
    # a filesystem that refuses O_DIRECT at open (EINVAL; tmpfs before Linux 6.6): buffered
    real_open = os.open

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(p, flags, *a)
    evict([path])  # the buffered read above cached it
    os.open = no_direct
    try:
        n = files.READS["buffered"]
        buf2 = files.aligned_bytes(3 * 4096)
        assert files.read_into(path, buf2) and bytes(buf2) == data
        assert files.READS["buffered"] == n + 1
    finally:
        os.open = real_open
    rng = np.random.default_rng(9)
    pages = [rng.integers(0, 256, 4096, np.uint8).tobytes() for _ in range(4)]
    inp = SaveInput(np.arange(4 * PAGE, dtype=np.int32), PAGE, list(pages), [None] * 4,
                    rng.integers(0, 256, 8192, np.uint8).tobytes(), head_response_id="resp_d")
    assert store.save("alice", "direct", inp, FP_A).status == "saved"
    evict(store_paths(store))
    n = files.READS["direct"]
    got = store.load("alice", "direct", FP_A, prompt_after(inp))
    assert got.state == "available" and [bytes(p) for p in got.pages] == pages
    assert files.READS["direct"] - n == 5  # the state image and the 4 pages


def test_what_the_page_cache_holds_is_read_from_it(tmp_path, store):
    """A checkpoint read soon after it was written (a restore after an eviction) comes from
    the page cache, not the disk again; a file cached in part is read from the cache up to an
    aligned offset and direct after it; the bytes are the file's either way."""
    from server.checkpoints import files

    rng = np.random.default_rng(11)
    pages = [rng.integers(0, 256, 4096, np.uint8).tobytes() for _ in range(4)]
    inp = SaveInput(np.arange(4 * PAGE, dtype=np.int32), PAGE, list(pages), [None] * 4,
                    rng.integers(0, 256, 8192, np.uint8).tobytes(), head_response_id="resp_w")
    assert store.save("alice", "warm", inp, FP_A).status == "saved"
    before = dict(files.READS)
    got = store.load("alice", "warm", FP_A, prompt_after(inp))  # just written: cached
    assert got.state == "available" and [bytes(p) for p in got.pages] == pages
    assert files.READS["cached"] - before["cached"] == 5
    assert files.READS["direct"] == before["direct"]
    data = rng.integers(0, 256, 64 * 4096, np.uint8).tobytes()
    path = tmp_path / "half.bin"
    path.write_bytes(data)
    evict([path])
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead past what we read
        os.pread(fd, 8 * 4096, 0)  # the first 8 pages cached
    finally:
        os.close(fd)
    n = dict(files.READS)
    buf = files.aligned_bytes(len(data))
    assert files.read_into(path, buf) and bytes(buf) == data
    assert files.READS["direct"] - n["direct"] == 1 and files.READS["cached"] == n["cached"]
