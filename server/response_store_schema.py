"""Opening the response store's SQLite file: permissions, pragmas, schema and migrations.

Settings and why:
- `journal_mode=WAL`: a reader never waits for the writer and a commit appends to one file.
- `synchronous=FULL`: every commit fsyncs the WAL before it returns. In WAL mode NORMAL is
  already safe against a killed process (the database stays consistent and every commit that
  returned survives) but may lose the last commits on a power cut or kernel crash. We pay one
  fsync per commit (well under the cost of generating a response, and commits happen once per
  response) so that an id a client was given still resolves after a power cut, and, more
  important, so that an acknowledged DELETE or session purge cannot come back.
- `secure_delete=ON` with `auto_vacuum=INCREMENTAL`: deleted rows are overwritten with zeros and
  freed pages are returned to the filesystem; with a TRUNCATE checkpoint after a deletion, the
  deleted text is no longer in the database or WAL file (the filesystem may still hold old blocks).
- `foreign_keys=ON`, `busy_timeout` 5 s (only matters if a second process, e.g. a maintenance
  command, opens the same file), `trusted_schema=OFF`.
- At open, `PRAGMA quick_check`: a file whose pages or B-trees are damaged is refused with
  what to do; each row's own bytes are checked when it is read (its hash, version 3).
- The file is created 0600 (its WAL and shm files inherit the mode); an existing file readable or
  writable by group or others is refused, like the key file.
"""
from __future__ import annotations

import os
import sqlite3
import stat
import time
from pathlib import Path

from server import response_store_values as integrity

BUSY_TIMEOUT_S = 5.0
JOURNAL_SIZE_LIMIT = 16 * 1024 * 1024  # the WAL is cut back to this after a checkpoint


class StoreError(RuntimeError):
    """The store file is unsafe, corrupt or from a newer server: the server refuses to start."""


_V1 = (
    """CREATE TABLE principals (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL)""",
    # A session is (principal, prompt_cache_key); a chain started without a key is its own
    # session, named by its root response.
    """CREATE TABLE sessions (
        id INTEGER PRIMARY KEY,
        principal_id INTEGER NOT NULL REFERENCES principals(id),
        cache_key TEXT,
        root_response_id TEXT,
        created_at REAL NOT NULL,
        last_used_at REAL NOT NULL,
        CHECK ((cache_key IS NULL) != (root_response_id IS NULL)),
        UNIQUE (principal_id, cache_key),
        UNIQUE (principal_id, root_response_id))""",
    # previous_response_id carries no foreign key: lineage stays even when the parent row is
    # collected. deleted_at marks a tombstone: invisible to every read by id, its items kept
    # only while a live descendant's history needs them.
    """CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        principal_id INTEGER NOT NULL REFERENCES principals(id),
        session_id INTEGER NOT NULL REFERENCES sessions(id),
        previous_response_id TEXT,
        created_at REAL NOT NULL,
        status TEXT NOT NULL,
        model TEXT NOT NULL,
        instructions TEXT,
        params TEXT NOT NULL,
        usage TEXT,
        prompt_tokens INTEGER NOT NULL,
        deleted_at REAL)""",
    "CREATE INDEX responses_by_parent ON responses(previous_response_id)",
    "CREATE INDEX responses_by_session ON responses(session_id)",
    "CREATE INDEX responses_by_principal_age ON responses(principal_id, created_at)",
    # The input items of this request only, in request order (`position`).
    """CREATE TABLE input_items (
        response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        item_id TEXT NOT NULL,
        item TEXT NOT NULL,
        PRIMARY KEY (response_id, position),
        UNIQUE (response_id, item_id))""",
    # token_ids: the ids the model produced for this item, little-endian int32.
    """CREATE TABLE output_items (
        response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        item_id TEXT,
        content_hash TEXT NOT NULL,
        item TEXT NOT NULL,
        token_ids BLOB,
        PRIMARY KEY (response_id, position))""",
    "CREATE INDEX output_items_by_id ON output_items(item_id)",
    "CREATE INDEX output_items_by_hash ON output_items(content_hash)",
)

# Version 2: the prompt token ids of each response, as a delta. A response whose prompt extends
# its parent's token sequence (parent prompt + parent output) stores only the new tokens, so a
# long chain costs linear, not quadratic, space; the engine's stored states are keyed by exactly
# these sequences.
_V2 = (
    "ALTER TABLE responses ADD COLUMN prompt_token_ids BLOB",
    "ALTER TABLE responses ADD COLUMN extends_parent INTEGER NOT NULL DEFAULT 0",
)

# Version 3: a hash of each row of responses, input_items and output_items, checked when the row
# is read (server/response_store_values.py); the rows already stored are hashed as they are.

# Migration hook: (version, statements). Append new versions; never edit a shipped one.
MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = ((1, _V1), (2, _V2), (3, integrity.V3))
SCHEMA_VERSION = MIGRATIONS[-1][0]


def _create_private(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    os.close(fd)


def _check_private(path: Path) -> None:
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"response store {path} is not a regular file")
    if st.st_mode & 0o077:
        raise StoreError(f"response store {path} is readable or writable by group/others "
                         f"(mode {stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}")


def schema_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT name FROM sqlite_master WHERE name = 'schema_version'").fetchone()
    if row is None:
        return 0
    return conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]


def _migrate(conn: sqlite3.Connection, migrations) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version ("
                     "version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
        current = schema_version(conn)
        newest = migrations[-1][0]
        if current > newest:
            raise StoreError(f"the response store has schema version {current}, newer than "
                             f"this server's {newest}; refusing to open it")
        for version, statements in migrations:
            if version <= current:
                continue
            for sql in statements:
                conn.execute(sql)
            conn.execute("INSERT INTO schema_version VALUES (?, ?)", (version, time.time()))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def connect(path: str | os.PathLike, migrations=MIGRATIONS) -> sqlite3.Connection:
    """Open (creating if absent) the store at `path`, applying pending migrations.

    The connection is in autocommit mode (`isolation_level=None`): callers open transactions
    explicitly with BEGIN IMMEDIATE, so a write never upgrades a read lock halfway.
    """
    path = Path(path)
    _create_private(path)
    _check_private(path)
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                           check_same_thread=False)
    integrity.register(conn)
    try:
        problems = integrity.quick_check(conn)
        if problems:
            raise StoreError(
                f"response store {path} is corrupt (quick_check: {'; '.join(problems[:3])}); "
                f"refusing to start on it. Restore it from a backup, or move it aside "
                f"(mv {path} {path}.corrupt, with its -wal and -shm files) to start with an "
                f"empty store")
        # auto_vacuum only takes effect before the first table exists.
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise StoreError(f"response store {path}: cannot enable WAL (got {mode})")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA secure_delete = ON")
        conn.execute("PRAGMA trusted_schema = OFF")
        conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
        _migrate(conn, migrations)
    except sqlite3.DatabaseError as e:
        conn.close()
        advice = ("; refusing to start on it. Restore it from a backup, or move it aside "
                  "(with its -wal and -shm files) to start with an empty store"
                  if integrity.fault_kind(e) == "corrupt" else "")
        raise StoreError(f"response store {path} cannot be opened: {e}{advice}") from e
    except BaseException:
        conn.close()
        raise
    return conn
