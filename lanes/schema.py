"""Upgrades against the response store's schema (server/response_store_schema.py).

An instance opens a store whose schema version is at most its own SCHEMA_VERSION (it migrates
an older one forward) and refuses a newer one: `_migrate` raises StoreError when the store's
version is above the newest migration it knows, whatever the newer migration changed. So there
is no backward readability: once an instance with a higher SCHEMA_VERSION has started on the
shared state directory, an instance with a lower one cannot serve it. The manifest records
each instance's SCHEMA_VERSION; `opens_up_to` is the rule above, pinned by
tests/test_lane_lifecycle.py against server/response_store_schema.py itself."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from lanes.cli import EX_CONFIG
from lanes.instance import LaneError, Source


def opens_up_to(manifest: dict) -> int:
    """The newest response-store schema version an instance can open."""
    return manifest["store_schema_version"]


def store_version(db: Path) -> int | None:
    """The schema version of the response store at `db` (None: there is none yet)."""
    if not db.is_file():
        return None
    from server.response_store_schema import schema_version

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5.0)
    try:
        return schema_version(conn)
    except sqlite3.DatabaseError as e:
        raise LaneError(f"cannot read the response store {db}: {e}") from None
    finally:
        conn.close()


def _db(root) -> Path:
    return root.state / "responses.db"


def check_install(root, new: Source, current: Source | None, allow_no_rollback: bool) -> list:
    """Refuse an install whose instance cannot open the store, or (unless allowed) one whose
    migration would leave a store the instance it replaces (the rollback target) cannot
    open. Returns notes for the operator."""
    have = store_version(_db(root))
    v = new.manifest["store_schema_version"]
    if have is not None and have > opens_up_to(new.manifest):
        raise LaneError(f"the response store {_db(root)} has schema version {have}; instance "
                        f"{new.id[:16]} opens versions up to {v} only, so its server would "
                        f"refuse to start", EX_CONFIG)
    if current is None or v <= opens_up_to(current.manifest):
        return []
    why = (f"instance {new.id[:16]} migrates the response store to schema version {v} when it "
           f"starts; the instance it replaces ({current.id[:16]}, the rollback target) opens "
           f"versions up to {opens_up_to(current.manifest)} only (server/response_store_schema.py "
           f"refuses a newer store), so after the upgrade `./ninfer lane rollback` could not "
           f"serve {root.state}")
    if not allow_no_rollback:
        raise LaneError(f"refused: {why}. Back up {root.state} and re-run with "
                        f"--allow-no-rollback to accept that", EX_CONFIG)
    return [f"no rollback past this upgrade: {why}"]


def check_rollback(root, target: Source) -> None:
    have = store_version(_db(root))
    if have is not None and have > opens_up_to(target.manifest):
        raise LaneError(f"rollback refused: the response store {_db(root)} has schema version "
                        f"{have} (migrated by a newer instance); instance {target.id[:16]} "
                        f"opens versions up to {opens_up_to(target.manifest)} only. Restore "
                        f"{root.state} from the backup taken before the upgrade to go back",
                        EX_CONFIG)
