"""The `.ninfer` model artifact: one file, memory-mapped for reading, every byte hashed.

Layout (docs/formats/artifact.md is the full specification):

    [0, 4096)           header: magic, version, alignment, directory offset/length/sha256; zeros
    [4096, D)           payloads, in the order the writer received them, each part starting on a
                        4096-byte boundary (zero padding between parts)
    [D, D + len)        the directory: canonical JSON (sorted keys, no whitespace, ASCII), the last
                        bytes of the file

The writer streams: payloads go out as the tensors arrive, so it never holds more than one tensor,
and the directory (which needs every offset and per-part sha256) is written last; the header is
patched at offset 0 once the directory is known. The file's identity is the sha256 of all its bytes.
The format's constants, checks and hashing are in engine/io/artifact_format.py.
"""
from __future__ import annotations

import hashlib
import math
import mmap
import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from engine.io.artifact_format import (ALIGN, FORMAT_VERSION, HEADER, IO_CHUNK,
                                       MAGIC, ArtifactError, canonical_json, check_directory,
                                       check_entry, hash_pass, read_directory)
from engine.model.config import ModelConfig
from engine.ops.quant import DENSE, DENSE_DTYPES, DTYPES, QTensor, QuantError, dtype_name

Progress = Callable[[int, int, str, int], None]  # (tensors done, tensors total, name, bytes so far)


# ---- writing ----------------------------------------------------------------------------------
def write_artifact(path, cfg: ModelConfig, tensors: Iterable[tuple[str, object]], *,
                   tokenizer_json: str | None = None, chat_template: str | None = None,
                   source: dict | None = None, special_tokens: dict | None = None,
                   extra: dict | None = None, progress: Progress | None = None) -> str:
    """Write the artifact atomically at `path`; returns its sha256 (hex).

    `tensors` yields (canonical name, value) one at a time, value a numpy-convertible fp32/bf16
    array or a QTensor; exactly the names of cfg.tensor_specs() must appear, once each, with their
    logical shapes. The file is built at `path.tmp-<pid>`, fsync'd and renamed: `path` is either
    the old file or the complete new one. Identical inputs give a byte-identical file.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    specs = cfg.tensor_specs()
    table: dict[str, dict] = {}
    try:
        with open(tmp, "wb") as f:
            f.write(bytes(ALIGN))  # header placeholder, patched below
            pos = ALIGN
            for name, value in tensors:
                if name not in specs:
                    raise ArtifactError(f"tensor {name!r} is not part of model {cfg.name!r} "
                                        "(unexpected tensor)")
                if name in table:
                    raise ArtifactError(f"tensor {name!r} given twice")
                table[name], pos = _write_tensor(f, pos, name, value)
                check_entry(name, table[name], specs[name])
                del value  # do not hold this tensor while the iterable makes the next one
                if progress:
                    progress(len(table), len(specs), name, pos)
            missing = [n for n in specs if n not in table]
            if missing:
                raise ArtifactError(f"{len(missing)} tensors missing from the artifact, e.g. "
                                    f"{missing[:5]}")
            directory = {
                "format_version": FORMAT_VERSION,
                "alignment": ALIGN,
                "model": {"name": cfg.name, "config": cfg.to_dict(),
                          "config_hash": cfg.canonical_hash()},
                "source": source,
                "tokenizer": tokenizer_json,
                "chat_template": chat_template,
                "special_tokens": special_tokens,
                "extra": extra,
                "tensors": table,
            }
            blob = canonical_json(directory)
            f.write(blob)
            f.seek(0)
            f.write(HEADER.pack(MAGIC, FORMAT_VERSION, ALIGN, pos, len(blob),
                                 hashlib.sha256(blob).digest()))
            f.flush()
            os.fsync(f.fileno())
        sha = _hash_file(tmp)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        return sha
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_tensor(f, pos: int, name: str, value) -> tuple[dict, int]:
    if isinstance(value, QTensor):
        parts = {k: np.asarray(v) for k, v in value.parts().items()}
        fmt, shape = value.fmt, [int(d) for d in value.shape]
    else:
        parts = {"data": np.asarray(value)}
        fmt, shape = DENSE, [int(d) for d in parts["data"].shape]
    entry = {"format": fmt, "shape": shape, "parts": {}}
    for part, arr in parts.items():
        try:
            dt = dtype_name(arr.dtype)
        except QuantError:
            raise ArtifactError(f"tensor {name!r} part {part!r}: dtype {arr.dtype} cannot be "
                                f"stored (dense tensors are {list(DENSE_DTYPES)})") from None
        entry["parts"][part], pos = _write_part(f, pos, arr)
        entry["parts"][part]["dtype"] = dt
    entry["dtype"] = entry["parts"]["data"]["dtype"]
    return entry, pos


def _write_part(f, pos: int, arr: np.ndarray) -> tuple[dict, int]:
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    flat = arr.reshape(-1).view(np.uint8)  # a view: no copy of a contiguous array
    h = hashlib.sha256()
    for i in range(0, flat.size, IO_CHUNK):
        chunk = memoryview(flat[i:i + IO_CHUNK])
        h.update(chunk)
        f.write(chunk)
    end = pos + flat.size
    pad = -end % ALIGN
    f.write(bytes(pad))
    part = {"offset": pos, "bytes": int(flat.size), "shape": [int(d) for d in arr.shape],
            "sha256": h.hexdigest()}
    return part, end + pad


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_file(path) -> str:
    with open(path, "rb") as f:
        return hash_pass(f, os.fstat(f.fileno()).st_size, [])[0]


# ---- reading ----------------------------------------------------------------------------------
class Artifact:
    """An open, checked .ninfer file. Tensors are read-only numpy views of the memory map."""

    def __init__(self, path: Path, f, size: int, directory: dict, config: ModelConfig,
                 sha256: str | None):
        self.path = path
        self._f = f
        self._size = size
        self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.directory = directory
        self.config = config
        self._sha256 = sha256
        self._table: dict[str, dict] = directory["tensors"]
        # File order (the order the writer streamed them), for sequential reads.
        self.tensor_names: list[str] = sorted(
            self._table, key=lambda n: self._table[n]["parts"]["data"]["offset"])

    @property
    def sha256(self) -> str:
        """sha256 of the whole file, the artifact's identity (hashed on first use if not yet)."""
        if self._sha256 is None:
            self._sha256 = hash_pass(self._f, self._size, [])[0]
        return self._sha256

    tokenizer_json = property(lambda self: self.directory["tokenizer"])
    chat_template = property(lambda self: self.directory["chat_template"])
    special_tokens = property(lambda self: self.directory["special_tokens"])
    source = property(lambda self: self.directory["source"])
    extra = property(lambda self: self.directory["extra"])

    def entry(self, name: str) -> dict:
        """The directory entry of `name`: format, dtype, logical shape, parts."""
        try:
            return self._table[name]
        except KeyError:
            raise ArtifactError(f"{self.path}: no tensor {name!r}") from None

    def load(self, name: str):
        """A read-only numpy array (dense) or a QTensor of numpy arrays, without copying."""
        e = self.entry(name)
        parts = {k: np.frombuffer(self._mm, dtype=DTYPES[p["dtype"]],
                                  count=math.prod(p["shape"]), offset=p["offset"])
                 .reshape(p["shape"]) for k, p in e["parts"].items()}
        if e["format"] == DENSE:
            return parts["data"]
        return QTensor(data=parts["data"], scale=parts["scale"], fmt=e["format"],
                       shape=tuple(e["shape"]))

    def load_all(self) -> dict:
        return {n: self.load(n) for n in self.tensor_names}

    def verify(self) -> None:
        """Re-hash every byte: the file sha256 and each part's sha256 against the directory."""
        parts = [(p["offset"], p["bytes"], p["sha256"], f"{n}/{k}")
                 for n, e in self._table.items() for k, p in e["parts"].items()]
        sha, bad = hash_pass(self._f, self._size, parts)
        self._sha256 = sha
        if bad:
            raise ArtifactError(f"{self.path}: payload hash mismatch in {len(bad)} part(s), "
                                f"e.g. {bad[:3]}: the file is corrupt")

    def stat(self) -> os.stat_result:
        """fstat of the descriptor this artifact reads (not of its path, which may be swapped)."""
        return os.fstat(self._f.fileno())

    def adopt_sha256(self, sha256: str) -> None:
        """Take the file's sha256 from a trusted record of an earlier full verification (a
        verified-artifact stamp) instead of hashing it again."""
        self._sha256 = sha256

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass  # arrays returned by load() still view the map; it closes when they are gone
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_artifact(path, *, expected_sha256: str | None = None, verify: bool = True) -> Artifact:
    """Open and check a .ninfer file; raises ArtifactError saying what is wrong.

    Always checked: header, directory hash, config, that the tensor table matches
    config.tensor_specs() (names, shapes, formats, dtypes, byte counts, offsets). `verify` also
    re-hashes every payload; `expected_sha256` also compares the whole file's sha256.
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ArtifactError(f"cannot open artifact {path}: {e.strerror}") from None
    try:
        size = os.fstat(f.fileno()).st_size
        directory, dir_offset = read_directory(f, size, path)
        config = check_directory(directory, dir_offset, path)
        art = Artifact(path, f, size, directory, config, None)
    except BaseException:
        f.close()
        raise
    try:
        if verify:
            art.verify()
        if expected_sha256 is not None and art.sha256 != expected_sha256.lower():
            raise ArtifactError(f"{path}: sha256 is {art.sha256}, not the expected "
                                f"{expected_sha256}")
    except BaseException:
        art.close()
        raise
    return art
