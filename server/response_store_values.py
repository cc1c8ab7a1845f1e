"""The values the response store keeps and their integrity: records, history entries, token-id
blobs, the content hash that matches an echoed output item to the stored one; a hash stored
with each row and checked whenever the row is read, a quick check of the whole file when the
server starts, and the names of the storage failures a route answers (full disk, I/O error,
corruption).

SQLite checks its own structure (pages, B-trees, `PRAGMA quick_check`) but not the bytes of a
value: a flipped byte inside a stored item's JSON or its token ids reads back as valid data. So
every row of `responses`, `input_items` and `output_items` carries `row_hash`, a BLAKE2b-128 of
its columns (`COLUMNS`) as SQLite returns them, computed by the SQL function `ninfer_row_hash`
after each write; a read that finds a different value raises `StoreCorrupt` naming the table
and the response, never a row's content.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import sys
import time
from array import array
from dataclasses import dataclass, field


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


@dataclass(frozen=True)
class ResponseRecord:
    """One stored response. `output_token_ids[i]` are the ids the model produced for
    `output_items[i]` (None where none are known)."""
    id: str
    principal: str
    model: str
    status: str
    input_items: list[dict]
    output_items: list[dict]
    output_token_ids: list[list[int] | None]
    created_at: float = field(default_factory=time.time)
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    instructions: str | None = None
    params: dict = field(default_factory=dict)
    usage: dict | None = None
    prompt_tokens: int = 0
    # The prompt's token ids: all of them, or (extends_parent) only those after the parent's
    # token sequence. None when unknown.
    prompt_token_ids: list[int] | None = None
    extends_parent: bool = False


@dataclass(frozen=True)
class HistoryEntry:
    """One item of a rebuilt conversation; `token_ids` only for output items."""
    response_id: str
    kind: str  # "input" | "output"
    item: dict
    token_ids: list[int] | None


# ---- encodings ---------------------------------------------------------------------------------
def pack_token_ids(ids) -> bytes:
    """Token ids -> little-endian int32 bytes. Raises ValueError outside the int32 range."""
    try:
        a = array("i", ids)
    except OverflowError as e:
        raise ValueError(f"token id out of int32 range: {e}") from None
    if a.itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte int
        raise RuntimeError("array('i') is not 32 bits on this platform")
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def unpack_token_ids(blob: bytes) -> list[int]:
    a = array("i")
    a.frombytes(blob)
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    return a.tolist()


def compact_json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _texts(parts) -> list:
    if isinstance(parts, str):
        return [parts]
    if not isinstance(parts, list):
        return []
    return [p.get("text", p.get("refusal")) if isinstance(p, dict) else p for p in parts]


def item_content_hash(item: dict) -> str:
    """A hash of what an output item says, blind to what clients change when they echo it:
    ids, status, annotations, logprobs and content-part type names are left out. A `message`
    is (role, texts), a `function_call` (call_id, name, arguments), a `reasoning` item its
    `encrypted_content` when it has one, else its summary and content texts; any other type is
    its JSON without `id` and `status`."""
    kind = item.get("type", "message")
    if kind == "message":
        canon = {"type": kind, "role": item.get("role"), "text": _texts(item.get("content"))}
    elif kind == "function_call":
        canon = {"type": kind, "call_id": item.get("call_id"), "name": item.get("name"),
                 "arguments": item.get("arguments")}
    elif kind == "reasoning" and isinstance(item.get("encrypted_content"), str):
        # the sealed token ids say it all; clients may echo it without the texts
        canon = {"type": kind, "encrypted_content": item["encrypted_content"]}
    elif kind == "reasoning":
        canon = {"type": kind, "summary": _texts(item.get("summary")),
                 "content": _texts(item.get("content"))}
    else:
        canon = {k: v for k, v in item.items() if k not in ("id", "status")}
    digest = hashlib.sha256(json.dumps(canon, sort_keys=True, ensure_ascii=False,
                                       separators=(",", ":")).encode()).hexdigest()
    return f"sha256:{digest}"


def input_item_ids(items: list[dict]) -> list[str]:
    """The listing id of each input item: its own `id` when it has a unique one, else a new
    one (clients send function_call and message items without ids)."""
    seen, out = set(), []
    for item in items:
        own = item.get("id") if isinstance(item, dict) else None
        if not isinstance(own, str) or not own or own in seen:
            own = f"item_{secrets.token_hex(16)}"
        seen.add(own)
        out.append(own)
    return out
