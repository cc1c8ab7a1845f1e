"""Export and import of a stored state on the engine thread, on the real embedded model: the
exported bytes come back bit for bit, a continuation from the imported state equals one from a
state that never left, and a later export reads only the pages not already hashed."""
from __future__ import annotations

import numpy as np
import pytest

from engine.runtime.checkpoint_io import PageDigests, export_snapshot, import_snapshot
from engine.runtime.prefix import token_key
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


def test_eviction_saves_an_unsaved_session_head_and_restore_installs_it(tiny_model, engine,
                                                                        tmp_path):
    import time

    from server.checkpoints.manager import Checkpointer
    from server.checkpoints.store import CheckpointStore

    store = CheckpointStore(tmp_path / "ck", quota_bytes=1 << 30)
    fp = {"test": 1}
    ck = Checkpointer(store, fp, autosave=False)
    ck.attach(engine)
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
        engine.mem.before_evict = None
        ck._jobs.put(None)
        store.close()
