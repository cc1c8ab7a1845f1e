"""Reading a Hugging Face model directory: config, safetensors shards, tokenizer, chat template.

Tensors are read one at a time with positioned reads into fresh numpy buffers, so the reader's
memory is the tensor being read (the page cache holds the rest, outside our RSS). We parse the
safetensors header ourselves (8-byte little-endian length, JSON, raw little-endian data) because
`safe_open(..., framework="np")` cannot return bf16 ("data type 'bfloat16' not understood") and
torch is not a runtime dependency.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np

_ST_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
              "F16": np.dtype(np.float16)}
_MAX_HEADER = 100 << 20
_READ_CHUNK = 1 << 30  # one read() may return at most ~2 GiB on Linux


class CheckpointError(ValueError):
    """An HF directory we cannot read: missing files, malformed safetensors, unsupported dtypes."""


class SafetensorsFile:
    """One .safetensors file: its tensor index (name -> dtype, shape, byte span) and reads."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (too short)")
            n = int.from_bytes(head, "little")
            if n > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: safetensors header length {n} is implausible")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise CheckpointError(f"{path}: safetensors header is not JSON: {e}") from None
        header.pop("__metadata__", None)
        self._base = 8 + n
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, t in header.items():
            begin, end = t["data_offsets"]
            shape = tuple(int(d) for d in t["shape"])
            width = _ST_DTYPES[t["dtype"]].itemsize if t["dtype"] in _ST_DTYPES else None
            if width is not None and end - begin != math.prod(shape) * width:
                raise CheckpointError(f"{path}: tensor {name} spans {end - begin} bytes, not "
                                      f"{t['dtype']}{list(shape)}")
            if not 0 <= begin <= end <= size - self._base:
                raise CheckpointError(f"{path}: tensor {name} lies outside the file (truncated?)")
            self.tensors[name] = (t["dtype"], shape, begin, end)

    def read(self, name: str) -> np.ndarray:
        st_dtype, shape, begin, end = self.tensors[name]
        if st_dtype not in _ST_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has dtype {st_dtype}; only "
                                  f"{sorted(_ST_DTYPES)} are supported")
        out = np.empty(shape, _ST_DTYPES[st_dtype])
        buf = memoryview(out.reshape(-1).view(np.uint8))
        with open(self.path, "rb", buffering=0) as f:
            pos, done = self._base + begin, 0
            while done < len(buf):
                n = os.preadv(f.fileno(), [buf[done:done + _READ_CHUNK]], pos + done)
                if n <= 0:
                    raise CheckpointError(f"{self.path}: short read in tensor {name}")
                done += n
        return out


class HFCheckpoint:
    """An HF model directory: config.json, *.safetensors (sharded or not) and tokenizer files."""

    def __init__(self, root):
        self.root = Path(root)
        if not (self.root / "config.json").is_file():
            raise CheckpointError(f"{self.root}: no config.json (not an HF model directory)")
        self.config = self.read_json("config.json")
        self.files: list[str] = ["config.json"]  # every file we read, relative to root
        self._where: dict[str, SafetensorsFile] = {}
        index = self.root / "model.safetensors.index.json"
        if index.is_file():
            self.files.append(index.name)
            shards = sorted(set(self.read_json(index.name)["weight_map"].values()))
        else:
            shards = sorted(p.name for p in self.root.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.root}: no *.safetensors files")
        for shard in shards:
            if not (self.root / shard).is_file():
                raise CheckpointError(f"{self.root}: shard {shard} listed in the index is missing")
            st = SafetensorsFile(self.root / shard)
            for name in st.tensors:
                if name in self._where:
                    raise CheckpointError(f"{self.root}: tensor {name} is in two shards")
                self._where[name] = st
            self.files.append(shard)
        for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                      "chat_template.jinja"):
            if (self.root / extra).is_file():
                self.files.append(extra)

    def read_json(self, rel: str) -> dict:
        try:
            return json.loads((self.root / rel).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.root / rel}: {e}") from None

    @property
    def tensor_names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].tensors[name][1]

    def nbytes(self, name: str) -> int:
        _, _, begin, end = self._where[name].tensors[name]
        return end - begin

    def read(self, name: str) -> np.ndarray:
        return self._where[name].read(name)

    def tokenizer_json(self) -> str | None:
        p = self.root / "tokenizer.json"
        return p.read_text(encoding="utf-8") if p.is_file() else None

    def chat_template(self) -> str | None:
        """chat_template.jinja, else tokenizer_config.json's chat_template (the 'default' one
        when it is a list of named templates)."""
        p = self.root / "chat_template.jinja"
        if p.is_file():
            return p.read_text(encoding="utf-8")
        if not (self.root / "tokenizer_config.json").is_file():
            return None
        tpl = self.read_json("tokenizer_config.json").get("chat_template")
        if isinstance(tpl, list):
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default", next(iter(named.values()), None))
        return tpl if isinstance(tpl, str) else None

    def special_tokens(self) -> dict | None:
        """eos/bos/pad ids (generation_config.json over config.json) and token strings."""
        text = self.config.get("text_config", {})
        gen = self.read_json("generation_config.json") if "generation_config.json" in self.files \
            else {}
        tok = self.read_json("tokenizer_config.json") if "tokenizer_config.json" in self.files \
            else {}

        def first(key):
            for d in (gen, text, self.config):
                if d.get(key) is not None:
                    return d[key]
            return None

        def token_text(key):
            v = tok.get(key)
            return v.get("content") if isinstance(v, dict) else v

        eos = first("eos_token_id")
        out = {"eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
               "bos_token_id": first("bos_token_id"), "pad_token_id": first("pad_token_id"),
               "eos_token": token_text("eos_token"), "bos_token": token_text("bos_token"),
               "pad_token": token_text("pad_token")}
        return out if any(v not in (None, []) for v in out.values()) else None

    def file_identities(self, progress=None) -> list[dict]:
        """[{path, bytes, sha256}] of every file read, in name order."""
        out = []
        for rel in sorted(self.files):
            h = hashlib.sha256()
            with open(self.root / rel, "rb") as f:
                while chunk := f.read(16 << 20):
                    h.update(chunk)
            out.append({"path": rel, "bytes": (self.root / rel).stat().st_size,
                        "sha256": h.hexdigest()})
            if progress:
                progress(rel)
        return out
