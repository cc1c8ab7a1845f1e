"""What one lane's release contains, as the SBOM writers (sbom/spdx.py, sbom/cyclonedx.py) see it.

An `Inventory` holds the lane's Python distributions (from its hashed lock), its files (CUDA op
libraries, the engine bundle), the model's identity and the OMP client's npm packages (from
tests/omp/package-lock.json). Every collection is normalized to a tuple sorted by name and
version, so two inventories built from the same inputs are equal and serialize identically.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

from release.lockfile import Dist, parse

OMP_CLIENT = "@oh-my-pi/pi-coding-agent"
# the OMP client's lock in this repository, what `inventory_for_lane` reads unless told otherwise
OMP_LOCK = Path(__file__).resolve().parents[1] / "tests" / "omp" / "package-lock.json"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHA1 = re.compile(r"^[0-9a-f]{40}$")


class InventoryError(ValueError):
    pass


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the release's lane directory, POSIX separators, e.g. cuda/x.so
    sha256: str
    sha1: str
    kind: str  # "cuda-op", "engine-bundle", or another short word

    def __post_init__(self):
        if self.path.startswith("/") or ".." in self.path.split("/") or "\\" in self.path:
            raise InventoryError(f"file path must be relative POSIX: {self.path!r}")
        if not _SHA256.match(self.sha256) or not _SHA1.match(self.sha1):
            raise InventoryError(f"{self.path}: sha256/sha1 must be lower-case hex")

    @classmethod
    def from_path(cls, disk_path: Path | str, path: str, kind: str) -> FileEntry:
        """The entry for a file on disk, hashed here; `path` is the name it has in the release."""
        h256, h1 = hashlib.sha256(), hashlib.sha1()
        with open(disk_path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h256.update(chunk)
                h1.update(chunk)
        return cls(path, h256.hexdigest(), h1.hexdigest(), kind)


@dataclass(frozen=True)
class ModelIdentity:
    name: str  # e.g. "qwen3.8-27b-int4" or "tiny"
    preset: str  # the architecture preset, e.g. "qwen3.8-27b"
    weights: str  # the weight format, e.g. "int4", "float32"
    sha256: str | None  # the .ninfer artifact's sha256; None while the lane pins none
    source: str  # where the weights come from, e.g. "embedded:tiny" or an https URL

    def __post_init__(self):
        if self.sha256 is not None and not _SHA256.match(self.sha256):
            raise InventoryError(f"model {self.name}: sha256 must be 64 lower-case hex or None")


@dataclass(frozen=True)
class NpmPackage:
    name: str  # e.g. "@oh-my-pi/pi-coding-agent"
    version: str
    integrity: str  # the lock's SRI string ("sha512-<base64>"); "" where the lock has none
    resolved: str  # the lock's tarball URL; "" where the lock has none
    depends: tuple[str, ...] = ()  # keys (`name@version`) of the packages it resolves to
    client: bool = False  # the OMP client itself

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def purl(self) -> str:
        return f"pkg:npm/{quote(self.name, safe='/')}@{quote(self.version, safe='')}"

    @property
    def sha512(self) -> str | None:
        """The integrity's sha512 digest as lower-case hex, or None without a sha512 entry."""
        for part in self.integrity.split():
            algo, _, b64 = part.partition("-")
            if algo == "sha512":
                try:
                    raw = base64.b64decode(b64, validate=True)
                except ValueError as e:
                    raise InventoryError(f"{self.key}: integrity is not base64: {e}") from None
                if len(raw) != 64:
                    raise InventoryError(f"{self.key}: sha512 integrity is {len(raw)} bytes")
                return raw.hex()
        return None


def _created(value: str) -> str:
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as e:
        raise InventoryError(f"created is not ISO-8601: {value!r}") from e
    if when.tzinfo is None:
        raise InventoryError(f"created must carry a UTC offset: {value!r}")
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Inventory:
    lane: str
    version: str  # the release version, e.g. "0.16.0"
    created: str  # ISO-8601 UTC, fixed by the caller; normalized to YYYY-MM-DDTHH:MM:SSZ
    dists: tuple[Dist, ...]
    files: tuple[FileEntry, ...]
    model: ModelIdentity
    npm: tuple[NpmPackage, ...] = field(default=())

    def __post_init__(self):
        # lists are accepted; stored as tuples sorted by name and version
        object.__setattr__(self, "created", _created(self.created))
        object.__setattr__(self, "dists", tuple(sorted(self.dists, key=lambda d: (d.name, d.version))))
        object.__setattr__(self, "files", tuple(sorted(self.files, key=lambda f: f.path)))
        object.__setattr__(self, "npm", tuple(sorted(self.npm, key=lambda p: (p.name, p.version))))
        for label, keys in (("dist", [(d.name, d.version) for d in self.dists]),
                            ("file", [f.path for f in self.files]),
                            ("npm package", [p.key for p in self.npm])):
            if len(set(keys)) != len(keys):
                raise InventoryError(f"duplicate {label} in inventory {self.lane}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.lane):
            raise InventoryError(f"lane name {self.lane!r} is not a plain word")

    @property
    def created_dt(self) -> datetime:
        return datetime.strptime(self.created, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)

    @property
    def client(self) -> NpmPackage | None:
        return next((p for p in self.npm if p.client), None)

    def content_hash(self) -> str:
        """sha256 of the inventory's canonical JSON: what the SBOM identifiers derive from."""
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(blob.encode()).hexdigest()


def _resolve(packages: dict, at: str, dep: str) -> str | None:
    """The lock key Node's module resolution finds for `dep` required from the package at `at`."""
    base = at
    while True:
        cand = f"{base}/node_modules/{dep}" if base else f"node_modules/{dep}"
        if cand in packages:
            return cand
        if not base:
            return None
        cut = base.rfind("/node_modules/")
        base = base[:cut] if cut >= 0 else ""


def omp_packages(package_lock_path: Path | str, client: str = OMP_CLIENT) -> tuple[NpmPackage, ...]:
    """Every installed package of an npm v2/v3 `package-lock.json` (the root project itself left
    out), one per name@version (a copy nested at several paths is one package), with the
    packages each depends on as Node would resolve them. The top-level `client` is marked."""
    lock = json.loads(Path(package_lock_path).read_text())
    packages = lock.get("packages")
    if not isinstance(packages, dict):
        raise InventoryError(f"{package_lock_path}: no `packages` (lockfileVersion 2 or 3 needed)")
    found: dict[str, NpmPackage] = {}
    for key in sorted(packages):
        meta = packages[key]
        if not key or meta.get("link"):
            continue
        name = meta.get("name") or key.rsplit("node_modules/", 1)[1]
        deps = {}
        for field_name in ("dependencies", "optionalDependencies", "peerDependencies"):
            deps.update(meta.get(field_name) or {})
        targets = []
        for dep in sorted(deps):
            hit = _resolve(packages, key, dep)
            if hit is not None:  # an optional dependency for another platform is not installed
                hit_meta = packages[hit]
                targets.append(f"{hit_meta.get('name') or dep}@{hit_meta['version']}")
        pkg = NpmPackage(name, meta["version"], meta.get("integrity", ""), meta.get("resolved", ""),
                         tuple(sorted(set(targets))), key == f"node_modules/{client}")
        prev = found.get(pkg.key)
        if prev is not None:
            if prev.integrity != pkg.integrity:
                raise InventoryError(f"{package_lock_path}: {pkg.key} locked with two integrities")
            pkg = NpmPackage(pkg.name, pkg.version, pkg.integrity, prev.resolved or pkg.resolved,
                             tuple(sorted(set(prev.depends) | set(pkg.depends))),
                             prev.client or pkg.client)
        found[pkg.key] = pkg
    if not any(p.client for p in found.values()):
        raise InventoryError(f"{package_lock_path}: client {client} is not a top-level package")
    return tuple(found[k] for k in sorted(found))


def inventory_for_lane(lane: str, lock_path: Path | str, files, model: ModelIdentity,
                       created: str, version: str,
                       package_lock_path: Path | str | None = OMP_LOCK) -> Inventory:
    """The inventory of one lane: dists from its hashed lock, the given FileEntry list and model,
    and the OMP client's npm packages from `package_lock_path` (None: no npm packages)."""
    npm = omp_packages(package_lock_path) if package_lock_path is not None else ()
    return Inventory(lane, version, created, parse(lock_path), list(files), model, npm)
