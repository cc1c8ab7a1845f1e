"""The durable response store (server/response_store.py): chains across restarts and a SIGKILL,
principal and session isolation, forks and rollback, non-cascading delete, input-item paging
against a model, exact token ids, and deleted content gone from the file's bytes."""
from __future__ import annotations

import dataclasses
import os
import random
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.response_store import (InvalidCursor, ResponseRecord, ResponseStore, StoreError,
                                   item_content_hash, pack_token_ids)
from server.response_store_schema import MIGRATIONS, SCHEMA_VERSION, connect

REPO = Path(__file__).resolve().parents[1]


def out_msg(text: str, item_id: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def make(rid: str, *, principal="alice", prev=None, key="sess-1", text=None, tokens=None,
         created_at=None, instructions="be brief", inputs=None) -> ResponseRecord:
    text = text or f"question of {rid}"
    return ResponseRecord(
        id=rid, principal=principal, model="m", status="completed",
        input_items=inputs or [{"type": "message", "role": "user", "content": text}],
        output_items=[out_msg(f"answer of {rid}", f"msg_{rid}")],
        output_token_ids=[tokens if tokens is not None else [len(rid), 7, 11]],
        created_at=time.time() if created_at is None else created_at,
        previous_response_id=prev, prompt_cache_key=key, instructions=instructions,
        params={"tools": [{"type": "function", "name": "read"}], "reasoning": {"effort": "low"},
                "temperature": 0.7},
        usage={"input_tokens": 10, "output_tokens": 3}, prompt_tokens=10)


def turn(rid: str) -> list:
    """The items one stored response contributes to a history."""
    return [{"type": "message", "role": "user", "content": f"question of {rid}"},
            out_msg(f"answer of {rid}", f"msg_{rid}")]


def file_bytes(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))


@pytest.fixture
def db(tmp_path) -> Path:
    return tmp_path / "store" / "responses.db"


@pytest.fixture
def store(db):
    s = ResponseStore(db)
    yield s
    s.close()


# ---- durability --------------------------------------------------------------------------------
def test_chain_resolves_after_reopen(db):
    s = ResponseStore(db)
    s.put_response(make("r1"))
    s.put_response(make("r2", prev="r1", tokens=[2**31 - 1, -2**31, 0]))
    s.put_response(make("r3", prev="r2", key=None))
    s.close()
    s = ResponseStore(db)
    assert s.history("alice", "r3") == turn("r1") + turn("r2") + turn("r3")
    assert s.continuation("alice", "r3", "sess-1").previous_response_id == "r2"
    rec = s.get("alice", "r2")
    assert rec == make("r2", prev="r1", tokens=[2**31 - 1, -2**31, 0], created_at=rec.created_at)
    assert s.token_ids_for_item("alice", item_id="msg_r2") == [2**31 - 1, -2**31, 0]
    s.close()


def crash_record(i: int) -> ResponseRecord:
    """Record i of the crash writer: chains of 10 per session, sizes varied to span pages."""
    text = f"turn {i} " + "x" * (i * 997 % 20000)
    return ResponseRecord(
        id=f"resp_{i:06d}", principal="p", model="m", status="completed",
        input_items=[{"role": "user", "content": text}, {"role": "user", "content": str(i)}],
        output_items=[out_msg(text[::-1], f"msg_{i:06d}"), out_msg("tail", f"msg_{i:06d}b")],
        output_token_ids=[list(range(i, i + i * 31 % 3000)), [i]], created_at=float(i),
        previous_response_id=f"resp_{i - 1:06d}" if i % 10 else None,
        prompt_cache_key=f"s{i // 10}", params={"i": i})


CRASH_WRITER = """
import sys
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests"]
from server.response_store import ResponseStore
from test_response_store import crash_record
store = ResponseStore(sys.argv[1])
for i in range(int(sys.argv[3]), 10**6):
    store.put_response(crash_record(i))
    print(i, flush=True)
"""


def test_sigkill_mid_write_keeps_every_committed_response(db):
    start, acked = 0, []
    for rounds in range(1, 4):  # three writers, each killed mid-loop, continuing the same file
        child = subprocess.Popen([sys.executable, "-c", CRASH_WRITER, str(db), str(REPO),
                                  str(start)], stdout=subprocess.PIPE, text=True)
        for line in child.stdout:
            acked.append(int(line))
            if acked[-1] >= start + 40:
                break
        time.sleep(random.uniform(0, 0.02))  # land anywhere in the next commits
        child.send_signal(signal.SIGKILL)
        rest, _ = child.communicate()
        acked += [int(x) for x in rest.split()]
        assert child.returncode == -signal.SIGKILL
        s = ResponseStore(db)
        assert s._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        stored = sorted(int(r[0][5:]) for r in s._conn.execute("SELECT id FROM responses"))
        # Every acknowledged commit survived; beyond those, at most the one each writer had
        # committed but not yet printed when it was killed.
        unacked = set(stored) - set(acked)
        assert set(acked) <= set(stored) and len(unacked) <= rounds
        assert all(i - 1 in acked for i in unacked)
        for i in stored:
            assert s.get("p", f"resp_{i:06d}") == crash_record(i)
            assert len(s.history("p", f"resp_{i:06d}")) == 4 * (i % 10 + 1)
        s.close()
        start = (stored[-1] // 10 + 1) * 10
    assert len(acked) >= 120


def test_file_mode_0600_and_loose_file_refused(db, store):
    store.put_response(make("r1"))
    for p in db.parent.glob(db.name + "*"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    store.close()
    os.chmod(db, 0o644)
    with pytest.raises(StoreError, match="chmod 600"):
        ResponseStore(db)


def test_schema_version_and_migrations(db):
    conn = connect(db)
    assert conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    conn.close()
    later = MIGRATIONS + ((SCHEMA_VERSION + 1, ("CREATE TABLE later (x INTEGER)",)),)
    conn = connect(db, migrations=later)
    assert [r[0] for r in conn.execute("SELECT version FROM schema_version")] == \
        list(range(1, SCHEMA_VERSION + 2))
    conn.close()
    with pytest.raises(StoreError, match="newer"):
        connect(db)


def test_put_is_atomic(store):
    store.put_response(make("r1"))
    with pytest.raises(ValueError, match="already stored"):
        store.put_response(make("r1", text="other"))
    with pytest.raises(ValueError, match="another principal"):
        store.put_response(make("m1", principal="mallory", prev="r1"))
    with pytest.raises(ValueError, match="int32"):
        store.put_response(make("r2", tokens=[2**31]))
    with pytest.raises(ValueError, match="session"):
        store.put_response(make("r3", prev="r1", key="another-session"))
    names = [r[0] for r in store._conn.execute("SELECT name FROM principals")]
    assert names == ["alice"]  # mallory's principal row was rolled back with the rest
    assert store.history("alice", "r1") == turn("r1")
    assert [r[0] for r in store._conn.execute("SELECT id FROM responses")] == ["r1"]


def test_threads_share_the_store(store):
    errors = []

    def work(t):
        try:
            prev = None
            for i in range(20):
                rid = f"t{t}_{i}"
                store.put_response(make(rid, prev=prev, key=f"k{t}"))
                assert store.history("alice", rid)[-2:] == turn(rid)
                prev = rid
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(store.history("alice", "t3_19")) == 40


# ---- identity, sessions, lineage ---------------------------------------------------------------
def test_other_principal_sees_nothing(store):
    store.put_response(make("r1"))
    store.put_response(make("r2", prev="r1"))
    assert store.get("bob", "r1") is None
    assert store.history("bob", "r2") is None
    assert store.list_input_items("bob", "r1") is None
    assert store.continuation("bob", "r1", "sess-1") is None
    assert store.token_ids_for_item("bob", item_id="msg_r1") is None
    assert store.replay_token_ids("bob", out_msg("answer of r1", "msg_r1")) is None
    assert store.delete("bob", "r1") is False
    assert store.purge_session("bob", "sess-1") == 0
    assert store.prune(max_responses_per_principal=0) == 2  # alice's own retention still works
    store.put_response(make("b1", principal="bob", key="sess-1"))  # same key, other session
    assert store.history("bob", "b1") == turn("b1")
    assert store.get("alice", "b1") is None


def test_sessions(store):
    store.put_response(make("k1", key="sess-1"))
    assert store.continuation("alice", "k1", "sess-2") is None  # another session: refused
    assert store.continuation("alice", "k1", None).id == "k1"  # no key: joins the parent's
    store.put_response(make("k2", prev="k1", key=None))
    assert store.get("alice", "k2").prompt_cache_key == "sess-1"
    store.put_response(make("n1", key=None))  # keyless chain: its own session
    store.put_response(make("n2", key=None, prev="n1"))
    assert store.continuation("alice", "n2", "sess-1") is None
    assert store.purge_session("alice", root_response_id="n1") == 2
    assert store.get("alice", "n2") is None and store.get("alice", "k2") is not None
    with pytest.raises(ValueError):
        store.purge_session("alice")


def test_fork_and_rollback(store):
    store.put_response(make("a"))
    store.put_response(make("b", prev="a"))
    store.put_response(make("c", prev="b"))
    store.put_response(make("d", prev="b"))  # fork: a second child of b
    store.put_response(make("e", prev="a"))  # rollback: continue an older response
    assert store.history("alice", "c") == turn("a") + turn("b") + turn("c")
    assert store.history("alice", "d") == turn("a") + turn("b") + turn("d")
    assert store.history("alice", "e") == turn("a") + turn("e")
    entries = store.history_entries("alice", "d")
    assert [(e.response_id, e.kind) for e in entries] == [
        ("a", "input"), ("a", "output"), ("b", "input"), ("b", "output"),
        ("d", "input"), ("d", "output")]
    assert entries[3].token_ids == [1, 7, 11] and entries[2].token_ids is None


def test_delete_does_not_cascade(store):
    store.put_response(make("a"))
    store.put_response(make("b", prev="a"))
    store.put_response(make("c", prev="b"))
    assert store.delete("alice", "b") is True
    assert store.delete("alice", "b") is False  # already gone: answered like an unknown id
    assert store.get("alice", "b") is None
    assert store.continuation("alice", "b", "sess-1") is None  # -> previous_response_not_found
    assert store.list_input_items("alice", "b") is None
    assert store.token_ids_for_item("alice", item_id="msg_b") is None
    # The descendant still continues, its history intact through the deleted parent.
    assert store.get("alice", "c").previous_response_id == "b"
    store.put_response(make("d", prev="c"))
    assert store.history("alice", "d") == turn("a") + turn("b") + turn("c") + turn("d")
    assert store.history("alice", "a") == turn("a")
    store.delete("alice", "a")
    assert store.history("alice", "d")[:2] == turn("a")


# ---- deleted content leaves the file -----------------------------------------------------------
def test_delete_removes_content_bytes(db, store):
    secret = b"SECRET-4f1e9a"
    big = "SECRET-4f1e9a " * 5000  # spills into overflow pages
    store.put_response(make("a", text=big, instructions="SECRET-4f1e9a instr"))
    store.put_response(make("b", prev="a", instructions="SECRET-77c0 instr",
                            tokens=[991_234_567] * 50))
    store._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert secret in file_bytes(db)
    store.delete("alice", "a")  # b still needs a's items: only a's own settings go now
    data = file_bytes(db)
    assert b"SECRET-4f1e9a instr" not in data and secret in data
    assert store.history("alice", "b")[0]["content"] == big
    store.delete("alice", "b")  # no live descendant left: a's items and b go
    data = file_bytes(db)
    assert secret not in data and b"SECRET-77c0" not in data
    assert pack_token_ids([991_234_567] * 4) not in data
    assert store._conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 0
    assert store._conn.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] == 0


def test_purge_session_removes_content_bytes(db, store):
    store.put_response(make("a", text="PURGE-ME-1 " * 3000))
    store.put_response(make("b", prev="a", text="PURGE-ME-2"))
    store.delete("alice", "b")  # tombstones count too
    store.put_response(make("c", prev="a", text="PURGE-ME-3"))
    store.put_response(make("z", key="sess-keep", text="KEEP-ME"))
    assert store.purge_session("alice", "sess-1") == 2
    data = file_bytes(db)
    assert b"PURGE-ME" not in data and b"KEEP-ME" in data
    assert store.get("alice", "c") is None and store.history("alice", "z") is not None
    assert store.purge_session("alice", "sess-1") == 0


def test_prune_by_age_and_count(db, store):
    for i in range(5):
        store.put_response(make(f"a{i}", prev=f"a{i - 1}" if i else None, created_at=100 + i,
                                text=f"OLD-{i}"))
    store.put_response(make("x", key="other", created_at=101, text="LONE"))
    store.put_response(make("b0", principal="bob", created_at=50))
    assert store.prune(max_age_s=60, now=160) == 1  # bob's b0 only
    assert store.get("bob", "b0") is None
    assert store.prune(max_responses_per_principal=2) == 4  # a0..a2 and x
    assert [r for r in ("a0", "a1", "a2", "x", "a3", "a4")
            if store.get("alice", r)] == ["a3", "a4"]
    # The live head keeps its whole history; the lone pruned response's content is gone.
    assert store.history("alice", "a4")[0]["content"] == "OLD-0"
    assert b"LONE" not in file_bytes(db)


# ---- input items -------------------------------------------------------------------------------
def test_input_items_shape_and_errors(store):
    items = [{"type": "message", "role": "user", "content": "one", "id": "in_1"},
             {"type": "function_call_output", "call_id": "c1", "output": "two"},
             {"type": "message", "role": "user", "content": "three", "id": "in_1"}]
    store.put_response(make("r", inputs=items))
    page = store.list_input_items("alice", "r")
    assert page["object"] == "list" and page["has_more"] is False
    assert [d.get("content", d.get("output")) for d in page["data"]] == ["three", "two", "one"]
    assert page["last_id"] == "in_1" and page["first_id"] != "in_1"  # duplicate id renamed
    assert all(list(d)[0] == "id" for d in page["data"])
    assert store.get("alice", "r").input_items == items  # stored exactly as sent
    with pytest.raises(InvalidCursor):
        store.list_input_items("alice", "r", after="nope")
    for bad in (0, 101, True):
        with pytest.raises(ValueError):
            store.list_input_items("alice", "r", limit=bad)
    with pytest.raises(ValueError):
        store.list_input_items("alice", "r", order="up")


def test_input_items_paging_matches_model(tmp_path):
    s = ResponseStore(tmp_path / "paging.db")
    counter = iter(range(10**9))

    @settings(max_examples=150, deadline=None)
    @given(kinds=st.lists(st.sampled_from(["own", "none", "dup"]), max_size=25),
           limit=st.integers(1, 8) | st.integers(1, 100),
           order=st.sampled_from(["asc", "desc"]), after=st.none() | st.integers(0, 24))
    def check(kinds, limit, order, after):
        rid = f"resp_{next(counter)}"
        items, own = [], []
        for k, kind in enumerate(kinds):
            item = {"type": "message", "role": "user", "content": f"c{k}"}
            if kind == "own" or (kind == "dup" and own):
                item["id"] = f"own_{k}" if kind == "own" else own[-1]
                own.append(item["id"])
            items.append(item)
        s.put_response(make(rid, inputs=items or None))
        items = items or make(rid).input_items
        full = s.list_input_items("alice", rid, limit=100, order="asc")["data"]
        assert [d["content"] for d in full] == [it["content"] for it in items]
        ids = [d["id"] for d in full]
        assert len(set(ids)) == len(ids)
        for k, (it, listed) in enumerate(zip(items, ids)):
            first = "id" in it and it["id"] not in [x.get("id") for x in items[:k]]
            assert listed == it["id"] if first else re.fullmatch(r"item_[0-9a-f]{32}", listed)
        # The model: the ids in the requested order, from just after the cursor.
        seq = ids if order == "asc" else ids[::-1]
        cursor = ids[after] if after is not None and after < len(ids) else None
        rest = seq[seq.index(cursor) + 1:] if cursor else seq
        page = s.list_input_items("alice", rid, after=cursor, limit=limit, order=order)
        assert [d["id"] for d in page["data"]] == rest[:limit]
        assert page["has_more"] == (len(rest) > limit)
        assert page["first_id"] == (rest[0] if rest else None)
        assert page["last_id"] == (rest[:limit][-1] if rest else None)
        walked, cur = [], None  # following last_id visits every item once
        while True:
            page = s.list_input_items("alice", rid, after=cur, limit=limit, order=order)
            walked += [d["id"] for d in page["data"]]
            if not page["has_more"]:
                break
            cur = page["last_id"]
        assert walked == seq

    check()
    s.close()


# ---- exact token ids ---------------------------------------------------------------------------
def test_token_ids_round_trip(tmp_path):
    s = ResponseStore(tmp_path / "tokens.db")
    counter = iter(range(10**9))
    int32 = st.integers(-2**31, 2**31 - 1)

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.none() | st.lists(int32, max_size=300), min_size=1, max_size=4))
    def check(per_item):
        rid = f"r{next(counter)}"
        outputs = [out_msg(f"{rid} item {k}", f"msg_{rid}_{k}") for k in range(len(per_item))]
        s.put_response(ResponseRecord(id=rid, principal="alice", model="m", status="completed",
                                      input_items=[{"role": "user", "content": "hi"}],
                                      output_items=outputs, output_token_ids=per_item))
        assert s.get("alice", rid).output_token_ids == per_item
        for k, ids in enumerate(per_item):
            assert s.token_ids_for_item("alice", item_id=f"msg_{rid}_{k}") == ids
        assert [e.token_ids for e in s.history_entries("alice", rid)[1:]] == per_item

    check()
    s.close()


def test_replay_matches_echoed_items(store):
    call = {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "call_9",
            "name": "read", "arguments": '{"path": "a.py"}'}
    store.put_response(ResponseRecord(
        id="r1", principal="alice", model="m", status="completed",
        input_items=[{"role": "user", "content": "hi"}],
        output_items=[out_msg("Let me look.", "msg_1"), call],
        output_token_ids=[[5, 6, 7], [8, 9]]))
    # Clients echo a message without status/annotations and a function_call without its id.
    echoed_msg = {"id": "msg_1", "type": "message", "role": "assistant",
                  "content": [{"type": "output_text", "text": "Let me look."}]}
    echoed_call = {k: v for k, v in call.items() if k not in ("id", "status")}
    assert store.replay_token_ids("alice", echoed_msg) == [5, 6, 7]
    assert store.replay_token_ids("alice", {**echoed_msg, "id": "msg_unknown"}) == [5, 6, 7]
    assert store.replay_token_ids("alice", echoed_call) == [8, 9]
    assert store.token_ids_for_item("alice", content_hash=item_content_hash(call)) == [8, 9]
    edited = {**echoed_msg, "content": [{"type": "output_text", "text": "Let me see."}]}
    assert store.replay_token_ids("alice", edited) is None  # same id, other text: re-tokenize
    assert store.replay_token_ids("bob", echoed_call) is None
    store.delete("alice", "r1")
    assert store.replay_token_ids("alice", echoed_msg) is None
    with pytest.raises(ValueError):
        store.token_ids_for_item("alice")


def test_store_survives_sqlite_read_by_another_connection(db, store):
    store.put_response(make("r1"))
    other = sqlite3.connect(db)  # e.g. an operator's read-only inspection
    assert other.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 1
    other.close()
    assert store.delete("alice", "r1")


def test_token_sequence_follows_the_chain(store):
    store.put_response(dataclasses.replace(make("t1", tokens=[5, 6]), prompt_token_ids=[1, 2, 3]))
    store.put_response(dataclasses.replace(make("t2", prev="t1", tokens=[9]),
                                           prompt_token_ids=[7, 8], extends_parent=True))
    store.put_response(dataclasses.replace(make("t3", prev="t1", tokens=[4]),
                                           prompt_token_ids=[1, 2, 3, 0], extends_parent=False))
    assert store.token_sequence("alice", "t1") == [1, 2, 3, 5, 6]
    assert store.token_sequence("alice", "t2") == [1, 2, 3, 5, 6, 7, 8, 9]
    assert store.token_sequence("alice", "t3") == [1, 2, 3, 0, 4]
    assert store.token_sequence("mallory", "t2") is None
    store.put_response(make("t4"))  # no prompt ids known
    assert store.token_sequence("alice", "t4") is None
