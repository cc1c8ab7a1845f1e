"""Restores streamed through the bounded staging arena (engine/runtime/staging.py): the real
checkpoint store reads a session of many runs through a few slots of one arena, every byte
lands on the device, a failed page aborts the stream and frees the arena, and on the real
embedded model a restored session continues as one that never left."""
from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from engine.runtime.checkpoint_io import RUN_PAGES
from engine.runtime.staging import StagingArena, StreamedPages, slot_plan
from server.checkpoints.checkpoint_store import CheckpointStore
from server.checkpoints.files import aligned_bytes
from tests.kernel_checks import on_gpu
from tests.test_checkpoint_store import FP_A, make_input, prompt_after

# a 1,024-byte page split as two pool arrays' slices, as the store tests' pages are
SPEC = [((4, 16), np.dtype(np.float32)), ((4, 48), np.dtype(np.float32))]
ARENA = 64 << 10  # 4 slots of 16 pages


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(tmp_path / "ck", quota_bytes=1 << 30)
    yield s
    s.close()


def arena_of(nbytes=ARENA) -> StagingArena:
    arena = StagingArena(nbytes, aligned_bytes).start()
    arena._ready.wait(30)
    return arena


def whole_layout_unused(n, page_bytes):
    raise AssertionError("the arena holds these pages: no whole-session staging")


def is_free(arena) -> bool:
    if arena._busy.acquire(blocking=False):
        arena._busy.release()
        return True
    return False


def device_bytes(staged: StreamedPages) -> list[bytes]:
    """Each page's bytes as they arrived on the device, in page order."""
    out = []
    for (start, stop), arrays in zip(staged.runs, staged.device_chunks):
        host = [np.asarray(a).reshape(stop - start, -1).view(np.uint8) for a in arrays]
        out += [b"".join(h[j].tobytes() for h in host) for j in range(stop - start)]
    return out


def test_slot_plan_keeps_four_slots_and_compiled_run_shapes():
    assert slot_plan(ARENA, SPEC) == (16, 4)
    assert slot_plan(1023, SPEC) is None  # not one page
    assert slot_plan(3 * 4096, SPEC) == (1, 1)  # one 1-page slot (each array's row aligned)
    pages, slots = slot_plan(1 << 30, SPEC)
    assert pages == RUN_PAGES and slots >= 4
    assert slot_plan(5 << 10, SPEC) is None  # five pages, but not one aligned slot
    for size in (9 << 10, 40 << 10, 300 << 10, 7 << 20):
        pages, slots = slot_plan(size, SPEC)
        assert pages & (pages - 1) == 0 and pages <= RUN_PAGES  # a prepared scatter shape
        assert slots * sum(-(-pages * r // 4096) * 4096 for r in (256, 768)) <= size


def test_a_long_session_streams_through_few_slots_to_the_device(store):
    inp = make_input(64 * 70)  # 70 pages: runs of 16 x 4, then 4 and 2, through 4 slots
    store.save("alice", "s", inp, FP_A)
    arena = arena_of()
    got = store.load("alice", "s", FP_A, prompt_after(inp),
                     page_layout=arena.layout(SPEC, whole_layout_unused))
    assert got.state == "available" and isinstance(got.staged, StreamedPages)
    staged = got.staged.to_device()
    assert [b - a for a, b in staged.runs] == [16, 16, 16, 16, 4, 2]
    assert device_bytes(staged) == inp.pages  # every verified byte, in order
    assert arena.counts == {"restores": 1, "runs": 6}
    assert is_free(arena)  # released with the last run: the next restore may stream
    base = arena._buf.ctypes.data  # every slot view lies inside the arena: no other staging
    for slot in staged._slots:
        for a in slot:
            assert base <= a.ctypes.data and a.ctypes.data + a.nbytes <= base + ARENA
    again = store.load("alice", "s", FP_A, prompt_after(inp),
                       page_layout=arena.layout(SPEC, whole_layout_unused))
    assert device_bytes(again.staged.to_device()) == inp.pages


@pytest.mark.parametrize("page", [3, 66])  # the first run, and one read after slots recycled
def test_a_bad_page_aborts_the_stream_and_frees_the_arena(store, page):
    inp = make_input(64 * 70)
    store.save("alice", "s", inp, FP_A)
    path = store.page_path(inp.digests[page])
    data = bytearray(path.read_bytes())
    data[700] ^= 1
    path.write_bytes(bytes(data))
    arena = arena_of()
    result = {}

    def load():
        result["got"] = store.load("alice", "s", FP_A, prompt_after(inp),
                                   page_layout=arena.layout(SPEC, whole_layout_unused))
    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "readers waiting for a slot were not released"
    got = result["got"]
    assert (got.state, got.reason) == ("corrupt", f"hash_mismatch:{inp.digests[page][:16]}")
    assert is_free(arena)
    store.save("alice", "s", make_input(64 * 70), FP_A)  # rewrites the deleted page
    ok = store.load("alice", "s", FP_A, prompt_after(inp),
                    page_layout=arena.layout(SPEC, whole_layout_unused))
    assert ok.state == "available" and device_bytes(ok.staged.to_device()) == inp.pages


def test_a_run_written_after_its_pages_went_back_is_dropped():
    """An aborted restore's pages go back on the engine thread; a run's write queued behind
    that must not land in pages another sequence may hold by then."""
    from engine.runtime.staging import PoolReservation, write_run

    class Table:
        released = 0

        def release(self):
            self.released += 1

    res = PoolReservation(Table(), np.arange(4, dtype=np.int32))
    from engine.runtime.staging import release_pages
    release_pages(res)
    release_pages(res)  # once only
    assert res.table.released == 1 and not res.live
    write_run(None, res, 0, 2, None)  # touches no pool (None would raise if it did)


def test_pages_larger_than_the_arena_stage_whole(store):
    inp = make_input(300)
    store.save("alice", "s", inp, FP_A)
    arena = arena_of(512)
    used = []

    def whole(n, page_bytes):
        used.append(n)
        return None  # the store's own buffers
    got = store.load("alice", "s", FP_A, prompt_after(inp), page_layout=arena.layout(SPEC, whole))
    assert got.state == "available" and used == [5] and got.pages == inp.pages
    assert is_free(arena) and arena.counts["restores"] == 0


@contextlib.contextmanager
def checkpointed(tiny_model, tmp_path, arena_pages: int, text: str, twin: bool = False):
    """An engine on the tiny model with a checkpointer whose staging arena holds
    `arena_pages` pages; erin's session (and, with `twin`, the same history as bob's, which
    stays resident) run, saved and evicted. Yields (checkpointer, engine, store, fed tokens,
    bob's first output or None)."""
    from server.checkpoints.manager import Checkpointer
    from tests.test_checkpoint_io import snapshot_of
    from tests.test_engine_reuse import make_engine, run, turn

    store = CheckpointStore(tmp_path / "ck", quota_bytes=1 << 30)
    ck = Checkpointer(store, autosave=False)
    engine = make_engine(tiny_model, hooks=ck.engine_hooks())
    page_bytes = sum(int(np.prod(s)) * d.itemsize for s, d in engine.checkpoint.page_spec)
    ck.attach(engine, {"test": arena_pages}, staging_bytes=arena_pages * page_bytes)
    try:
        p = turn(tiny_model, text * 12)
        out, _ = run(engine, p, "erin", max_tokens=16)
        bob = run(engine, p, "bob", max_tokens=16)[0] if twin else None
        fed = p + out[:-1]
        ck.after_response("erin", "s-erin", "resp_e", fed)
        assert ck.save("erin", "s-erin")[0]["status"] == "saved"
        while snapshot_of(engine, "erin", fed) is not None:
            assert engine.call(lambda e: e.mem._evict_one()).result()
        ck._resident.discard(("erin", "s-erin"))
        yield ck, engine, store, fed, (out, bob)
    finally:
        ck._jobs.put(None)
        engine.stop()
        store.close()


def test_a_restore_through_a_small_arena_continues_identically(tiny_model, tmp_path):
    """The tiny model's session, saved, evicted and restored by the checkpointer through an
    arena a few pages long (several runs, slots reused): the continuation equals the one
    from the state that never left."""
    from tests.test_engine_reuse import run, turn

    with checkpointed(tiny_model, tmp_path, 8, "Describe how a write-ahead log makes commits "
                      "durable. ", twin=True) as (ck, engine, store, fed, (out, bob)):
        assert bob == out  # the same history twice
        follow = fed + turn(tiny_model, "Now in one sentence.")
        want, _ = run(engine, follow, "bob", max_tokens=12)  # bob's state never left
        assert ck.restore_for("erin", "s-erin", follow) == "restored"
        assert ck.arena.counts["restores"] == 1 and ck.arena.counts["runs"] >= 2
        got, done = run(engine, follow, "erin", max_tokens=12)
        assert done.path == "disk-restored" and got == want


def test_a_failed_streamed_restore_gives_its_pool_pages_back(tiny_model, tmp_path):
    """A page flipped on disk, found after earlier runs were already written into reserved
    pool pages: the restore is a miss (corrupt), every reserved page is free again, the arena
    too, and the request recomputes."""
    from tests.test_engine_reuse import run, turn

    with checkpointed(tiny_model, tmp_path, 4, "List the steps of a two-phase commit, with "
                      "reasons. ") as (ck, engine, store, fed, _):  # 4 slots of one page
        free = engine.call(lambda e: e.mem.alloc.free_pages).result()
        got = store.load("erin", "s-erin", {"test": 4})
        last = store.page_path(got.page_digests[-1])
        data = bytearray(last.read_bytes())
        data[-1] ^= 1
        last.write_bytes(bytes(data))
        follow = fed + turn(tiny_model, "Shorter.")
        assert ck.restore_for("erin", "s-erin", follow).startswith("hash_mismatch")
        assert ck.arena.counts["runs"] >= 2  # runs went into the pool before the bad page
        assert engine.call(lambda e: e.mem.alloc.free_pages).result() == free
        assert is_free(ck.arena)
        _, done = run(engine, follow, "erin", max_tokens=4)
        assert done.path != "disk-restored"


def test_a_failed_device_transfer_is_a_miss_not_corruption(tiny_model, tmp_path, monkeypatch):
    """A run's transfer to the device fails (as an out-of-memory would): the restore fails as
    an error (the request recomputes), the checkpoint is not quarantined, the reserved pages
    and the arena go back, and the next restore succeeds."""
    from engine.runtime.staging import StreamedPages
    from tests.test_engine_reuse import turn

    with checkpointed(tiny_model, tmp_path, 4, "Explain how a B-tree splits a full node, "
                      "step by step. ") as (ck, engine, store, fed, _):
        free = engine.call(lambda e: e.mem.alloc.free_pages).result()
        real, calls = StreamedPages.transfer, []

        def failing(host):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("RESOURCE_EXHAUSTED: out of device memory (injected)")
            return real(host)
        monkeypatch.setattr(StreamedPages, "transfer", staticmethod(failing))
        follow = fed + turn(tiny_model, "Shorter.")
        with pytest.raises(RuntimeError, match="injected"):
            ck.restore_for("erin", "s-erin", follow)
        assert engine.call(lambda e: e.mem.alloc.free_pages).result() == free
        assert is_free(ck.arena)
        assert not list(store.quarantine_dir.iterdir())  # the files are fine
        monkeypatch.setattr(StreamedPages, "transfer", staticmethod(real))
        assert ck.restore_for("erin", "s-erin", follow) == "restored"


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu(), reason="needs a CUDA device: run with -m gpu on the GPU machine")
@pytest.mark.parametrize("case", ["continues", "bad page", "failed transfer"])
def test_streamed_restore_on_the_gpu(tiny_model, tmp_path, monkeypatch, case):
    """The three engine cases above on the GPU backend, where a run's transfer is a real
    host-to-device copy out of its slot (no host copy first) and the scatter lands in HBM."""
    if case == "continues":
        test_a_restore_through_a_small_arena_continues_identically(tiny_model, tmp_path)
    elif case == "bad page":
        test_a_failed_streamed_restore_gives_its_pool_pages_back(tiny_model, tmp_path)
    else:
        test_a_failed_device_transfer_is_a_miss_not_corruption(tiny_model, tmp_path, monkeypatch)
