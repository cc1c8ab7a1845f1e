"""Compiled forward executables kept on disk, authenticated, so that a restart neither traces
nor lowers the model again.

With JAX's persistent compilation cache warm, a restart still traces and lowers every prefill
width and the decode step before the cache can even be asked (its key is a hash of the lowered
module): 0.4-0.7 s of Python a width for the 27B on the H200 host, 5.0 s for nine widths
against 1.1 s of cache loads (bench/startup_micro.py). This store keeps each width's compiled
executable under a key that names everything the lowering depends on, and hands back a
`jax.stages.Compiled` without tracing.

The key (`describe`): the sha256 of every source file of the engine package (the code that
traces), the JAX, jaxlib, NumPy and ml_dtypes versions, the backend's platform and version and
its devices' kinds, JAX's configuration values, XLA's flags (XLA_FLAGS: the operator's and the
kernel plan's), and the caller's own description of the call (model config, the trees, shapes
and dtypes of its arguments, batch, width, the kernel plan and the CUDA ops' build). A change to any of them is another key: the
old file is never used again and `keep` removes it once unused for two weeks.

A file is MAGIC, an HMAC-SHA256 tag over (MAGIC, key, body) under a 32-byte secret the caller
keeps in a 0600 file, then the body: JAX's serialized executable and its argument trees
(jax.experimental.serialize_executable, a pickle). The tag is checked before anything is
unpickled: loading an executable runs its code, so a file this process did not write under its
secret is deleted, never loaded. Files are written whole (temporary file, fsync, rename) and
mode 0600 in a 0700 directory.
"""
from __future__ import annotations

import hashlib
import hmac
import importlib.metadata
import json
import os
import pickle
import secrets
import tempfile
import threading
import time
from pathlib import Path

import jax

from engine.plan import process_xla_flags

MAGIC = b"NINFER-EXEC/1\n"
_TAG = b"ninfer/executable/v1\0"
_SUFFIX = ".exe"
KEEP_UNUSED_S = 14 * 86400  # keep(): how long an executable no start used stays
_SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".h")


def _source_digest_uncached() -> str:
    root = Path(__file__).resolve().parent.parent  # the engine package
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES
                       and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


_source_lock = threading.Lock()
_source_digest: list[str] = []


def source_digest() -> str:
    """sha256 over the engine package's source files (paths and contents), once a process."""
    with _source_lock:
        if not _source_digest:
            _source_digest.append(_source_digest_uncached())
        return _source_digest[0]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def runtime_description() -> dict:
    """What the lowering depends on besides the call: code, versions, backend, settings."""
    backend = jax.devices()[0].client
    config = {k: repr(v) for k, v in sorted(jax.config.values.items())
              if "cache" not in k and "dir" not in k and "log" not in k}
    return {
        "source": source_digest(),
        "versions": {d: _version(d) for d in ("jax", "jaxlib", "numpy", "ml_dtypes")},
        "platform": [backend.platform, backend.platform_version],
        "devices": sorted({d.device_kind for d in jax.devices()}),
        "config": config,
        "xla_flags": process_xla_flags(),
    }


# An executable JAX loaded from its persistent cache does not serialize again into one that
# loads in another process (XLA:CPU: "Function ... not found" when run), so the store keeps
# only executables compiled in this process. Whether a compile was a cache hit is told by
# JAX's monitoring event on the compiling thread.
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_probe = threading.local()
_listener_lock = threading.Lock()
_listening: list[bool] = []
def fresh_options() -> dict:
    """Compiler options under which a compile misses JAX's persistent cache and so runs
    afresh: a debug setting that changes the cache key and nothing the executable computes
    (how many buffers a buffer-assignment dump lists), set to a value never used before. A
    fixed value would miss only once: a later process, or a store that lost its file, would
    hit the entry the first fresh compile wrote."""
    return {"xla_debug_buffer_assignment_show_max": 1_000_000 + secrets.randbelow(1 << 30)}


def _on_event(event: str, **_) -> None:
    if event == _HIT_EVENT:
        _probe.hit = True


def compile_noting_cache(lowered, **options):
    """lowered.compile(...) -> (compiled, whether JAX's persistent cache supplied it)."""
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening.append(True)
    _probe.hit = False
    compiled = lowered.compile(**options)
    return compiled, _probe.hit


def describe(call: dict, runtime: dict | None = None) -> str:
    """The store key of a call described by `call` (JSON-serializable) in this runtime
    (`runtime`: runtime_description(), when the caller has it already)."""
    text = json.dumps({"runtime": runtime or runtime_description(), "call": call},
                      sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


class ExecStore:
    """Compiled executables under `root`, tagged with `secret` (32 bytes)."""

    def __init__(self, root: Path, secret: bytes, *, log=None):
        if len(secret) != 32:
            raise ValueError("the executable store's secret must be 32 bytes")
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self._secret = secret
        self.log_event = log or (lambda event, **fields: None)  # event, **fields
        self.counts = {"loaded": 0, "saved": 0, "rejected": 0, "failed": 0}
        self._mu = threading.Lock()

    def _path(self, key: str) -> Path:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"not a store key: {key!r}")
        return self.root / (key + _SUFFIX)

    def _tag(self, key: str, body: bytes) -> bytes:
        return hmac.new(self._secret, _TAG + MAGIC + key.encode() + b"\0" + body,
                        hashlib.sha256).digest()

    def _count(self, what: str) -> None:
        with self._mu:
            self.counts[what] += 1

    def load(self, key: str):
        """The executable stored under `key` (a jax.stages.Compiled), or None: absent, or
        rejected (its tag does not verify: deleted unread) or failing to load (deleted)."""
        from jax.experimental import serialize_executable

        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        head = len(MAGIC) + 32
        body = data[head:]
        if data[:len(MAGIC)] != MAGIC or not hmac.compare_digest(
                data[len(MAGIC):head], self._tag(key, body)):
            self._count("rejected")
            self.log_event("executable_rejected", exec_id=key[:16], reason="tag")
            path.unlink(missing_ok=True)
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(body)
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - authentic but not loadable here: compile anew
            self._count("failed")
            self.log_event("executable_unloadable", exec_id=key[:16], error=type(e).__name__)
            path.unlink(missing_ok=True)
            return None
        self._count("loaded")
        os.utime(path)  # in use: keep() spares it
        return compiled

    def save(self, key: str, compiled) -> bool:
        """Store `compiled` under `key`; False (nothing written) when this backend cannot
        serialize it."""
        from jax.experimental import serialize_executable

        try:
            body = pickle.dumps(serialize_executable.serialize(compiled),
                                protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001
            self.log_event("executable_unserializable", exec_id=key[:16], error=type(e).__name__)
            return False
        path = self._path(key)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + self._tag(key, body) + body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._count("saved")
        return True

    def save_in_background(self, compiled, from_cache) -> threading.Thread:
        """Store, on a thread of its own (off a start's critical path), the executables a
        compile made ((key, compiled) pairs), then compile afresh past JAX's cache
        (fresh_options) and store those it took from that cache ((key, lowered) pairs), which
        would not load in another process. Logs `executables_saved` when done. Returns the
        started thread."""
        def run():
            saved = 0
            for key, executable in compiled:
                saved += bool(self.save(key, executable))
            for key, lowered in from_cache:
                try:
                    executable, cached = compile_noting_cache(
                        lowered, compiler_options=fresh_options())
                    if cached:  # not expected: fresh_options' value is new
                        self.log_event("executable_unsaved", exec_id=key[:16], reason="cached")
                    elif self.save(key, executable):
                        saved += 1
                except Exception as e:  # noqa: BLE001 - the next start compiles it again
                    self.log_event("executable_unsaved", exec_id=key[:16],
                                   error=type(e).__name__)
            self.log_event("executables_saved", saved=saved, of=len(compiled) + len(from_cache))
        thread = threading.Thread(target=run, daemon=True, name="ninfer-exec-save")
        thread.start()
        return thread

    def keep(self, keys, max_age_s: float = KEEP_UNUSED_S) -> int:
        """Delete the stored executables not under `keys` that no load or save touched for
        `max_age_s` (another lane's or an older build's), and leftover temporary files;
        returns how many went. A store shared by two configurations keeps both while both
        are in use."""
        keep = {k + _SUFFIX for k in keys}
        now, gone = time.time(), 0
        for p in self.root.iterdir():
            if not p.name.endswith(_SUFFIX) or p.name in keep:
                continue
            try:
                old = now - p.stat().st_mtime > max_age_s
            except FileNotFoundError:
                continue
            if p.name.startswith(".tmp-") or old:
                p.unlink(missing_ok=True)
                gone += 1
        return gone
