"""The durable response store: stored responses, their lineage, and the exact token ids of every
output item, in one SQLite file (settings and their reasons: `server/response_store_schema.py`).

What a stored response holds: its principal and session, `previous_response_id`, the request's
own input items (not the chain's), its output items each with the token ids the model produced,
instructions, request parameters (tools, reasoning, tool_choice, sampling ...), usage, prompt
token count. `history(id)` walks `previous_response_id`: each ancestor's input then output
items, oldest first, never instructions (the current request's apply).

Delete semantics (no cascade). `delete` makes a response a tombstone at once: `get`, `history`,
`list_input_items`, `continuation` and replay treat it as absent; its instructions, parameters
and usage are erased. Its input and output items stay in the file only
while a live descendant's history runs through it (the descendant's conversation contains them,
so "descendants still continue" requires them); when no live descendant is left they are
deleted with the row, overwritten (secure_delete), the WAL truncated. Prune follows the same
rules; a session purge removes all of the session's responses (descendants share it).

Sessions. A request with `prompt_cache_key` K belongs to session (principal, K). A request
without a key continuing a response joins that response's session; a new chain without a key is
its own session, named by its root response id. A request that names a key other than its
parent's session key is refused like an absent parent (`continuation` returns None).

Threading rule. One connection guarded by one lock, held by every public method for its whole
(short) duration: any thread may call any method. Writes commit with an fsync, so the asyncio loop
calls `put_response`, `delete`, `purge_session` and `prune` through `asyncio.to_thread`.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from contextlib import contextmanager, suppress
from typing import Iterator

from server.response_store_values import StoreCorrupt, check, rehash
from server.response_store_values import (HistoryEntry, ResponseRecord, compact_json,
                                         input_item_ids, item_content_hash, pack_token_ids,
                                         unpack_token_ids)
from server.response_store_replay import ReplayReads
from server.response_store_schema import StoreError, connect

__all__ = ["ResponseStore", "ResponseRecord", "HistoryEntry", "StoreError", "StoreCorrupt",
           "InvalidCursor", "item_content_hash", "pack_token_ids", "unpack_token_ids"]

MAX_HISTORY_DEPTH = 1_000_000  # a guard against a lineage cycle, which ids make impossible


class InvalidCursor(ValueError):
    """`after` names no input item of the response."""


# ---- the store ---------------------------------------------------------------------------------
_LIVE_OWNED = """SELECT r.*, s.cache_key FROM responses r
    JOIN principals p ON p.id = r.principal_id JOIN sessions s ON s.id = r.session_id
    WHERE r.id = ? AND p.name = ? AND r.deleted_at IS NULL"""

# Ancestors of live responses: the tombstones whose items some live history still reads.
_NEEDED = """WITH RECURSIVE needed(id) AS (
    SELECT previous_response_id FROM responses
        WHERE deleted_at IS NULL AND previous_response_id IS NOT NULL {scope}
    UNION
    SELECT r.previous_response_id FROM responses r JOIN needed n ON r.id = n.id
        WHERE r.previous_response_id IS NOT NULL)"""

_ERASE = "UPDATE responses SET deleted_at = ?, instructions = NULL, params = '{}', usage = NULL"


def _listed(item_id: str, item: dict) -> dict:
    return {"id": item_id, **{k: v for k, v in item.items() if k != "id"}}


def _checked(table: str, rows) -> list:
    for row in rows:
        check(table, row)
    return rows


class ResponseStore(ReplayReads):
    """Durable responses for the Responses API. See the module docstring for the rules."""

    def __init__(self, path):
        self.path = path
        self._conn = connect(path)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()

    def close(self) -> None:
        """The WAL checkpointed into the database (else replayed at the next open); closed."""
        with self._lock:
            with suppress(sqlite3.Error):
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            self._conn.close()

    @contextmanager
    def _tx(self, mode: str = "IMMEDIATE") -> Iterator[sqlite3.Connection]:
        """One transaction under the lock: IMMEDIATE for writes, DEFERRED for a consistent
        snapshot across several reads."""
        with self._lock:
            self._conn.execute(f"BEGIN {mode}")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def _scrub(self) -> None:
        """After content was deleted: give freed pages back and empty the WAL, so the deleted
        bytes are in neither file (secure_delete has zeroed them in the pages)."""
        with self._lock:
            self._conn.execute("PRAGMA incremental_vacuum").fetchall()
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()

    # ---- writes --------------------------------------------------------------------------------
    def put_response(self, rec: ResponseRecord) -> None:
        """Store `rec` atomically (one transaction). Raises ValueError for a malformed record or
        an id already stored, sqlite3 errors for disk failures."""
        if len(rec.output_token_ids) != len(rec.output_items):
            raise ValueError("output_token_ids must have one entry per output item")
        inputs = [(i, iid, compact_json(it)) for i, (iid, it)
                  in enumerate(zip(input_item_ids(rec.input_items), rec.input_items))]
        outputs = [(i, it.get("id"), item_content_hash(it), compact_json(it),
                    None if ids is None else pack_token_ids(ids))
                   for i, (it, ids) in enumerate(zip(rec.output_items, rec.output_token_ids))]
        now = time.time()
        with self._tx() as c:
            c.execute("INSERT OR IGNORE INTO principals (name, created_at) VALUES (?, ?)",
                      (rec.principal, now))
            pid = c.execute("SELECT id FROM principals WHERE name = ?",
                            (rec.principal,)).fetchone()[0]
            if c.execute("SELECT 1 FROM responses WHERE id = ?", (rec.id,)).fetchone():
                raise ValueError(f"response {rec.id} is already stored")
            sid = self._session_for(c, pid, rec, now)
            c.execute("INSERT INTO responses (id, principal_id, session_id, previous_response_id,"
                      " created_at, status, model, instructions, params, usage, prompt_tokens)"
                      " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                      (rec.id, pid, sid, rec.previous_response_id, rec.created_at, rec.status,
                       rec.model, rec.instructions, compact_json(rec.params),
                       None if rec.usage is None else compact_json(rec.usage),
                       rec.prompt_tokens))
            if rec.prompt_token_ids is not None:
                c.execute("UPDATE responses SET prompt_token_ids = ?, extends_parent = ? "
                          "WHERE id = ?", (pack_token_ids(rec.prompt_token_ids),
                                           int(rec.extends_parent), rec.id))
            c.executemany("INSERT INTO input_items VALUES (?, ?, ?, ?, NULL)",
                          [(rec.id, *row) for row in inputs])
            c.executemany("INSERT INTO output_items VALUES (?, ?, ?, ?, ?, ?, NULL)",
                          [(rec.id, *row) for row in outputs])
            rehash(c, "responses", "id = ?", (rec.id,))  # as stored, after type affinity
            rehash(c, "input_items", "response_id = ?", (rec.id,))
            rehash(c, "output_items", "response_id = ?", (rec.id,))

    @staticmethod
    def _session_for(c, pid: int, rec: ResponseRecord, now: float) -> int:
        """The session a new response joins: its parent's (whose key it must not contradict),
        else its key's, else a new one rooted at itself. A parent collected while this response
        was generated (deleted meanwhile) leaves the lineage in place and the history starting
        here."""
        if rec.previous_response_id is not None:
            row = c.execute("SELECT r.principal_id, r.session_id, s.cache_key FROM responses r "
                            "JOIN sessions s ON s.id = r.session_id WHERE r.id = ?",
                            (rec.previous_response_id,)).fetchone()
            if row is not None:
                if row[0] != pid:
                    raise ValueError("previous_response_id belongs to another principal")
                if rec.prompt_cache_key is not None and rec.prompt_cache_key != row[2]:
                    raise ValueError("prompt_cache_key differs from the parent's session")
                c.execute("UPDATE sessions SET last_used_at = ? WHERE id = ?", (now, row[1]))
                return row[1]
        if rec.prompt_cache_key is not None:
            c.execute("INSERT OR IGNORE INTO sessions (principal_id, cache_key, created_at, "
                      "last_used_at) VALUES (?, ?, ?, ?)", (pid, rec.prompt_cache_key, now, now))
            c.execute("UPDATE sessions SET last_used_at = ? WHERE principal_id = ? AND "
                      "cache_key = ?", (now, pid, rec.prompt_cache_key))
            return c.execute("SELECT id FROM sessions WHERE principal_id = ? AND cache_key = ?",
                             (pid, rec.prompt_cache_key)).fetchone()[0]
        return c.execute("INSERT INTO sessions (principal_id, root_response_id, created_at, "
                         "last_used_at) VALUES (?, ?, ?, ?)", (pid, rec.id, now, now)).lastrowid

    @staticmethod
    def _collect(c, session_ids=None) -> None:
        """Delete every tombstone no live history needs (with its items), then empty sessions.
        Descendants share their parent's session, so a session-scoped pass is complete."""
        if session_ids is None:
            scope, args = "", ()
        else:
            scope = f"AND session_id IN ({','.join('?' * len(session_ids))})"
            args = tuple(session_ids)
        c.execute(_NEEDED.format(scope=scope) + " DELETE FROM responses WHERE deleted_at IS NOT"
                  f" NULL {scope} AND id NOT IN (SELECT id FROM needed)", args + args)
        c.execute("DELETE FROM sessions WHERE NOT EXISTS (SELECT 1 FROM responses r WHERE "
                  f"r.session_id = sessions.id) {scope.replace('session_id', 'sessions.id')}",
                  args)

    def delete(self, principal: str, response_id: str) -> bool:
        """Tombstone one response (no cascade). False when absent, deleted or not the
        principal's, which callers must answer exactly like an unknown id."""
        with self._tx() as c:
            row = c.execute(_LIVE_OWNED, (response_id, principal)).fetchone()
            if row is None:
                return False
            c.execute(_ERASE + " WHERE id = ?", (time.time(), response_id))
            rehash(c, "responses", "id = ?", (response_id,))
            self._collect(c, [row["session_id"]])
        self._scrub()
        return True

    def purge_session(self, principal: str, prompt_cache_key: str | None = None, *,
                      root_response_id: str | None = None) -> int:
        """Remove every response of one session (keyed, or a keyless chain by its root id),
        content and rows. Returns the number of responses removed (tombstones included)."""
        if (prompt_cache_key is None) == (root_response_id is None):
            raise ValueError("give exactly one of prompt_cache_key and root_response_id")
        column, key = (("cache_key", prompt_cache_key) if prompt_cache_key is not None
                       else ("root_response_id", root_response_id))
        with self._tx() as c:
            row = c.execute(f"SELECT s.id FROM sessions s JOIN principals p ON p.id = "
                            f"s.principal_id WHERE p.name = ? AND s.{column} = ?",
                            (principal, key)).fetchone()
            if row is None:
                return 0
            n = c.execute("DELETE FROM responses WHERE session_id = ?", (row[0],)).rowcount
            c.execute("DELETE FROM sessions WHERE id = ?", (row[0],))
        self._scrub()
        return n

    def prune(self, max_responses_per_principal: int | None = None,
              max_age_s: float | None = None, now: float | None = None) -> int:
        """Retention: tombstone live responses older than `max_age_s` and, per principal, all
        but the newest `max_responses_per_principal`; then collect as `delete` does. Returns
        the number of responses tombstoned."""
        now = time.time() if now is None else now
        n = 0
        with self._tx() as c:
            if max_age_s is not None:
                n += c.execute(_ERASE + " WHERE deleted_at IS NULL AND created_at < ?",
                               (now, now - max_age_s)).rowcount
            if max_responses_per_principal is not None:
                n += c.execute(_ERASE + " WHERE id IN (SELECT id FROM (SELECT id, ROW_NUMBER() "
                               "OVER (PARTITION BY principal_id ORDER BY created_at DESC, "
                               "rowid DESC) AS rank FROM responses WHERE deleted_at IS NULL) "
                               "WHERE rank > ?)", (now, max_responses_per_principal)).rowcount
            if n:
                rehash(c, "responses", "deleted_at = ?", (now,))
            self._collect(c)
        if n:
            self._scrub()
        return n

    # ---- reads ---------------------------------------------------------------------------------
    def get(self, principal: str, response_id: str) -> ResponseRecord | None:
        """The stored response, or None when absent, deleted or another principal's."""
        with self._tx("DEFERRED") as c:
            row = c.execute(_LIVE_OWNED, (response_id, principal)).fetchone()
            if row is None:
                return None
            check("responses", row)
            inputs = _checked("input_items", c.execute(
                "SELECT * FROM input_items WHERE response_id = ? ORDER BY position",
                (response_id,)).fetchall())
            outputs = _checked("output_items", c.execute(
                "SELECT * FROM output_items WHERE response_id = ? ORDER BY position",
                (response_id,)).fetchall())
        r = row
        return ResponseRecord(
            id=r["id"], principal=principal, model=r["model"], status=r["status"],
            input_items=[json.loads(x["item"]) for x in inputs],
            output_items=[json.loads(x["item"]) for x in outputs],
            output_token_ids=[None if x["token_ids"] is None else unpack_token_ids(x["token_ids"])
                              for x in outputs],
            created_at=r["created_at"], previous_response_id=r["previous_response_id"],
            prompt_cache_key=r["cache_key"], instructions=r["instructions"],
            params=json.loads(r["params"]),
            usage=None if r["usage"] is None else json.loads(r["usage"]),
            prompt_tokens=r["prompt_tokens"])

    def continuation(self, principal: str, previous_response_id: str,
                     prompt_cache_key: str | None) -> ResponseRecord | None:
        """The response a request may continue, or None, which the caller answers with
        `previous_response_not_found` (400): absent, deleted, another principal's, or in another
        session than the request's `prompt_cache_key` names."""
        parent = self.get(principal, previous_response_id)
        if parent is None:
            return None
        if prompt_cache_key is not None and prompt_cache_key != parent.prompt_cache_key:
            return None
        return parent

    def token_sequence(self, principal: str, response_id: str) -> list[int] | None:
        """Every token of the conversation up to the end of `response_id`'s output, exactly as
        the model saw and produced them (prompt deltas and outputs along the chain); None when
        the response is not visible or a link of the chain has no stored token ids."""
        parts: list[list[int]] = []
        with self._tx("DEFERRED") as c:
            if c.execute(_LIVE_OWNED, (response_id, principal)).fetchone() is None:
                return None
            rid, depth = response_id, 0
            while rid is not None and depth < MAX_HISTORY_DEPTH:
                row = c.execute("SELECT * FROM responses WHERE id = ?", (rid,)).fetchone()
                if row is None or row["prompt_token_ids"] is None:
                    return None
                check("responses", row)
                outs = _checked("output_items", c.execute(
                    "SELECT * FROM output_items WHERE response_id = ? ORDER BY position",
                    (rid,)).fetchall())
                if any(o["token_ids"] is None for o in outs):
                    return None
                output = [t for o in outs for t in unpack_token_ids(o["token_ids"])]
                parts.append(unpack_token_ids(row["prompt_token_ids"]) + output)  # newest first
                rid = row["previous_response_id"] if row["extends_parent"] else None
                depth += 1
        return [t for part in reversed(parts) for t in part]

    def history_entries(self, principal: str, response_id: str) -> list[HistoryEntry] | None:
        """The conversation up to and including `response_id`, oldest first: for each response
        of the chain its input items, then its output items with their token ids. None when the
        response itself is not visible; deleted ancestors still contribute their items."""
        with self._tx("DEFERRED") as c:
            if c.execute(_LIVE_OWNED, (response_id, principal)).fetchone() is None:
                return None
            chain, rid, owner = [], response_id, None
            while rid is not None and len(chain) < MAX_HISTORY_DEPTH:
                row = c.execute("SELECT * FROM responses WHERE id = ?", (rid,)).fetchone()
                if row is None or owner not in (None, row["principal_id"]):
                    break
                check("responses", row)
                owner = row["principal_id"]
                chain.append(rid)
                rid = row["previous_response_id"]
            out = []
            for rid in reversed(chain):  # oldest first: its input items, then its output items
                for kind in ("input", "output"):
                    for row in _checked(f"{kind}_items", c.execute(
                            f"SELECT * FROM {kind}_items WHERE response_id = ? ORDER BY "
                            "position", (rid,)).fetchall()):
                        blob = row["token_ids"] if kind == "output" else None
                        out.append(HistoryEntry(rid, kind, json.loads(row["item"]),
                                                None if blob is None else unpack_token_ids(blob)))
        return out

    def history(self, principal: str, response_id: str) -> list[dict] | None:
        """The items of `history_entries`, in conversation order."""
        entries = self.history_entries(principal, response_id)
        return None if entries is None else [e.item for e in entries]

    def list_input_items(self, principal: str, response_id: str, after: str | None = None,
                         limit: int = 20, order: str = "desc") -> dict | None:
        """`GET /v1/responses/{id}/input_items`: this request's input items, a page at a time.
        None when the response is not visible; InvalidCursor when `after` is not one of its
        items; ValueError for a limit outside 1..100 or an unknown order."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100:
            raise ValueError("limit must be an integer between 1 and 100")
        if order not in ("asc", "desc"):
            raise ValueError("order must be 'asc' or 'desc'")
        with self._tx("DEFERRED") as c:
            if c.execute(_LIVE_OWNED, (response_id, principal)).fetchone() is None:
                return None
            start = -1 if order == "asc" else 1 << 62
            if after is not None:
                row = c.execute("SELECT position FROM input_items WHERE response_id = ? AND "
                                "item_id = ?", (response_id, after)).fetchone()
                if row is None:
                    raise InvalidCursor(f"'after': no input item '{after}' in this response")
                start = row[0]
            cmp, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
            rows = _checked("input_items", c.execute(
                f"SELECT * FROM input_items WHERE response_id = ? AND position {cmp} ? "
                f"ORDER BY position {direction} LIMIT ?",
                (response_id, start, limit + 1)).fetchall())
        data = [_listed(r["item_id"], json.loads(r["item"])) for r in rows[:limit]]
        return {"object": "list", "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(rows) > limit}
