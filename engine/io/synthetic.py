"""Synthetic weights: a real `.ninfer` artifact of a model's shapes with random values, written
fast, for serving a lane before its real model is converted (`./ninfer serve --synthetic-weights`)
and for benchmarks. Every response and receipt of a server on such weights says so.

The layout is what `./ninfer convert` stores for the recipe: norms, A_log, dt_bias and conv1d
fp32, the embedding bf16, every other 2-D matrix (lm_head and the MTP layer included) int4_g64
(recipe int4) or bf16 (recipe bf16). The tokenizer and chat template are the embedded models'.

Values do not matter, only the bytes' count and that they are not all zero: a few random pools
(int4 codes, scales, normal values per fan-in) are drawn once from a seeded generator and every
tensor is a slice of a pool at a random offset (a view: no copy), tiled when larger than the
pool. The same seed gives the same bytes, so the same sha256. The writer plans the layout first
and hashes and writes the parts on a thread pool (the same bytes as write_artifact).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from engine.io.artifact import _fsync_dir, write_artifact
from engine.io.artifact_format import (ALIGN, FORMAT_VERSION, HEADER, MAGIC,
                                       canonical_json, check_entry)
from engine.model.config import ModelConfig, preset
from engine.ops.quant import DENSE, dtype_name
from engine.ops.quant import GROUP, INT4_G64, QTensor

FORMATS = ("int4_g64", "bf16")
# the converter's recipe each format is stored as
RECIPE_FORMAT = {"int4": "int4_g64", "bf16": "bf16"}
_POOL_BYTES = 64 << 20   # random int4 codes drawn once
_POOL_ELEMS = 8 << 20    # random normal / scale values drawn once per kind


class _Pools:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.codes = self.rng.integers(0, 256, _POOL_BYTES, dtype=np.uint8)
        self.unit = self.rng.uniform(0.5, 1.5, _POOL_ELEMS).astype(np.float32)
        self.normal = self.rng.standard_normal(_POOL_ELEMS, dtype=np.float32)
        self._bf16: dict[float, np.ndarray] = {}

    def take(self, pool: np.ndarray, n: int) -> np.ndarray:
        """n elements from `pool` from a random offset (a view when it fits, else tiled)."""
        if n <= pool.size // 2:
            off = int(self.rng.integers(0, pool.size - n + 1))
            return pool[off:off + n]
        off = int(self.rng.integers(0, pool.size))
        return np.resize(np.roll(pool, -off), n)

    def bf16(self, std: float) -> np.ndarray:
        if std not in self._bf16:
            self._bf16[std] = (self.normal * np.float32(std)).astype(ml_dtypes.bfloat16)
        return self._bf16[std]


def synth_tensors(cfg: ModelConfig, fmt: str, seed: int = 0):
    """Yield (canonical name, stored value) for every tensor of `cfg`, in tensor_specs order."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    pools = _Pools(seed)
    for name, shape in cfg.tensor_specs().items():
        n = int(np.prod(shape))
        leaf = name.rsplit(".", 1)[-1]
        if len(shape) == 1 or leaf == "conv1d":  # fp32, tiny: small values around 0
            yield name, (pools.take(pools.normal, n) * np.float32(0.1)).reshape(shape)
            continue
        out, inp = shape
        if name == "embed_tokens" or fmt == "bf16":
            yield name, pools.take(pools.bf16(1.0 / np.sqrt(inp)), n).reshape(shape)
            continue
        data = pools.take(pools.codes, out * inp // 2).reshape(out, inp // 2)
        s = out * (inp // GROUP)
        scale = (pools.take(pools.unit, s) * np.float32(2.0 / np.sqrt(inp) / 7.0)).reshape(
            out, inp // GROUP)
        yield name, QTensor(data=data, scale=scale, fmt=INT4_G64, shape=(out, inp))


def expected_bytes(cfg: ModelConfig, fmt: str) -> int:
    """The weights' bytes in format `fmt`: what the converter stores for its recipe."""
    from engine.io.convert import stored_bytes

    return stored_bytes(cfg, {v: k for k, v in RECIPE_FORMAT.items()}[fmt])


def write_parallel(path, cfg: ModelConfig, tensors, *, tokenizer_json, chat_template, source,
                   extra, special_tokens=None, threads: int | None = None) -> tuple[str, dict]:
    """The same bytes as engine.io.artifact.write_artifact (tests/test_synth_artifact.py compares
    the sha256 of both), written faster: the layout is planned first (every offset follows from
    the shapes), then the parts are hashed and pwrite'n by a thread pool (hashlib and pwrite
    release the GIL), and the file's fsync overlaps the whole-file sha256 (which must come last:
    the header at offset 0 holds the directory's hash). Returns (sha256, phase seconds)."""
    import concurrent.futures
    import hashlib
    import threading

    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    specs = cfg.tensor_specs()
    t0 = time.perf_counter()
    jobs, table, pos = [], {}, ALIGN
    for name, value in tensors:
        if isinstance(value, QTensor):
            parts = {k: np.ascontiguousarray(v) for k, v in value.parts().items()}
            fmt, shape = value.fmt, [int(d) for d in value.shape]
        else:
            parts = {"data": np.ascontiguousarray(value)}
            fmt, shape = DENSE, [int(d) for d in parts["data"].shape]
        entry = {"format": fmt, "shape": shape, "parts": {}}
        for part, arr in parts.items():
            n = int(arr.nbytes)
            entry["parts"][part] = {"offset": pos, "bytes": n,
                                    "shape": [int(d) for d in arr.shape],
                                    "dtype": dtype_name(arr.dtype)}
            jobs.append((pos, arr, entry["parts"][part]))
            pos += n + (-n % ALIGN)
        entry["dtype"] = entry["parts"]["data"]["dtype"]
        table[name] = entry
    if set(table) != set(specs):
        raise ValueError(f"tensor set differs from {cfg.name}'s specs")
    t_plan = time.perf_counter()
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, pos)  # the zero padding between parts, for free

        def put(job):
            off, arr, meta = job
            flat = memoryview(arr.reshape(-1).view(np.uint8))
            meta["sha256"] = hashlib.sha256(flat).hexdigest()
            step = 64 << 20
            for i in range(0, len(flat), step):
                chunk = flat[i:i + step]
                done = 0
                while done < len(chunk):
                    done += os.pwrite(fd, chunk[done:], off + i + done)

        with concurrent.futures.ThreadPoolExecutor(threads or min(16, os.cpu_count() or 2)) as ex:
            list(ex.map(put, sorted(jobs, key=lambda j: -j[1].nbytes)))
        for name, entry in table.items():
            check_entry(name, entry, specs[name])
        t_parts = time.perf_counter()
        directory = {"format_version": FORMAT_VERSION, "alignment": ALIGN,
                     "model": {"name": cfg.name, "config": cfg.to_dict(),
                               "config_hash": cfg.canonical_hash()},
                     "source": source, "tokenizer": tokenizer_json,
                     "chat_template": chat_template, "special_tokens": special_tokens,
                     "extra": extra, "tensors": table}
        blob = canonical_json(directory)
        os.pwrite(fd, blob, pos)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, ALIGN, pos, len(blob),
                             hashlib.sha256(blob).digest())
        os.pwrite(fd, header, 0)
        synced = threading.Thread(target=os.fsync, args=(fd,))
        synced.start()  # the disk writes back while the CPU hashes the file (page cache)
        h = hashlib.sha256()
        with open(tmp, "rb", buffering=0) as f:
            buf = bytearray(64 << 20)
            while n := f.readinto(buf):
                h.update(memoryview(buf)[:n])
        t_hash = time.perf_counter()
        synced.join()
        t_sync = time.perf_counter()
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return h.hexdigest(), {"plan_s": round(t_plan - t0, 3),
                           "hash_write_parts_s": round(t_parts - t_plan, 3),
                           "whole_file_sha256_s": round(t_hash - t_parts, 3),
                           "fsync_wait_s": round(t_sync - t_hash, 3),
                           "rename_s": round(time.perf_counter() - t_sync, 3)}


def synth_artifact(out: Path, preset_name: str = "qwen3.8-27b", fmt: str = "int4_g64",
                   seed: int = 0, log=None, writer: str = "parallel") -> dict:
    """Write the artifact; returns {sha256, bytes, seconds, phases}."""
    from engine.text.chat import TEMPLATE_DIR
    from engine.text.tokenizer import build_qwen35_tokenizer_json

    cfg = preset(preset_name)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok = build_qwen35_tokenizer_json()
    template = (TEMPLATE_DIR / "qwen3_5_chat.jinja").read_text()
    t_tok = time.perf_counter() - t0
    marks = {}

    def progress(done, total, name, pos):
        if done == total:
            marks["payload_written"] = time.perf_counter()
        if log and (done % 100 == 0 or done == total):
            log(f"  [{done}/{total}] {pos / 1e9:.2f} GB  {time.perf_counter() - t0:.1f}s")

    t1 = time.perf_counter()
    # The source text names neither the writer nor anything else of this run: both writers
    # give the same bytes for the same preset, format and seed.
    meta = dict(tokenizer_json=tok, chat_template=template,
                source={"kind": "synthetic",
                        "description": f"synthetic weights: preset {preset_name} "
                                       f"format {fmt} seed {seed}: random values"},
                extra={"recipe": "int4" if fmt == "int4_g64" else "bf16", "synthetic": True})
    if writer == "parallel":
        sha, phases = write_parallel(out, cfg, synth_tensors(cfg, fmt, seed), **meta)
        t_end = time.perf_counter()
    else:
        sha = write_artifact(out, cfg, synth_tensors(cfg, fmt, seed), progress=progress, **meta)
        t_end = time.perf_counter()
        pw = marks.get("payload_written", t_end)
        phases = {"generate_hash_write_payload_s": round(pw - t1, 3),
                  "directory_fsync_rehash_rename_s": round(t_end - pw, 3)}
    size = out.stat().st_size
    return {"path": str(out), "sha256": sha, "bytes": size, "preset": preset_name,
            "format": fmt, "seed": seed, "writer": writer, "seconds": round(t_end - t0, 3),
            "phases": {"tokenizer_s": round(t_tok, 3), **phases},
            "write_GBps": round(size / (t_end - t0) / 1e9, 3)}


