"""Export and import of a stored state on the engine thread, on the real embedded model: the
exported bytes come back bit for bit, a continuation from the imported state equals one from a
state that never left, and a later export reads only the pages not already hashed."""
from __future__ import annotations

import numpy as np
import pytest

from engine.runtime.checkpoint_io import (RUN_PAGES, PageDigests, StagedPages, _chunks,
                                          export_snapshot, import_snapshot, page_spec,
                                          stage_pages)
from engine.runtime.memory import token_key
from tests.test_engine_reuse import make_engine, meaningful, perturbed, run, turn


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = make_engine(tiny_model)
    yield eng
    eng.stop()


def snap_in(e, principal, tokens):  # on the engine thread
    return e.mem.index.get(principal, token_key(principal, tokens))


def snapshot_of(eng, principal, tokens):
    return eng.call(lambda e: snap_in(e, principal, tokens)).result()


def test_export_import_is_bit_exact_and_continues_identically(tiny_model, engine):
    p1 = turn(tiny_model, "Write a function that merges two sorted lists. " * 12)
    outs = {}
    for who in ("alice", "bob"):  # the same history twice: bob's state never leaves
        outs[who], _ = run(engine, p1, who, max_tokens=16)
    assert outs["alice"] == outs["bob"]
    fed = p1 + outs["alice"][:-1]
    digests = PageDigests()
    exp = engine.call(lambda e: export_snapshot(e.mem, snap_in(e, "alice", fed), digests,
                                                session="s")).result()
    assert exp.num_tokens == len(fed) > 64 and all(p is not None for p in exp.pages)
    # the partial last page's slots past the frontier are zeros in every array (so a page's
    # bytes are a function of the state), and the full pages are not all zeros
    spec = engine.call(lambda e: page_spec(e.mem.cache.pool)).result()
    used = len(fed) - (len(exp.pages) - 1) * 64
    staged = stage_pages(spec, exp.pages)
    for a in staged.arrays:
        assert not a[-1][:, used:].any() and a[0].any()
    # drop alice's state, then install it from the exported bytes
    engine.call(lambda e: e.mem.forget("alice", token_key("alice", fed))).result()
    assert snapshot_of(engine, "alice", fed) is None
    pages = list(exp.pages)
    snap = engine.call(lambda e: import_snapshot(e.mem, "alice", "s", exp.tokens, pages,
                                                 exp.conv, exp.rec)).result()
    assert snap is not None and snap.from_disk
    again = engine.call(lambda e: export_snapshot(e.mem, snap)).result()
    assert again.pages == exp.pages
    assert again.conv.tobytes() == exp.conv.tobytes() and again.rec.tobytes() == exp.rec.tobytes()
    p2 = fed + turn(tiny_model, "Now make it handle duplicates.")
    a2, da = run(engine, p2, "alice")
    b2, db = run(engine, p2, "bob")
    assert da.path == "disk-restored" and db.path == "continuation"
    assert da.cached_tokens == db.cached_tokens == len(fed)
    assert a2 == b2 and meaningful(a2)
    # negative control: a different history gives a different continuation
    c2, _ = run(engine, perturbed(p2, 5), "carol")
    assert c2 != a2
    # a second export after the turn reads only the pages that are new since the first
    fed2 = p2 + a2[:-1]
    exp2 = engine.call(lambda e: export_snapshot(e.mem, snap_in(e, "bob", fed2),
                                                 digests)).result()
    assert sum(p is None for p in exp2.pages) == 0  # bob's pages were never hashed
    exp.digests[:] = [f"{i:064x}" for i in range(len(exp.pages))]  # as the saver fills them
    snap_b = snapshot_of(engine, "bob", fed)
    engine.call(lambda e: digests.remember(snap_b, exp)).result()
    exp3 = engine.call(lambda e: export_snapshot(e.mem, snap_in(e, "bob", fed2),
                                                 digests)).result()
    full = len(fed) // 64
    assert [p is None for p in exp3.pages[:full]] == [True] * full
    assert all(p is not None for p in exp3.pages[full:])
    assert np.array_equal(exp3.tokens, np.asarray(fed2, np.int32))


def test_eviction_saves_an_unsaved_session_head_and_restore_installs_it(tiny_model, tmp_path):
    import time

    from server.checkpoints.manager import Checkpointer
    from server.checkpoints.checkpoint_store import CheckpointStore

    store = CheckpointStore(tmp_path / "ck", quota_bytes=1 << 30)
    fp = {"test": 1}
    ck = Checkpointer(store, autosave=False)
    engine = make_engine(tiny_model, hooks=ck.engine_hooks())  # the evict hook: built in
    ck.attach(engine, fp)
    try:
        p = turn(tiny_model, "Explain cache eviction in one paragraph. " * 8)
        out, _ = run(engine, p, "erin", max_tokens=16)
        fed = p + out[:-1]
        ck.after_response("erin", "session-of-erin", "resp_e", fed)  # autosave off: not saved
        assert store.load("erin", "session-of-erin", fp, fed + [1]).state == "missing"
        while snapshot_of(engine, "erin", fed) is not None:  # the runtime needs the room
            assert engine.call(lambda e: e.mem._evict_one()).result()
        deadline = time.monotonic() + 60
        while store.load("erin", "session-of-erin", fp, fed + [1]).state != "available":
            assert time.monotonic() < deadline, "the evicted head was not saved"
            time.sleep(0.1)
        assert ck.restore_for("erin", "session-of-erin", fed + [1, 2]) == "restored"
        assert snapshot_of(engine, "erin", fed).from_disk
        assert ck.restore_for("erin", "session-of-erin", fed + [1, 2]) is None  # resident
    finally:
        ck._jobs.put(None)
        engine.stop()
        store.close()


def test_staging_layout_and_power_of_two_chunks():
    """No engine: StagedPages' per-page views concatenate to the page's bytes, stage_pages
    copies pages into the same layout, and the scatter runs cover n pages exactly: runs of
    RUN_PAGES, then the rest in power-of-two runs."""
    for n in (1, 2, 5, 64, 127, 128, 1025, 2048):
        runs = _chunks(n)
        assert runs[0][0] == 0 and runs[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
        assert all((e - s) & (e - s - 1) == 0 for s, e in runs)  # powers of two
        assert max(e - s for s, e in runs) <= RUN_PAGES
        assert len(runs) == n // RUN_PAGES + bin(n % RUN_PAGES).count("1")
    spec = [((2, 4, 3), np.dtype(np.float32)), ((2, 4, 3), np.dtype(np.float32)),
            ((2, 4), np.dtype(np.float16))]
    page_bytes = 2 * 96 + 16
    rng = np.random.default_rng(0)
    pages = [rng.integers(0, 256, page_bytes, np.uint8).tobytes() for _ in range(3)]
    staged = stage_pages(spec, pages)
    assert [a.shape for a in staged.arrays] == [(3, 2, 4, 3), (3, 2, 4, 3), (3, 2, 4)]
    for i, p in enumerate(pages):
        assert b"".join(bytes(v) for v in staged.views(i)) == p
        assert staged.arrays[1][i].tobytes() == p[96:192]
    made = StagedPages.layout(spec)(3, page_bytes)
    assert made is not None and len(made[1]) == 3
    assert StagedPages.layout(spec)(3, page_bytes + 1) is None
    # with the store's page-aligned allocator (as the checkpoint manager lays pages out), a
    # page whose slices are whole 4 KiB blocks gets views the store can read with O_DIRECT
    from server.checkpoints.files import _direct_ok, aligned_bytes

    big = [((4, 256), np.dtype(np.float32)), ((4, 256), np.dtype(np.float32))]
    staged_al, views = StagedPages.layout(big, aligned_bytes)(3, 2 * 4096)
    assert all(_direct_ok(v) for v in views)
    assert not _direct_ok([memoryview(bytearray(4097))[1:]])  # 4 KiB, but not aligned
    with pytest.raises(ValueError):
        stage_pages(spec, [b"x" * 7])


def test_verified_pages_start_their_runs_transfer():
    """page_ready: a run's host-to-device transfer starts when its last page is reported,
    not before; to_device starts the rest; the device runs hold the staged bytes."""
    spec = [((2, 3), np.dtype(np.float32)), ((2, 3), np.dtype(np.float32))]
    n = RUN_PAGES + 3  # runs: [0, 128), [128, 130), [130, 131)
    rng = np.random.default_rng(1)
    page_bytes = 2 * 24
    staged = stage_pages(spec, [rng.integers(0, 256, page_bytes, np.uint8).tobytes()
                                for _ in range(n)])
    assert staged.runs == [(0, RUN_PAGES), (RUN_PAGES, RUN_PAGES + 2), (n - 1, n)]
    for i in range(RUN_PAGES - 1):
        staged.page_ready(i)
    assert staged._started == [None, None, None]
    staged.page_ready(RUN_PAGES - 1)
    staged.page_ready(n - 1)
    assert staged._started[0] is not None and staged._started[1] is None
    assert staged._started[2] is not None
    first = staged._started[0]
    staged.to_device()
    assert staged.device_chunks[0] is first  # not put twice
    for (start, stop), arrays in zip(staged.runs, staged.device_chunks):
        for dev, host in zip(arrays, staged.arrays):
            np.testing.assert_array_equal(np.asarray(dev), host[start:stop])


def test_prepared_restore_traces_nothing_on_its_way(tiny_model):
    """After prepare_restore, importing a state of several runs (its scatter shapes among
    them), installing its image and continuing from it trace and lower none of the functions
    prepared: the first restore of a process pays no compile. The pool's size is this test's own, so no
    earlier test compiled these shapes."""
    import jax

    from engine.runtime.checkpoint_io import prepare_restore

    traced = []

    def on_duration(event, duration, **kw):  # a trace, or a lowering of a traced jaxpr
        if recording and event in ("/jax/core/compile/jaxpr_trace_duration",
                                   "/jax/core/compile/jaxpr_to_mlir_module_duration"):
            traced.append(str(kw.get("fun_name")))
    recording = False
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    eng = make_engine(tiny_model, capacity_tokens=8192 + 64 * 7, state_slots=7)
    try:
        prepared = eng.call(lambda e: prepare_restore(e.mem)).result()
        assert prepared == len({b - a for a, b in _chunks(2 * RUN_PAGES - 1)}) + 3
        p1 = turn(tiny_model, "Explain the borrow checker in three short points. " * 14)
        out, _ = run(eng, p1, "alice", max_tokens=8)
        fed = p1 + out[:-1]
        exp = eng.call(lambda e: export_snapshot(e.mem, snap_in(e, "alice", fed))).result()
        eng.call(lambda e: e.mem.forget("alice", token_key("alice", fed))).result()
        spec = eng.call(lambda e: page_spec(e.mem.cache.pool)).result()
        recording = True
        staged = stage_pages(spec, list(exp.pages)).to_device()  # as a restore's load does
        snap = eng.call(lambda e: import_snapshot(e.mem, "alice", "s", exp.tokens, staged,
                                                  exp.conv, exp.rec)).result()
        a2, da = run(eng, fed + turn(tiny_model, "Shorter."), "alice", max_tokens=4)
        recording = False
        assert snap is not None and da.path == "disk-restored" and len(a2) == 4
        assert len(_chunks(len(exp.pages))) >= 2  # several run shapes were scattered
        prepared_names = ("_scatter", "write_slot", "restore_to_row", "copy_pages", "stage")
        assert not [t for t in traced if any(p in t for p in prepared_names)], traced
    finally:
        recording = False
        eng.stop()
