"""The response store's integrity: a hash stored with each row and checked whenever the row is
read, a quick check of the whole file when the server starts, and the names of the storage
failures a route answers (full disk, I/O error, corruption).

SQLite checks its own structure (pages, B-trees, `PRAGMA quick_check`) but not the bytes of a
value: a flipped byte inside a stored item's JSON or its token ids reads back as valid data. So
every row of `responses`, `input_items` and `output_items` carries `row_hash`, a BLAKE2b-128 of
its columns (`COLUMNS`) as SQLite returns them, computed by the SQL function `ninfer_row_hash`
after each write; a read that finds a different value raises `StoreCorrupt` naming the table
and the response, never a row's content.
"""
from __future__ import annotations

import hashlib
import sqlite3

HASH_FUNCTION = "ninfer_row_hash"

# The hashed columns of each table that holds what a client reads back, in hash order
# (every column but row_hash; principals and sessions hold only names and times).
COLUMNS = {
    "responses": ("id", "principal_id", "session_id", "previous_response_id", "created_at",
                  "status", "model", "instructions", "params", "usage", "prompt_tokens",
                  "deleted_at", "prompt_token_ids", "extends_parent"),
    "input_items": ("response_id", "position", "item_id", "item"),
    "output_items": ("response_id", "position", "item_id", "content_hash", "item", "token_ids"),
}

# sqlite3 primary result codes (sqlite3.h)
_KINDS = {13: "full", 10: "io", 14: "io", 8: "io", 15: "io", 11: "corrupt", 26: "corrupt"}


class StoreCorrupt(sqlite3.DatabaseError):
    """A stored row whose bytes differ from what was written."""

    def __init__(self, table: str, response_id: str | None):
        super().__init__(f"a row of {table} (response {response_id}) failed its integrity "
                         "check")
        self.table, self.response_id = table, response_id


def row_hash(*values) -> bytes:
    """The hash of one row's values: each typed and length-prefixed, so no two rows collide
    by moving bytes between columns."""
    h = hashlib.blake2b(digest_size=16)
    for v in values:
        if v is None:
            tag, data = b"N", b""
        elif isinstance(v, bool) or isinstance(v, int):
            tag, data = b"I", str(int(v)).encode()
        elif isinstance(v, float):
            tag, data = b"F", v.hex().encode()
        elif isinstance(v, str):
            tag, data = b"T", v.encode("utf-8", "surrogatepass")
        else:
            tag, data = b"B", bytes(v)
        h.update(tag + len(data).to_bytes(8, "little") + data)
    return h.digest()


def register(conn: sqlite3.Connection) -> None:
    conn.create_function(HASH_FUNCTION, -1, row_hash, deterministic=True)


def hash_expr(table: str) -> str:
    """SQL computing a row's hash from its stored columns."""
    return f"{HASH_FUNCTION}({', '.join(COLUMNS[table])})"


def rehash(c: sqlite3.Connection, table: str, where: str, args: tuple = ()) -> None:
    """Set row_hash of the rows `where` selects from their values as stored."""
    c.execute(f"UPDATE {table} SET row_hash = {hash_expr(table)} WHERE {where}", args)


def check(table: str, row: sqlite3.Row) -> None:
    """Raise StoreCorrupt unless `row` (which must hold the table's hashed columns and
    row_hash) hashes to its stored hash."""
    if row["row_hash"] != row_hash(*(row[c] for c in COLUMNS[table])):
        rid = row["id"] if table == "responses" else row["response_id"]
        raise StoreCorrupt(table, rid if isinstance(rid, str) else None)


def quick_check(conn: sqlite3.Connection) -> list[str]:
    """What `PRAGMA quick_check` found wrong (empty when the file is sound)."""
    rows = [r[0] for r in conn.execute("PRAGMA quick_check(20)").fetchall()]
    return [] if rows == ["ok"] else rows


def fault_kind(exc: BaseException) -> str | None:
    """'full', 'io' or 'corrupt' for a storage failure, None for anything else."""
    if isinstance(exc, StoreCorrupt):
        return "corrupt"
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None:
            return _KINDS.get(code & 0xFF)
        text = str(exc).lower()
        if "disk is full" in text:
            return "full"
        if "malformed" in text or "not a database" in text:
            return "corrupt"
        if "disk i/o" in text:
            return "io"
    return None


# Version 3: the row hashes, computed for the rows an older server wrote.
V3 = tuple(f"ALTER TABLE {t} ADD COLUMN row_hash BLOB" for t in COLUMNS) + tuple(
    f"UPDATE {t} SET row_hash = {hash_expr(t)}" for t in COLUMNS)
