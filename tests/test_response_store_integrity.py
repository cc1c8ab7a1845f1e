"""The response store's row hashes (server/response_store_values.py): a byte changed in any
stored row is caught by every read that returns it; a store written before the hashes existed
(schema version 2) is migrated with its rows hashed as they are; and a damaged file is refused
when it is opened."""
from __future__ import annotations

import sqlite3
from dataclasses import replace

import pytest

from server.response_store import ResponseStore, StoreCorrupt, StoreError
from server.response_store_values import fault_kind
from server.response_store_schema import SCHEMA_VERSION
from tests.faultfs import flip_text, smash_table_root
from tests.test_response_store import make, turn


@pytest.fixture
def db(tmp_path):
    return tmp_path / "responses.db"


def _tamper(db, sql: str) -> None:
    """Change stored bytes behind the store's back (as a bad disk would: no hash update)."""
    conn = sqlite3.connect(db)
    conn.execute(sql)
    conn.commit()
    conn.close()


@pytest.mark.parametrize("sql, reads", [
    ("UPDATE input_items SET item = replace(item, 'question', 'questiom') "
     "WHERE response_id = 'r1'", ("get", "history", "input_items")),
    ("UPDATE output_items SET token_ids = x'01000000' WHERE response_id = 'r1'",
     ("get", "history", "tokens", "replay")),
    ("UPDATE responses SET instructions = 'be long' WHERE id = 'r1'",
     ("get", "history", "tokens")),
    ("UPDATE responses SET previous_response_id = 'r0' WHERE id = 'r2'", ("history",)),
])
def test_a_changed_row_is_caught_by_every_read_of_it(db, sql, reads):
    s = ResponseStore(db)
    s.put_response(replace(make("r1", tokens=[5, 6]), prompt_token_ids=[1, 2]))
    s.put_response(replace(make("r2", prev="r1"), prompt_token_ids=[3], extends_parent=True))
    s.close()
    _tamper(db, sql)
    s = ResponseStore(db)
    calls = {"get": lambda: s.get("alice", "r1"),
             "history": lambda: s.history("alice", "r2"),
             "input_items": lambda: s.list_input_items("alice", "r1"),
             "tokens": lambda: s.token_sequence("alice", "r1"),
             "replay": lambda: s.token_ids_for_item("alice", item_id="msg_r1")}
    for name in reads:
        with pytest.raises(StoreCorrupt) as e:
            calls[name]()
        assert fault_kind(e.value) == "corrupt"
        assert "question" not in str(e.value)  # names the row, never its content
    s.close()


def test_a_version_2_store_is_migrated_and_its_rows_hashed(db):
    s = ResponseStore(db)
    for rid, prev in (("r1", None), ("r2", "r1")):
        s.put_response(make(rid, prev=prev))
    s.close()
    conn = sqlite3.connect(db)  # back to what a version-2 server left: no hashes at all
    conn.execute("PRAGMA secure_delete = ON")  # (the old rows leave no copy behind)
    for table in ("responses", "input_items", "output_items"):
        conn.execute(f"ALTER TABLE {table} DROP COLUMN row_hash")
    conn.execute("DELETE FROM schema_version WHERE version = 3")
    conn.commit()
    conn.close()
    s = ResponseStore(db)
    assert s.history("alice", "r2") == turn("r1") + turn("r2")
    assert s._conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == \
        SCHEMA_VERSION == 3
    assert s._conn.execute("SELECT COUNT(*) FROM output_items WHERE row_hash IS NULL"
                           ).fetchone()[0] == 0
    s.close()
    flip_text(db, b"answer of r1")
    s = ResponseStore(db)
    with pytest.raises(StoreCorrupt):
        s.get("alice", "r1")
    assert s.get("alice", "r2") is not None  # the rest is served
    s.close()


def test_a_smashed_page_is_refused_at_open_with_what_to_do(db):
    s = ResponseStore(db)
    for i in range(40):
        s.put_response(make(f"r{i}", key=f"k{i}", text="x" * 2000))
    s.close()
    smash_table_root(db, "input_items")
    with pytest.raises(StoreError, match="refusing to start.*move it aside"):
        ResponseStore(db)
