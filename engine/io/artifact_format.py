"""The `.ninfer` artifact's format: header, directory and tensor-entry checks, hashing.

A file is a 4096-byte header (magic, version, alignment, the directory's offset, length and
sha256), the payloads, each part on a 4096-byte boundary, and last the directory: canonical
JSON of the model config and the tensor table (docs/formats/artifact.md is the full
specification). engine/io/artifact.py writes and opens files of this format.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import struct
from pathlib import Path

from engine.model.config import ConfigError, ModelConfig
from engine.ops.quant import DENSE, DENSE_DTYPES, DTYPES, FORMATS, QuantError, part_layout

MAGIC = b"NINFER\x00\x01"
FORMAT_VERSION = 1
ALIGN = 4096
# magic, format version, alignment, directory offset, directory length, directory sha256
HEADER = struct.Struct("<8sIIQQ32s")
IO_CHUNK = 16 << 20  # bytes per write / hash step: bounds the writer's and verifier's buffers


class ArtifactError(ValueError):
    """A .ninfer file that is malformed, corrupt, incomplete or not the one expected."""


def canonical_json(obj) -> bytes:
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False).encode("ascii")
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"artifact directory is not canonical JSON: {e}") from None


def check_entry(name: str, e: dict, spec_shape: tuple[int, ...]) -> None:
    """Raise ArtifactError unless entry `e` is a well-formed tensor of logical shape spec_shape."""
    def bad(msg: str):
        raise ArtifactError(f"tensor {name!r}: {msg}")

    if not isinstance(e, dict) or not isinstance(e.get("parts"), dict):
        bad("malformed tensor entry")
    fmt = e.get("format")
    if fmt not in FORMATS:
        bad(f"unknown format {fmt!r}; known: {list(FORMATS)}")
    if e.get("shape") != list(spec_shape):
        bad(f"shape mismatch: stored {e.get('shape')}, the model config says {list(spec_shape)}")
    if fmt == DENSE:
        data = e["parts"].get("data")
        dt = data.get("dtype") if isinstance(data, dict) else None
        if dt not in DENSE_DTYPES:
            bad(f"dense dtype {dt!r} is not one of {list(DENSE_DTYPES)} (mislabelled dtype?)")
        want = {"data": (dt, tuple(spec_shape))}
    else:
        try:
            want = part_layout(fmt, tuple(spec_shape))
        except QuantError as err:
            bad(str(err))
    if set(e["parts"]) != set(want):
        bad(f"format {fmt} has parts {sorted(want)}, found {sorted(e['parts'])}")
    if e.get("dtype") != want["data"][0]:
        bad(f"dtype {e.get('dtype')!r} does not match its data part ({want['data'][0]}): "
            "mislabelled dtype")
    for part, (dt, shape) in want.items():
        p = e["parts"][part]
        if not isinstance(p, dict):
            bad(f"part {part!r} is malformed")
        if p.get("dtype") != dt:
            bad(f"part {part!r} has dtype {p.get('dtype')!r}, format {fmt} needs {dt} "
                "(mislabelled dtype)")
        if p.get("shape") != list(shape):
            bad(f"part {part!r} shape mismatch: {p.get('shape')} != {list(shape)}")
        nbytes = math.prod(shape) * DTYPES[dt].itemsize
        if p.get("bytes") != nbytes:
            bad(f"part {part!r} holds {p.get('bytes')} bytes but {dt}{list(shape)} is {nbytes} "
                "bytes (mislabelled dtype or shape)")
        off = p.get("offset")
        if not isinstance(off, int) or off < ALIGN or off % ALIGN:
            bad(f"part {part!r} offset {off!r} is not a multiple of {ALIGN} past the header")
        if not (isinstance(p.get("sha256"), str) and len(p["sha256"]) == 64):
            bad(f"part {part!r} has no sha256")


def read_directory(f, size: int, path: Path) -> tuple[dict, int]:
    if size < HEADER.size:
        raise ArtifactError(f"{path}: truncated: {size} bytes, shorter than the header")
    magic, version, align, off, length, digest = HEADER.unpack(f.read(HEADER.size))
    if magic != MAGIC:
        raise ArtifactError(f"{path}: bad magic {magic!r}: not a .ninfer artifact")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path}: unsupported format version {version} (this engine reads "
                            f"version {FORMAT_VERSION})")
    if align != ALIGN or off < ALIGN or off % ALIGN:
        raise ArtifactError(f"{path}: malformed header (alignment {align}, directory at {off})")
    if off + length > size:
        raise ArtifactError(f"{path}: truncated: the directory ends at byte {off + length} but "
                            f"the file has {size} bytes")
    if off + length < size:
        raise ArtifactError(f"{path}: {size - off - length} unexpected trailing bytes after the "
                            "directory")
    f.seek(off)
    blob = f.read(length)
    if hashlib.sha256(blob).digest() != digest:
        raise ArtifactError(f"{path}: directory hash mismatch: the directory is corrupt")
    try:
        directory = json.loads(blob)
    except ValueError as e:
        raise ArtifactError(f"{path}: directory is not valid JSON: {e}") from None
    if not isinstance(directory, dict):
        raise ArtifactError(f"{path}: directory is not a JSON object")
    return directory, off


def check_directory(d: dict, dir_offset: int, path: Path) -> ModelConfig:
    keys = {"format_version", "alignment", "model", "source", "tokenizer", "chat_template",
            "special_tokens", "extra", "tensors"}
    if set(d) != keys:
        raise ArtifactError(f"{path}: directory keys {sorted(d)} are not {sorted(keys)}")
    if d["format_version"] != FORMAT_VERSION:
        raise ArtifactError(f"{path}: directory says format version {d['format_version']!r}, "
                            f"header says {FORMAT_VERSION}")
    for k in ("tokenizer", "chat_template"):
        if d[k] is not None and not isinstance(d[k], str):
            raise ArtifactError(f"{path}: {k} must be text or null")
    model = d["model"]
    try:
        cfg = ModelConfig.from_dict(model["config"])
    except (ConfigError, KeyError, TypeError) as e:
        raise ArtifactError(f"{path}: bad model config: {e}") from None
    if model.get("config_hash") != cfg.canonical_hash() or model.get("name") != cfg.name:
        raise ArtifactError(f"{path}: model identity (name, config_hash) does not match its config")
    table, specs = d["tensors"], cfg.tensor_specs()
    if not isinstance(table, dict):
        raise ArtifactError(f"{path}: tensor table is not an object")
    missing = [n for n in specs if n not in table]
    unexpected = sorted(n for n in table if n not in specs)
    if missing:
        raise ArtifactError(f"{path}: {len(missing)} tensor(s) missing for model {cfg.name!r}, "
                            f"e.g. {missing[:5]}")
    if unexpected:
        raise ArtifactError(f"{path}: {len(unexpected)} unexpected tensor(s) not in model "
                            f"{cfg.name!r}, e.g. {unexpected[:5]}")
    spans = []
    for name, spec in specs.items():
        try:
            check_entry(name, table[name], spec)
        except ArtifactError as e:
            raise ArtifactError(f"{path}: {e}") from None
        spans += [(p["offset"], p["offset"] + p["bytes"], f"{name}/{k}")
                  for k, p in table[name]["parts"].items()]
    spans.sort()
    for (s0, e0, a), (s1, _, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ArtifactError(f"{path}: payloads {a} and {b} overlap")
    if spans and spans[-1][1] > dir_offset:
        raise ArtifactError(f"{path}: payload {spans[-1][2]} runs into the directory (truncated?)")
    return cfg


def hash_pass(f, size: int, parts: list[tuple[int, int, str, str]]) -> tuple[str, list[str]]:
    """One sequential read: the whole file's sha256, and the labels of parts whose sha256 differ.

    parts: (offset, nbytes, expected sha256 hex, label), non-overlapping. The file hash runs on a
    second thread (hashlib releases the GIL), so both hashes cost about one.
    """
    parts = sorted(parts)
    hashers = [hashlib.sha256() for _ in parts]
    whole = hashlib.sha256()
    buf = bytearray(IO_CHUNK)
    k, pos = 0, 0
    f.seek(0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        while pos < size:
            n = f.readinto(buf)
            if not n:
                raise ArtifactError(f"file shrank while reading at byte {pos}")
            view = memoryview(buf)[:n]
            job = pool.submit(whole.update, view)
            end = pos + n
            while k < len(parts) and parts[k][0] + parts[k][1] <= pos:
                k += 1
            j = k
            while j < len(parts) and parts[j][0] < end:
                lo, hi = max(parts[j][0], pos), min(parts[j][0] + parts[j][1], end)
                hashers[j].update(view[lo - pos:hi - pos])
                j += 1
            job.result()
            pos = end
    bad = [label for (_, _, want, label), h in zip(parts, hashers) if h.hexdigest() != want]
    return whole.hexdigest(), bad
