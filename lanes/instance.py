"""Immutable instances: the product files of a tree, named by the sha256 of their manifest.

An instance holds engine/, server/, lanes/, release/, sbom/, the `ninfer` script and requirements*.lock (never
tests/, bench/, docs/, a .venv, __pycache__, .pyc or dot files) and `manifest.json`: canonical
JSON (sorted keys, no spaces) of every file's relative path, mode (0444, or 0555 for a file with
any execute bit in the tree) and sha256, the response store's SCHEMA_VERSION and every lane
profile's canonical hash. The instance id is the sha256 of those bytes, so packing the same tree
twice gives the same id (modification times, owners and the umask are not in it).

Files are read-only, and so is every directory below the top one; the top directory stays
writable by its owner because `./ninfer` creates the instance's own `.venv` there on first use
(`.venv` and `__pycache__` directories are the only things a verification ignores).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from lanes.cli import EX_CONFIG
from server.checkpoints.files import fsync_dir, read_file, write_new

REPO = Path(__file__).resolve().parent.parent
FORMAT = "ninfer-instance/1"
MANIFEST = "manifest.json"
PRODUCT_DIRS = ("engine", "server", "lanes", "release", "sbom")
IGNORED_DIRS = (".venv", "__pycache__")  # what `./ninfer` and Python may add to an instance


class LaneError(Exception):
    """A lane command's refusal: `code` is the exit status (78: EX_CONFIG, else 1)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _skipped(name: str) -> bool:
    # BUILD.bazel: Bazel's build description of a package, not what an instance runs
    return (name.startswith(".") or name in ("__pycache__", "BUILD.bazel")
            or name.endswith((".pyc", ".pyo")))


def product_files(tree: Path) -> list[str]:
    """The relative paths of the product files of `tree`, sorted."""
    missing = [d for d in PRODUCT_DIRS + ("ninfer",) if not (tree / d).exists()]
    if missing:
        raise LaneError(f"{tree} is not a ninfer tree (no {', '.join(missing)})", EX_CONFIG)
    out = [n for n in os.listdir(tree)
           if n == "ninfer" or (n.startswith("requirements") and n.endswith(".lock"))]
    for top in PRODUCT_DIRS:
        for dirpath, dirnames, filenames in os.walk(tree / top):
            dirnames[:] = [n for n in dirnames if not _skipped(n)]
            out += [os.path.relpath(os.path.join(dirpath, n), tree) for n in dirnames + filenames
                    if not _skipped(n)]
    files = []
    for rel in out:
        st = os.lstat(tree / rel)
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            raise LaneError(f"{tree / rel}: not a regular file (a link or device); an instance "
                            f"holds only regular files", EX_CONFIG)
        files.append(Path(rel).as_posix())
    return sorted(files)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(read_file(path)).hexdigest()


def _mode(path: Path) -> str:
    return "0555" if os.lstat(path).st_mode & 0o111 else "0444"


def _tree_facts() -> tuple[int, dict[str, str]]:
    """The running tree's response-store schema version and lane profiles' hashes."""
    from lanes.cli import known_lanes
    from lanes.profile import ProfileError, load_profile
    from server.response_store_schema import SCHEMA_VERSION

    try:
        profiles = {n: load_profile(n).canonical_hash() for n in known_lanes()}
    except ProfileError as e:
        raise LaneError(f"cannot pack: {e}", EX_CONFIG) from None
    return SCHEMA_VERSION, profiles


def build_manifest(tree: Path = REPO) -> dict:
    """The manifest of the running tree (its schema version and profiles are read by
    importing it: pack a tree by running that tree's own `./ninfer lane pack`)."""
    version, profiles = _tree_facts()
    files = [{"path": rel, "mode": _mode(tree / rel), "sha256": sha256_file(tree / rel)}
             for rel in product_files(tree)]
    return {"format": FORMAT, "files": files, "store_schema_version": version,
            "profiles": profiles}


def canonical(manifest: dict) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode()


@dataclass(frozen=True)
class Source:
    """What an install copies from: a directory and the manifest its files must match."""
    dir: Path
    manifest: dict
    blob: bytes  # the manifest's canonical bytes

    @property
    def id(self) -> str:
        return hashlib.sha256(self.blob).hexdigest()

    @classmethod
    def from_tree(cls, tree: Path = REPO) -> "Source":
        manifest = build_manifest(tree)
        return cls(tree, manifest, canonical(manifest))

    @classmethod
    def from_instance(cls, path: Path) -> "Source":
        """A packed (or installed) instance: its manifest must be canonical and, when the
        directory is named by an id, hash to that name."""
        path = Path(path)
        if not path.is_dir() or not (path / MANIFEST).is_file():
            raise LaneError(f"{path} is not a packed instance (no {MANIFEST}; make one with "
                            f"./ninfer lane pack --out DIR)", EX_CONFIG)
        blob = read_file(path / MANIFEST)
        try:
            manifest = json.loads(blob)
            ok = manifest.get("format") == FORMAT and canonical(manifest) == blob
        except (ValueError, AttributeError):
            ok = False
        if not ok:
            raise LaneError(f"{path / MANIFEST} is not a canonical {FORMAT} manifest "
                            f"(damaged or edited)")
        src = cls(path, manifest, blob)
        if _looks_like_id(path.name) and path.name != src.id:
            raise LaneError(f"{path / MANIFEST} changed after packing: its sha256 is "
                            f"{src.id[:16]}..., the directory is named {path.name[:16]}...")
        return src


def _looks_like_id(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def verify(path: Path, src: Source) -> list[str]:
    """What differs between the instance directory `path` and `src`'s manifest (empty: the
    instance is complete and intact): missing, changed, re-moded and extra files."""
    problems = []
    want = {f["path"]: f for f in src.manifest["files"]}
    want[MANIFEST] = {"mode": "0444", "sha256": src.id}
    for rel, f in sorted(want.items()):
        p = path / rel
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            problems.append(f"{rel}: missing")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{rel}: not a regular file")
            continue
        mode = f"{stat.S_IMODE(st.st_mode):04o}"
        if mode != f["mode"]:
            problems.append(f"{rel}: mode {mode}, the manifest says {f['mode']}")
        if sha256_file(p) != f["sha256"]:
            problems.append(f"{rel}: content differs from the manifest (sha256)")
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [n for n in dirnames if n not in IGNORED_DIRS]
        for n in filenames:
            rel = Path(os.path.relpath(os.path.join(dirpath, n), path)).as_posix()
            if rel not in want:
                problems.append(f"{rel}: not in the manifest")
    return problems


def listing(problems: list[str], most: int = 20) -> str:
    more = len(problems) - most
    return "".join(f"\n  {p}" for p in problems[:most]) + (f"\n  and {more} more" if more > 0
                                                            else "")


def materialize(src: Source, dest: Path, fault=None) -> None:
    """Copy `src`'s files into the new directory `dest` with the manifest's modes, each file
    fsync'd, then every directory. `fault("copying")` is called halfway (tests)."""
    dest.mkdir(mode=0o755)
    files = src.manifest["files"]
    for i, f in enumerate(files):
        if fault is not None and i == len(files) // 2:
            fault("copying")
        target = dest / f["path"]
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        try:
            write_new(target, read_file(src.dir / f["path"]))
        except FileNotFoundError:
            raise LaneError(f"{src.dir / f['path']}: missing from the source") from None
        os.chmod(target, int(f["mode"], 8))
    write_new(dest / MANIFEST, src.blob)
    os.chmod(dest / MANIFEST, 0o444)
    for dirpath, _, _ in os.walk(dest, topdown=False):
        fsync_dir(Path(dirpath))


def seal(path: Path) -> None:
    """Make every directory below the instance's top one read-only."""
    for dirpath, dirnames, _ in os.walk(path, topdown=False):
        if Path(dirpath) != path:
            os.chmod(dirpath, 0o555)


def force_rmtree(path: Path) -> None:
    """Remove a (possibly sealed) directory tree; absent is fine."""
    if not os.path.lexists(path):
        return
    for dirpath, _, _ in os.walk(path):
        os.chmod(dirpath, 0o755)
    shutil.rmtree(path)


def publish(src: Source, parent: Path, fault=None, on_step=None) -> Path:
    """Copy `src` into `parent/.tmp-<id>`, verify it, seal it and rename it to `parent/<id>`
    (an existing `parent/<id>` is verified and kept). `on_step(name)` is called after each of
    "copied", "verified" and "renamed". Returns the instance's path."""
    step = on_step or (lambda name: None)
    final, tmp = parent / src.id, parent / f".tmp-{src.id}"
    if final.exists():
        problems = verify(final, src)
        if problems:
            raise LaneError(f"{final} differs from its manifest (tampered with?):"
                            + listing(problems))
        for name in ("copied", "verified", "renamed"):
            step(name)
        return final
    force_rmtree(tmp)
    try:
        materialize(src, tmp, fault)
        step("copied")
        problems = verify(tmp, src)
        if problems:
            raise LaneError(f"the copy of {src.dir} does not match its manifest (the source "
                            f"was tampered with or changed while copying):"
                            + listing(problems))
        seal(tmp)
        step("verified")
    except BaseException:
        force_rmtree(tmp)
        raise
    os.rename(tmp, final)
    fsync_dir(parent)
    step("renamed")
    return final


def pack(out: Path) -> tuple[str, Path]:
    """`./ninfer lane pack`: this tree as an instance under `out`; (id, path)."""
    src = Source.from_tree()
    out.mkdir(parents=True, exist_ok=True)
    return src.id, publish(src, out)
