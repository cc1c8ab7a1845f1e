"""Loading a model for serving: artifact -> device params, tokenizer, chat template.

Also materialises the embedded tiny model into the state directory on first use and refuses it
unless its sha256 equals the pin in the lane profile.
"""
from __future__ import annotations

import concurrent.futures
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.io.artifact import ArtifactError, open_artifact, write_artifact
import engine.model.model as M
from engine.model.config import ModelConfig
from engine.model.params import HostStack, host_leaf
from engine.ops.quant import QTensor
from engine.text.chat import TEMPLATE_DIR
from engine.text.tokenizer import Tokenizer, build_qwen35_tokenizer_json

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_KV_DTYPES = {**_DTYPES, "int8": jnp.int8}


@dataclass
class LoadedModel:
    cfg: ModelConfig
    params: dict
    tokenizer: Tokenizer
    chat_template: str
    sha256: str
    path: Path
    compute_dtype: object
    kv_dtype: object
    # sampling defaults the artifact carries (extra.generation: temperature, top_p)
    generation: dict = field(default_factory=dict)

    @property
    def model_id(self) -> str:
        return self.cfg.name


def embedded_path(state_dir: Path, name: str) -> Path:
    return state_dir / "models" / f"{name}.ninfer"


def build_embedded(name: str, out: Path) -> str:
    """Write the embedded model `name` to `out`; returns its sha256."""
    from engine.io.tiny import EMBEDDED, GENERATION, embedded_config, embedded_tensors

    if name not in EMBEDDED:
        raise ArtifactError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED)}")
    cfg = embedded_config(name)
    template = (TEMPLATE_DIR / "qwen3_5_chat.jinja").read_text()
    out.parent.mkdir(parents=True, exist_ok=True)
    write_artifact(out, cfg, embedded_tensors(cfg), tokenizer_json=build_qwen35_tokenizer_json(),
                   chat_template=template,
                   source={"kind": "embedded", "description": f"engine.tiny:{name}"},
                   extra={"generation": GENERATION[name]} if name in GENERATION else None)
    return open_artifact(out, verify=True).sha256


def generation_defaults(extra, where) -> dict:
    """An artifact's `extra.generation` checked: {"temperature": 0..2, "top_p": (0, 1]}, each
    optional; {} when the artifact carries none."""
    gen = (extra or {}).get("generation") if isinstance(extra, dict) else None
    if gen is None:
        return {}
    limits = {"temperature": (0.0, 2.0), "top_p": (1e-6, 1.0)}
    if not isinstance(gen, dict) or set(gen) - set(limits) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool)
            and limits[k][0] <= v <= limits[k][1] for k, v in gen.items()):
        raise ArtifactError(f"{where}: extra.generation must map temperature (0-2) and top_p "
                            f"(0-1] to numbers, got {gen!r}")
    return {k: float(v) for k, v in gen.items()}


def embedded_pin(name: str) -> str:
    """The sha256 engine/io/tiny.py pins for the embedded model `name`'s artifact."""
    from engine.io.tiny import EMBEDDED_SHA256

    if name not in EMBEDDED_SHA256:
        raise ArtifactError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_SHA256)}")
    return EMBEDDED_SHA256[name]


def ensure_embedded(state_dir: Path, name: str, pinned_sha256: str, *, stamps=None,
                    verify: str = "full") -> Path:
    """The embedded model's artifact path, generating it on first use; checks the pin (through
    a verified-artifact stamp when `stamps` has one and verify="stamp", see verify_artifact)."""
    path = embedded_path(state_dir, name)
    if not path.exists():
        print(f"ninfer: generating the embedded model '{name}' into {path} (first use)",
              file=sys.stderr, flush=True)
        build_embedded(name, path)
    with open_artifact(path, verify=False) as art:
        verify_artifact(art, None, stamps=stamps, mode=verify)
        sha = art.sha256
    if sha != pinned_sha256:
        raise ArtifactError(f"embedded model {path} has sha256 {sha}, but its pin is "
                            f"{pinned_sha256}; delete the file to regenerate it")
    return path


VERIFY_MODES = ("full", "stamp")


def verify_artifact(art, expected_sha256: str | None, *, stamps=None, mode: str = "full") -> str:
    """Check every byte of the open artifact `art` (each part's sha256, and the file's against
    `expected_sha256` when given); raises ArtifactError on any mismatch. Returns "stamp" when
    a verified-artifact stamp vouched for this exact file (mode "stamp" only; no byte is read),
    else "full", after which a fresh stamp is recorded.

    stamps: None (no state directory: always full) or an object with
    lookup(path, fstat, expected) -> sha256 | None and record(path, fstat_before, fstat_after,
    sha256, hash_started_ns) -> bool (server/artifact_stamps.py, which says why a stamp is safe).
    """
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify mode must be one of {VERIFY_MODES}, got {mode!r}")
    before = art.stat()
    if stamps is not None and mode == "stamp":
        sha = stamps.lookup(art.path, before, expected_sha256)
        if sha is not None:
            art.adopt_sha256(sha)
            return "stamp"
    started_ns = time.time_ns()
    art.verify()
    if expected_sha256 is not None and art.sha256 != expected_sha256.lower():
        raise ArtifactError(f"{art.path}: sha256 is {art.sha256}, not the expected "
                            f"{expected_sha256}")
    if stamps is not None:
        stamps.record(art.path, before, art.stat(), art.sha256, started_ns)
    return "full"


def _host_value(value, dtype):
    """A tensor as it goes to the device: quantized ones as stored, dense ones in the compute
    dtype (converted on the host, through fp32, only when the stored dtype differs: a bf16
    model served in bf16 is moved as its bytes)."""
    if isinstance(value, QTensor):
        return value
    arr = np.asarray(value)
    if arr.dtype == np.dtype(dtype):
        return arr
    return arr.astype(np.float32).astype(dtype)


def worker_threads() -> int:
    """Threads for startup work that releases the GIL (device copies, XLA compiles): half the
    cores, at most 8."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def copy_threads() -> int:
    """Threads that stack the weights on the host and put them on the device: every core, at
    most 16. On the H200's 16-core host the 27B's 17.2 GB moved in 5.3 s on 16 threads and
    9.2 s on 8 (bench/startup_micro.py); the compile beside it is mostly loading stored
    executables (engine/runtime/exec_store.py)."""
    return max(1, min(16, os.cpu_count() or 1))


def load_model(path: Path, *, compute_dtype: str = "float32", kv_dtype: str = "float32",
               expected_sha256: str | None = None, timings: dict | None = None,
               stamps=None, verify: str = "full") -> LoadedModel:
    """Load an artifact onto the device (start_load(...).result()): every byte is verified
    before this returns, see ModelLoad."""
    return start_load(path, compute_dtype=compute_dtype, kv_dtype=kv_dtype,
                      expected_sha256=expected_sha256, timings=timings, stamps=stamps,
                      verify=verify).result()


def _abstract(leaf):
    """The shape and dtype a leaf of stack_params' tree will have on the device."""
    if isinstance(leaf, HostStack):
        first = leaf._first()
        return jax.ShapeDtypeStruct(leaf._lead() + first.shape, first.dtype)
    return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)


class ModelLoad:
    """A model being copied to the device and verified, on threads of its own.

    `abstract` is the LoadedModel at once, with its params as jax.ShapeDtypeStructs (the tree,
    shapes and dtypes the device params will have): enough to build an Engine and compile its
    executables while the bytes are still on their way (start() starts the copy), which is how
    a restart overlaps the compile with the copy (server/cli.py). `result()` waits for the copy
    and the verification and returns the LoadedModel with device params, or raises
    (ArtifactError if any byte differs: the copies are dropped and nothing was served).

    The verification (each part's sha256, and the file's against `expected_sha256` when given)
    runs on its own thread beside the copy, so a load costs about max(hash, copy) instead of
    their sum; with `stamps` and verify="stamp", a verified-artifact stamp of this exact file
    stands in for the hash pass (verify_artifact). `timings` (optional dict) receives open_s,
    to_device_s, verify_s, verify_wait_s (how long the hash outlasted the copy),
    artifact_bytes, verify ("stamp" | "full") and ready_s (start to copied and verified) once
    result() returns; the layers are stacked on the host as they are copied (to_device_s
    holds both)."""

    def __init__(self, path: Path, *, compute_dtype: str, kv_dtype: str,
                 expected_sha256: str | None, timings: dict | None, stamps, verify: str):
        self._timings = timings
        self._t0 = time.monotonic()
        art = open_artifact(path, verify=False)  # header, directory and table checks only
        self._t_open = time.monotonic()
        self._open_s = self._t_open - self._t0
        try:
            if art.tokenizer_json is None or art.chat_template is None:
                raise ArtifactError(f"{path}: the artifact carries no tokenizer or chat template")
            generation = generation_defaults(art.extra, path)
            dt = _DTYPES[compute_dtype]
            host = {name: _host_value(art.load(name), dt) for name in art.tensor_names}
            abstract = M.stack_params(host, art.config,
                                      put=lambda leaves: [_abstract(x) for x in leaves])
            self.abstract = LoadedModel(
                cfg=art.config, params=abstract, tokenizer=Tokenizer(art.tokenizer_json),
                chat_template=art.chat_template, sha256="", path=Path(path),
                compute_dtype=dt, kv_dtype=_KV_DTYPES[kv_dtype], generation=generation)
        except BaseException:
            art.close()
            raise
        self._art, self._host = art, host
        self._verify_args = (expected_sha256, stamps, verify)
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ninfer-load")
        self._check = self._copy = None

    def start(self) -> "ModelLoad":
        """Start the copy and the verification (once; result() starts them if need be). The
        caller may first build what needs only `abstract` on an idle machine: the device
        allocations of an Engine measured 0.13 s alone and ~5 s beside the copy on the H200."""
        if self._copy is None:
            self._t_start = time.monotonic()
            self._check = self._pool.submit(self._verify_pass, *self._verify_args)
            self._copy = self._pool.submit(self._copy_pass, self._host)
            self._host = None
        return self

    def _verify_pass(self, expected_sha256, stamps, verify):
        t = time.monotonic()
        how = verify_artifact(self._art, expected_sha256, stamps=stamps, mode=verify)
        t_end = time.monotonic()
        return how, t_end - t, t_end

    def _copy_pass(self, host: dict):
        check = self._check

        def put(leaves):
            """Each stacked leaf is built on the host and moved on its own thread: one thread
            is bound by reading the page cache, not by the bus. The device never holds a
            layer's tensor beside its stacked copy, so a model needs its own size in device
            memory to load, not twice that."""
            def one(x):
                if check.done() and check.exception() is not None:
                    return None  # corrupt: stop copying, result() raises
                if isinstance(x, (np.ndarray, HostStack)):
                    return jax.device_put(host_leaf(x))
                return x
            with concurrent.futures.ThreadPoolExecutor(
                    copy_threads(), thread_name_prefix="ninfer-copy") as copiers:
                out = list(copiers.map(one, leaves))
            jax.block_until_ready(out)
            return out

        params = M.stack_params(host, self.abstract.cfg, put=put)
        return params, time.monotonic()

    def result(self) -> LoadedModel:
        self.start()
        try:
            how, verify_s, t_ver = self._check.result()  # raises if any byte differs
            params, t_dev = self._copy.result()
        except BaseException:
            self._check.cancel()
            self._copy.cancel()
            self._pool.shutdown(wait=True)
            self._art.close()
            raise
        self._pool.shutdown(wait=True)
        art = self._art
        if self._timings is not None:  # ready_s: from the start until copied and verified
            self._timings.update(open_s=round(self._open_s, 3),
                                 to_device_s=round(t_dev - self._t_start, 3),
                                 verify_s=round(verify_s, 3),
                                 verify_wait_s=round(max(0.0, t_ver - t_dev), 3),
                                 artifact_bytes=art._size, verify=how,
                                 ready_s=round(max(t_ver, t_dev) - self._t0, 3))
        a = self.abstract
        return LoadedModel(cfg=a.cfg, params=params, tokenizer=a.tokenizer,
                           chat_template=a.chat_template, sha256=art.sha256, path=a.path,
                           compute_dtype=a.compute_dtype, kv_dtype=a.kv_dtype,
                           generation=a.generation)


def start_load(path: Path, *, compute_dtype: str = "float32", kv_dtype: str = "float32",
               expected_sha256: str | None = None, timings: dict | None = None,
               stamps=None, verify: str = "full") -> ModelLoad:
    """Start loading an artifact onto the device; see ModelLoad."""
    return ModelLoad(path, compute_dtype=compute_dtype, kv_dtype=kv_dtype,
                     expected_sha256=expected_sha256, timings=timings, stamps=stamps,
                     verify=verify)
