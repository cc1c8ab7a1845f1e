"""`./ninfer backup --out DIR` and `./ninfer restore FROM`: the whole state of a server, copied
while it runs, and brought back after a loss.

A backup is a directory:

    backup.json              what it holds: every file's path, size and sha256
    responses.db             the response store, through SQLite's online backup API (a
                             consistent snapshot while the server writes)
    keys, secrets/*          the key file and the state directory's secrets
    checkpoints/secret, checkpoints/runtime.json
    checkpoints/sessions/<ns>/current, .../generations/<gen>/*, checkpoints/pages/<aa>/<sha>

Checkpoint generations are read the way an export reads them (server/checkpoints/transfer.py:
without the store's lock, every tag and sha256 verified); one that fails or changes under the
copy is left out and named. The backup is written under a temporary name beside DIR and renamed
into place when complete, so a DIR that exists is a whole backup.

Restore (with the server stopped) verifies every file of the backup first, then brings back
what the state directory lacks: the response store when it is absent (a present one is newer
and is kept), secrets and keys when absent (a present one that differs is refused: the
checkpoints' tags and the sealed reasoning depend on it), every page and generation that is
missing, and a session's `current` where it names nothing. Files go in by the store's own
publish steps (new file, fsync, rename; a generation through a staging directory).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import sqlite3
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from server.checkpoints import quota
from server.checkpoints.files import fsync_dir, mkdir_synced, publish_file, read_file, write_new

MANIFEST = "backup.json"
_SMALL = ("keys", "checkpoints/secret", "checkpoints/runtime.json")
_GEN_FILES = ("tokens.bin", "state.bin", "manifest.json", "manifest.mac")


class BackupError(ValueError):
    """A backup or restore refused; the message names the file."""


def _sha(data) -> str:
    return hashlib.sha256(data).hexdigest()


def backup(state_dir: Path, out: Path) -> dict:
    from server.checkpoints.transfer import _Laps, _Reader
    from server.checkpoints.verify import Corrupt, LoadResult, read_generation

    state_dir, out = Path(state_dir), Path(out)
    if out.exists():
        raise BackupError(f"{out} exists; a backup never overwrites")
    tmp = out.with_name(f".tmp-{out.name}-{secrets.token_hex(4)}")
    tmp.mkdir(mode=0o700, parents=True)
    files, skipped = {}, []

    def put(rel: str, data) -> None:
        path = tmp / rel
        mkdir_synced(path.parent)
        write_new(path, data)
        files[rel] = {"bytes": memoryview(data).nbytes, "sha256": _sha(data)}

    try:
        db = state_dir / "responses.db"
        if db.is_file():
            src = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5.0)
            dst = sqlite3.connect(tmp / "responses.db")
            try:
                src.backup(dst)
            finally:
                dst.close()
                src.close()
            data = (tmp / "responses.db").read_bytes()
            files["responses.db"] = {"bytes": len(data), "sha256": _sha(data)}
        for rel in _SMALL:
            if (state_dir / rel).is_file():
                put(rel, read_file(state_dir / rel))
        if (state_dir / "secrets").is_dir():
            for name in sorted(os.listdir(state_dir / "secrets")):
                if (state_dir / "secrets" / name).is_file():
                    put(f"secrets/{name}", read_file(state_dir / "secrets" / name))
        root = state_dir / "checkpoints"
        gens = 0
        if (root / "secret").is_file() and (root / "sessions").is_dir():
            with ThreadPoolExecutor(8, thread_name_prefix="ninfer-backup") as pool:
                reader = _Reader(root, pool)
                for ns in sorted(os.listdir(root / "sessions")):
                    sdir = root / "sessions" / ns
                    names = quota.generations_newest_first(sdir)
                    for i, gen in enumerate(names):
                        gdir = sdir / "generations" / gen
                        m = quota.read_manifest(gdir)
                        try:
                            res = None if m is None else read_generation(
                                reader, _owner(m, state_dir), ns, gdir,
                                m.get("fingerprint_sha256"), None, None, _Laps())
                        except Corrupt:
                            res = None
                        if not isinstance(res, LoadResult):
                            skipped.append(f"{ns[:16]}/{gen}")
                            continue
                        for d, view in zip(res.page_digests, res.pages):
                            if f"checkpoints/pages/{d[:2]}/{d}" not in files:
                                put(f"checkpoints/pages/{d[:2]}/{d}", view)
                        base = f"checkpoints/sessions/{ns}/generations/{gen}"
                        put(f"{base}/state.bin", res.state_bytes)
                        for name in ("tokens.bin", "manifest.json", "manifest.mac"):
                            put(f"{base}/{name}", read_file(gdir / name))
                        if i == 0:
                            put(f"checkpoints/sessions/{ns}/current", (gen + "\n").encode())
                        gens += 1
        manifest = {"type": "ninfer.backup", "schema": 1, "created_at": round(time.time(), 3),
                    "generations": gens, "skipped": skipped,
                    "files": [{"path": k, **v} for k, v in sorted(files.items())]}
        write_new(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        for dirpath, _, _ in os.walk(tmp):
            fsync_dir(Path(dirpath))
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"backup": str(out), "files": len(files), "generations": gens, "skipped": skipped,
            "bytes": sum(f["bytes"] for f in files.values())}


def _owner(manifest: dict, state_dir: Path) -> str:
    """The principal name whose digest the manifest carries (from the key file)."""
    from server.auth import load_key_file
    from server.checkpoints.tags import principal_digest

    try:
        for name, _ in load_key_file(state_dir / "keys").entries:
            if principal_digest(name) == manifest.get("principal"):
                return name
    except (OSError, ValueError):
        pass
    return ""  # no such principal: its tag will not verify, and the generation is skipped


def _verified_files(src: Path) -> dict[str, bytes]:
    """Every file the backup lists, read and checked; refuses on any mismatch."""
    try:
        m = json.loads(read_file(src / MANIFEST))
        listed = {f["path"]: f for f in m["files"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BackupError(f"{src / MANIFEST}: missing or malformed ({e})") from None
    out = {}
    for rel, f in listed.items():
        if rel.startswith("/") or ".." in rel.split("/"):
            raise BackupError(f"{src / MANIFEST}: entry {rel!r} is not a relative path")
        path = src / rel
        if path.is_symlink() or not path.is_file():
            raise BackupError(f"{path}: missing or not a regular file")
        data = read_file(path)
        if len(data) != f["bytes"] or _sha(data) != f["sha256"]:
            raise BackupError(f"{path}: size or sha256 differs from {MANIFEST}")
        out[rel] = data
    return out


def restore(src: Path, state_dir: Path) -> dict:
    from server.checkpoints.checkpoint_store import CheckpointStore, StoreBusy

    src, state_dir = Path(src), Path(state_dir)
    data = _verified_files(src)
    for rel in [r for r in data if r in _SMALL or r.startswith("secrets/")]:
        have = state_dir / rel
        if have.is_file() and rel != "checkpoints/runtime.json" and read_file(have) != data[rel]:
            raise BackupError(f"{have} differs from the backup's; refusing to replace it "
                              "(move it away to restore the backup's)")
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for rel in [r for r in data if r in _SMALL or r.startswith("secrets/")]:
        if not (state_dir / rel).is_file():  # secrets first: the store opens with its own
            mkdir_synced((state_dir / rel).parent)
            publish_file(state_dir / rel, data[rel])
    try:  # the store's lock: no server may run on this state dir meanwhile
        store = CheckpointStore(state_dir / "checkpoints", quota_bytes=1 << 62)
    except StoreBusy:
        raise BackupError(f"{state_dir} is in use by a running server; stop it first") from None
    restored = {"pages": 0, "generations": 0, "responses_db": "kept"}
    try:
        pages = [(state_dir / r, d) for r, d in data.items()
                 if r.startswith("checkpoints/pages/") and not (state_dir / r).is_file()]
        for path, _ in pages:
            mkdir_synced(path.parent)
        for path, d in pages:
            publish_file(path, d)
        restored["pages"] = len(pages)
        gens = sorted({r.rsplit("/", 1)[0] for r in data if "/generations/" in r})
        for g in gens:
            final = state_dir / g
            if final.is_dir():
                continue
            staging = final.parent.parent / f".staging-{final.name}"
            mkdir_synced(final.parent)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(mode=0o700)
            for name in _GEN_FILES:
                write_new(staging / name, data[f"{g}/{name}"])
            fsync_dir(staging)
            os.rename(staging, final)
            fsync_dir(final.parent)
            restored["generations"] += 1
        for rel in [r for r in data if r.endswith("/current")]:
            cur = state_dir / rel
            name = cur.read_text().strip() if cur.is_file() else ""
            if not name or not (cur.parent / "generations" / name).is_dir():
                publish_file(cur, data[rel])
        db = state_dir / "responses.db"
        if "responses.db" in data and not db.exists():
            for side in ("-wal", "-shm"):  # a stray WAL would be replayed into the backup
                Path(f"{db}{side}").unlink(missing_ok=True)
            publish_file(db, data["responses.db"])
            restored["responses_db"] = "restored"
    finally:
        store.close()
    return restored


def main(argv: list[str], default_state_dir: Path) -> int:
    p = argparse.ArgumentParser(prog=f"ninfer {argv[0]}")
    p.add_argument("--state-dir", help="the state directory (default: as serve)")
    if argv[0] == "backup":
        p.add_argument("--out", required=True, help="the backup directory to create")
    else:
        p.add_argument("source", help="a backup directory")
    args = p.parse_args(argv[1:])
    os.umask(0o077)
    state_dir = Path(args.state_dir or default_state_dir)
    try:
        if argv[0] == "backup":
            result = backup(state_dir, Path(args.out))
        else:
            result = restore(Path(args.source), state_dir)
    except BackupError as e:
        print(f"ninfer {argv[0]}: refused: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1, sort_keys=True))
    return 0
