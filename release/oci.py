"""OCI image layouts written in pure Python, byte-identical from the same inputs.

A `Layer` is a list of entries (directories, regular files, symlinks) written as a
deterministic tar: PAX format, entries sorted by path, every parent directory present, one
fixed mtime (the epoch passed in), uid/gid 0 with empty user and group names, modes normalized
(directories 0755, files 0755 when any exec bit is set, else 0644). Symlinks are stored as
symlinks (never followed). The tar is gzipped with mtime 0, no file name and a fixed level,
and streamed to disk while both digests (compressed: the blob; uncompressed: the diff_id) are
taken, so a layer of gigabytes never sits in memory.

`write_layout` writes an OCI image layout (oci-layout, index.json, blobs/sha256/...) and
returns its digests; `verify_layout` checks one and names every problem it finds.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

LAYOUT_VERSION = "1.0.0"
MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
REF_NAME = "org.opencontainers.image.ref.name"
GZIP_LEVEL = 6  # the default level: see release/image.py for the measured trade-off
_CHUNK = 1 << 20


class OCIError(ValueError):
    pass


@dataclass(frozen=True)
class Entry:
    """One tar member. kind: 'dir', 'file' or 'symlink'; source: a Path or bytes for a
    file, the link target (str) for a symlink, None for a directory."""
    arcname: str
    kind: str
    source: object = None
    executable: bool = False


def _clean(arcname: str) -> str:
    parts = [p for p in arcname.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise OCIError(f"{arcname!r}: not a relative path inside the layer")
    return "/".join(parts)


class Layer:
    """A filesystem layer. Build one with `from_tree`, `from_items`, or from `Entry`s; `+`
    joins two (an arcname in both is an error)."""

    def __init__(self, entries=()):
        self._entries: dict[str, Entry] = {}
        for e in entries:
            self.add(e)

    def add(self, entry: Entry) -> None:
        name = _clean(entry.arcname)
        if name in self._entries and not (entry.kind == "dir" == self._entries[name].kind):
            raise OCIError(f"{name}: twice in one layer")
        self._entries[name] = Entry(name, entry.kind, entry.source, entry.executable)

    def __add__(self, other: "Layer") -> "Layer":
        return Layer(list(self._entries.values()) + list(other._entries.values()))

    @classmethod
    def from_tree(cls, root: Path | str, prefix: str = "") -> "Layer":
        """Everything under `root` (not root itself), at `prefix`/relative path. Hard links
        become separate files; sockets, FIFOs and devices are an error."""
        root = Path(root)
        layer = cls()
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                arc = f"{prefix}/{path.relative_to(root).as_posix()}"
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    layer.add(Entry(arc, "symlink", os.readlink(path)))
                elif stat.S_ISDIR(st.st_mode):
                    layer.add(Entry(arc, "dir"))
                elif stat.S_ISREG(st.st_mode):
                    layer.add(Entry(arc, "file", path, bool(st.st_mode & 0o111)))
                else:
                    raise OCIError(f"{path}: not a file, directory or symlink")
        return layer

    @classmethod
    def from_items(cls, items) -> "Layer":
        """From (arcname, source, mode) triples: source is a Path (a file), bytes (a file's
        content) or None (a directory); only mode's exec bits are kept."""
        layer = cls()
        for arcname, source, mode in items:
            if source is None:
                layer.add(Entry(arcname, "dir"))
            else:
                layer.add(Entry(arcname, "file", source, bool(mode & 0o111)))
        return layer

    def entries(self) -> list[Entry]:
        """All entries, every missing parent directory added, sorted by path."""
        names = dict(self._entries)
        for name in list(names):
            parts = name.split("/")
            for i in range(1, len(parts)):
                names.setdefault("/".join(parts[:i]), Entry("/".join(parts[:i]), "dir"))
        for name, e in names.items():
            parent = name.rpartition("/")[0]
            if parent and names[parent].kind != "dir":
                raise OCIError(f"{name}: its parent {parent} is not a directory")
        return [names[n] for n in sorted(names)]

    def write(self, fileobj, *, epoch: int, level: int = GZIP_LEVEL) -> tuple[str, str, int]:
        """Write the gzipped tar to `fileobj`; return (blob sha256, diff_id sha256, size)."""
        blob = _Hashing(fileobj)
        gz = gzip.GzipFile(filename="", mode="wb", fileobj=blob, mtime=0, compresslevel=level)
        raw = _Hashing(gz)
        with tarfile.open(fileobj=raw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for e in self.entries():
                info = tarfile.TarInfo(e.arcname)
                info.mtime, info.uid, info.gid, info.uname, info.gname = int(epoch), 0, 0, "", ""
                if e.kind == "dir":
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                elif e.kind == "symlink":
                    info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, str(e.source)
                    tar.addfile(info)
                else:
                    info.mode = 0o755 if e.executable else 0o644
                    if isinstance(e.source, (bytes, bytearray)):
                        info.size = len(e.source)
                        tar.addfile(info, io.BytesIO(e.source))
                    else:
                        with open(e.source, "rb") as f:
                            info.size = os.fstat(f.fileno()).st_size
                            tar.addfile(info, f)
        gz.close()
        return blob.hexdigest(), raw.hexdigest(), blob.size


class _Hashing:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, inner):
        self.inner, self.h, self.size = inner, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.h.update(data)
        self.size += len(data)
        self.inner.write(data)
        return len(data)

    def flush(self) -> None:
        self.inner.flush()

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _put_blob(blobs: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def write_layout(out_dir: Path | str, layers: list[Layer], config: dict, ref_name: str, *,
                 epoch: int, level: int = GZIP_LEVEL) -> dict:
    """Write an OCI image layout of `layers` (bottom first) to `out_dir` (created; an earlier
    layout there is replaced; any other non-empty directory is an error). `config` is the
    image config without rootfs (added here: the layers' diff_ids) and without `created`
    (set to `epoch`). Returns the digests and sizes: {index, manifest, config, layers[],
    diff_ids[], sizes: {manifest, config, layers[]}, timings_s: {layers[]}}."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not (out / "oci-layout").is_file():
            raise OCIError(f"{out}: not empty and not an image layout; not replacing it")
        shutil.rmtree(out)
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    layer_descs, diff_ids, secs = [], [], []
    for i, layer in enumerate(layers):
        t0 = time.monotonic()
        tmp = blobs / f".layer-{i}.tmp"
        with open(tmp, "wb") as f:
            digest, diff_id, size = layer.write(f, epoch=epoch, level=level)
        os.replace(tmp, blobs / digest)
        secs.append(round(time.monotonic() - t0, 2))
        layer_descs.append({"mediaType": MT_LAYER, "digest": f"sha256:{digest}", "size": size})
        diff_ids.append(f"sha256:{diff_id}")
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(epoch)))
    cfg = dict(config, created=created, rootfs={"type": "layers", "diff_ids": diff_ids})
    cfg_digest, cfg_size = _put_blob(blobs, canonical_json(cfg))
    manifest = {"schemaVersion": 2, "mediaType": MT_MANIFEST,
                "config": {"mediaType": MT_CONFIG, "digest": cfg_digest, "size": cfg_size},
                "layers": layer_descs}
    man_digest, man_size = _put_blob(blobs, canonical_json(manifest))
    index = {"schemaVersion": 2, "mediaType": MT_INDEX,
             "manifests": [{"mediaType": MT_MANIFEST, "digest": man_digest, "size": man_size,
                            "annotations": {REF_NAME: ref_name}}]}
    index_bytes = canonical_json(index)
    (out / "index.json").write_bytes(index_bytes)
    (out / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": LAYOUT_VERSION}))
    return {"index": "sha256:" + hashlib.sha256(index_bytes).hexdigest(),
            "manifest": man_digest, "config": cfg_digest,
            "layers": [d["digest"] for d in layer_descs], "diff_ids": diff_ids,
            "sizes": {"manifest": man_size, "config": cfg_size,
                      "layers": [d["size"] for d in layer_descs]},
            "timings_s": {"layers": secs}}


def _file_digest(path: Path, *, gunzip: bool = False) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as raw:
        f = gzip.GzipFile(fileobj=raw, mode="rb") if gunzip else raw
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return "sha256:" + h.hexdigest(), n


def _load_json(path: Path, what: str, problems: list[str]):
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        problems.append(f"{path.name}: {what} does not parse as JSON ({e})")
        return None


def _check_blob(root: Path, desc, what: str, problems: list[str], seen: set[str]) -> Path | None:
    """Check one descriptor's blob (exists, sha256, size); its path when they match."""
    if not isinstance(desc, dict) or not isinstance(desc.get("digest"), str):
        problems.append(f"{what}: descriptor has no digest")
        return None
    digest = desc["digest"]
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or len(hexd) != 64:
        problems.append(f"{what}: unsupported digest {digest!r}")
        return None
    seen.add(hexd)
    path = root / "blobs" / "sha256" / hexd
    rel = f"blobs/sha256/{hexd}"
    if not path.is_file():
        problems.append(f"{rel}: missing ({what})")
        return None
    actual, size = _file_digest(path)
    ok = True
    if actual != digest:
        problems.append(f"{rel}: sha256 mismatch ({what}): content is {actual}")
        ok = False
    if desc.get("size") != size:
        problems.append(f"{rel}: size mismatch ({what}): {desc.get('size')} declared, "
                        f"{size} on disk")
        ok = False
    return path if ok else None


def verify_layout(layout_dir: Path | str) -> list[str]:
    """Every problem with the image layout at `layout_dir`, each naming the file and the
    check; [] when it is sound. Checks: oci-layout and its version; index.json parses; each
    manifest's, config's and layer's sha256 and size; each layer's uncompressed sha256
    against the config's diff_ids; no blob missing and none unreferenced."""
    root = Path(layout_dir)
    problems: list[str] = []
    seen: set[str] = set()
    layout = None
    if (root / "oci-layout").is_file():
        layout = _load_json(root / "oci-layout", "oci-layout", problems)
    else:
        problems.append("oci-layout: missing")
    if isinstance(layout, dict) and layout.get("imageLayoutVersion") != LAYOUT_VERSION:
        problems.append(f"oci-layout: imageLayoutVersion is {layout.get('imageLayoutVersion')!r}"
                        f", not {LAYOUT_VERSION!r}")
    if not (root / "index.json").is_file():
        problems.append("index.json: missing")
        index = None
    else:
        index = _load_json(root / "index.json", "index", problems)
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if index is not None and not isinstance(manifests, list):
        problems.append("index.json: no manifests list")
    for i, mdesc in enumerate(manifests or []):
        what = f"index.json manifests[{i}]"
        if isinstance(mdesc, dict) and mdesc.get("mediaType") != MT_MANIFEST:
            problems.append(f"{what}: mediaType {mdesc.get('mediaType')!r} is not an image "
                            f"manifest")
        mpath = _check_blob(root, mdesc, f"manifest of {what}", problems, seen)
        if mpath is None:
            continue
        manifest = _load_json(mpath, f"manifest of {what}", problems)
        if not isinstance(manifest, dict):
            continue
        cpath = _check_blob(root, manifest.get("config"), f"config of {mpath.name}", problems,
                            seen)
        config = _load_json(cpath, f"config of {mpath.name}", problems) if cpath else None
        diff_ids = ((config or {}).get("rootfs") or {}).get("diff_ids") \
            if isinstance(config, dict) else None
        layers = manifest.get("layers") or []
        if diff_ids is not None and len(diff_ids) != len(layers):
            problems.append(f"blobs/sha256/{cpath.name}: config has {len(diff_ids)} diff_ids, "
                            f"the manifest {len(layers)} layers")
        for j, ldesc in enumerate(layers):
            lpath = _check_blob(root, ldesc, f"layer {j} of {mpath.name}", problems, seen)
            if lpath is None or diff_ids is None or j >= len(diff_ids):
                continue
            try:
                diff_id, _ = _file_digest(lpath, gunzip=True)
            except (OSError, EOFError, gzip.BadGzipFile) as e:
                problems.append(f"blobs/sha256/{lpath.name}: layer {j} does not gunzip ({e})")
                continue
            if diff_id != diff_ids[j]:
                problems.append(f"blobs/sha256/{lpath.name}: layer {j} uncompressed sha256 "
                                f"{diff_id} differs from the config's diff_ids[{j}] "
                                f"{diff_ids[j]}")
    blob_dir = root / "blobs" / "sha256"
    on_disk = {p.name for p in blob_dir.iterdir()} if blob_dir.is_dir() else set()
    for extra in sorted(on_disk - seen):
        problems.append(f"blobs/sha256/{extra}: unreferenced blob")
    return problems
