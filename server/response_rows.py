"""One session's rows of the response store, out of one database and into another (a session
bundle's `responses.json`, server/checkpoints/transfer.py).

Export reads the session's responses (tombstones included: a live descendant's history runs
through them), their input and output items, with the columns the schema has, from a read-only
connection (the serving process may hold the database meanwhile: WAL readers never block).
Import inserts them into another store in one transaction, under that store's own principal and
session ids; `check_import` finds every reason to refuse (another schema, a response id the
receiver already holds) before anything is written.

Row hashes (server/response_store_values.py): every exported row is checked against its
hash first (a damaged row is not carried away as if it were sound), and the receiver hashes the
rows it inserted as they are stored there (its own principal and session ids are part of a
response row's hash), so `row_hash` itself does not travel.
"""
from __future__ import annotations

import base64
import json
import sqlite3
import time
from pathlib import Path

from server.response_store_values import check, rehash
from server.response_store_schema import SCHEMA_VERSION, schema_version

_BLOBS = {"prompt_token_ids", "token_ids"}
_SKIP = {"principal_id", "session_id", "row_hash"}  # the receiver's own replace them


def _row(row: sqlite3.Row, table: str) -> dict:
    check(table, row)
    out = {}
    for k in row.keys():
        v = row[k]
        if k in _SKIP:
            continue
        out[k] = {"b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v
    return out


def _value(v):
    return base64.b64decode(v["b64"]) if isinstance(v, dict) and set(v) == {"b64"} else v


def export_session(db_path: Path, principal: str, cache_key: str) -> dict:
    """The session (principal, prompt_cache_key)'s rows as a JSON-able dict."""
    conn = sqlite3.connect(f"file:{Path(db_path)}?mode=ro", uri=True, timeout=5.0)
    conn.row_factory = sqlite3.Row
    try:
        conn.execute("BEGIN")  # one snapshot for every read below
        version = schema_version(conn)
        sess = conn.execute(
            "SELECT s.id, s.created_at, s.last_used_at FROM sessions s JOIN principals p "
            "ON p.id = s.principal_id WHERE p.name = ? AND s.cache_key = ?",
            (principal, cache_key)).fetchone()
        responses, inputs, outputs = [], [], []
        if sess is not None:
            responses = [_row(r, "responses") for r in conn.execute(
                "SELECT * FROM responses WHERE session_id = ? ORDER BY created_at, id",
                (sess["id"],))]
            for table, dest in (("input_items", inputs), ("output_items", outputs)):
                dest += [_row(r, table) for r in conn.execute(
                    f"SELECT t.* FROM {table} t JOIN responses r ON r.id = t.response_id "
                    "WHERE r.session_id = ? ORDER BY t.response_id, t.position", (sess["id"],))]
        conn.execute("COMMIT")
    finally:
        conn.close()
    return {"schema_version": version,
            "session": None if sess is None else {"created_at": sess["created_at"],
                                                  "last_used_at": sess["last_used_at"]},
            "responses": responses, "input_items": inputs, "output_items": outputs}


def encode(rows: dict) -> bytes:
    return json.dumps(rows, sort_keys=True, separators=(",", ":")).encode()


def decode(data: bytes, where: str) -> dict:
    try:
        rows = json.loads(data)
        for k in ("schema_version", "responses", "input_items", "output_items"):
            rows[k]  # noqa: B018 - presence
        return rows
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: responses.json is malformed ({e})") from None


def check_import(store, rows: dict, where: str) -> None:
    """Raise ValueError (naming the field) if `rows` cannot go into `store` as they are."""
    ids = [r["id"] for r in rows["responses"]]
    with store._tx("DEFERRED") as c:
        version = schema_version(c)
        if rows["schema_version"] != version:
            raise ValueError(f"{where}: responses.json schema_version "
                             f"{rows['schema_version']} differs from this store's {version}")
        for table in ("responses", "input_items", "output_items"):
            known = {r[1] for r in c.execute(f"PRAGMA table_info({table})")}
            for r in rows[table]:
                extra = set(r) - known
                if extra:
                    raise ValueError(f"{where}: responses.json: {table} has no column "
                                     f"{sorted(extra)[0]!r}")
        for rid in ids:
            if c.execute("SELECT 1 FROM responses WHERE id = ?", (rid,)).fetchone():
                raise ValueError(f"{where}: responses.json: response {rid} is already stored "
                                 "here")
    if version != SCHEMA_VERSION:
        raise ValueError(f"{where}: the receiving store has schema {version}, this server "
                         f"{SCHEMA_VERSION}")


def import_session(store, principal: str, cache_key: str, rows: dict) -> int:
    """Insert the rows into `store` (a ResponseStore) in one transaction; returns how many
    responses were added."""
    now = time.time()
    with store._tx() as c:
        c.execute("INSERT OR IGNORE INTO principals (name, created_at) VALUES (?, ?)",
                  (principal, now))
        pid = c.execute("SELECT id FROM principals WHERE name = ?", (principal,)).fetchone()[0]
        meta = rows.get("session") or {}
        c.execute("INSERT OR IGNORE INTO sessions (principal_id, cache_key, created_at, "
                  "last_used_at) VALUES (?, ?, ?, ?)",
                  (pid, cache_key, meta.get("created_at", now), meta.get("last_used_at", now)))
        sid = c.execute("SELECT id FROM sessions WHERE principal_id = ? AND cache_key = ?",
                        (pid, cache_key)).fetchone()[0]
        for table in ("responses", "input_items", "output_items"):
            for r in rows[table]:
                cols = [k for k in r if k not in _SKIP]
                vals = [_value(r[k]) for k in cols]
                if table == "responses":
                    cols, vals = cols + ["principal_id", "session_id"], vals + [pid, sid]
                c.execute(f"INSERT INTO {table} ({', '.join(cols)}) VALUES "
                          f"({', '.join('?' * len(cols))})", vals)
        for r in rows["responses"]:
            rehash(c, "responses", "id = ?", (r["id"],))
            rehash(c, "input_items", "response_id = ?", (r["id"],))
            rehash(c, "output_items", "response_id = ?", (r["id"],))
    return len(rows["responses"])
