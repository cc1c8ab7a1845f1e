"""The engine's forwards as `jax.export` artefacts: serialized once, loaded without tracing.

`export_forwards(runner, cache, platform)` serializes the forward of every (rows, width) the
runner runs (`ModelRunner.shapes`): the same functions and abstract arguments `compile()`
lowers, exported for one platform ("cpu" or "cuda"; a non-interpreted Pallas call cannot go
into a multi-platform export). Each blob is a header line of canonical JSON naming what it was
made for (platform, rows, width, plan digest, engine signature, JAX version) and the serialized
`Exported`. The bytes are reproducible: source locations are left out of the module while it
is exported (`jax_traceback_in_locations_limit` 0), so two exports of one tree are equal.

`load_forwards(runner, blobs)` checks every blob against the runner (platform, plan, shapes,
params and cache) and refuses a mismatch naming what differs; it then compiles each
deserialized forward into `runner._compiled`, where `ModelRunner.forward` calls it: the model
is never traced.

`lane_runner(profile)` gives a lane's runner and cache at the lane's real shapes with abstract
params only (no weights), for building a lane's exports on any machine.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

import engine.model.model as M
from engine.io.loader import worker_threads
from engine.kernels.cuda_build import FFI_TARGETS

MAGIC = b"ninfer-exported/1\n"
PLATFORMS = ("cpu", "cuda")
# custom calls a CUDA export may hold: the Triton (Pallas) kernels and the CUDA ops' FFI targets
_CUDA_TARGETS = ("__gpu$xla.gpu.triton", *FFI_TARGETS)
_TRACE_LOCK = threading.Lock()


def _register_serialization() -> None:
    """The engine's pytree types (params, cache, outputs) as an Exported's in/out trees may
    name them: namedtuples by their fields, QTensor with its (fmt, shape) as JSON."""
    from engine.model.cache import Cache, PagedCache
    from engine.model.layers import StackedStates
    from engine.ops.paged_kv import KVPool, PagedKV
    from engine.ops.quant import QTensor

    def once(register, *args, **kwargs):
        try:
            register(*args, **kwargs)
        except ValueError:  # registered already (this module imported again)
            pass
    for cls in (Cache, PagedCache, StackedStates, KVPool, PagedKV):
        once(export.register_namedtuple_serialization, cls,
             serialized_name=f"ninfer.{cls.__name__}")

    def aux_out(aux) -> bytes:
        fmt, shape = aux
        return _canonical([fmt, list(shape)])

    def aux_in(data: bytes):
        fmt, shape = json.loads(data)
        return fmt, tuple(shape)
    once(export.register_pytree_node_serialization, QTensor, serialized_name="ninfer.QTensor",
         serialize_auxdata=aux_out, deserialize_auxdata=aux_in)


class ExportMismatch(ValueError):
    """Exported forwards that were not made for this runner; the message says what differs."""


_register_serialization()


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _leaves(tree) -> list:
    flat, treedef = jax.tree.flatten(_abstract(tree))
    return [str(treedef), [[list(x.shape), str(x.dtype)] for x in flat]]


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def signature(runner, cache) -> str:
    """sha256 of what an exported forward depends on besides its shape: the model config, the
    params' and cache's trees, shapes and dtypes, the engine's rows and the plan."""
    return hashlib.sha256(_canonical({
        "cfg": repr(runner.model.cfg), "params": _leaves(runner.model.params),
        "cache": _leaves(cache), "batch": runner.B, "plan": runner.plan.to_dict()})).hexdigest()


def backend_platform() -> str:
    """The export platform of JAX's default backend: "cpu", or "cuda" for a GPU."""
    backend = jax.default_backend()
    return {"cpu": "cpu", "gpu": "cuda"}.get(backend, backend)


@contextlib.contextmanager
def _tracing_for(platform: str):
    """Tracing as on `platform`: source locations left out of the module (reproducible bytes),
    and JAX's default backend read as the platform's ("gpu" for "cuda"), so the kernels take
    the form they run in there (compiled on a GPU, interpreted on a CPU) whatever this machine
    has."""
    with _TRACE_LOCK:
        limit = jax.config.jax_traceback_in_locations_limit
        real = jax.default_backend
        jax.config.update("jax_traceback_in_locations_limit", 0)
        backend = {"cpu": "cpu", "cuda": "gpu"}[platform]
        if real() != backend:
            jax.default_backend = lambda: backend
        try:
            yield
        finally:
            jax.default_backend = real
            jax.config.update("jax_traceback_in_locations_limit", limit)


def _forward_fn(runner, rows: int):
    """The forward compile() lowers for `rows` rows, as a function of arrays only (cfg and plan
    bound), with the cache donated."""
    cfg, plan = runner.model.cfg, runner.plan
    if rows == runner.B:
        def fwd(params, tokens, cache, lengths):
            return M.forward(params, cfg, tokens, cache, lengths=lengths, last_only=True,
                             plan=plan)
    else:
        def fwd(params, tokens, cache, rows, lengths):
            return M.forward_rows(params, cfg, tokens, cache, rows, lengths=lengths, plan=plan)
    return jax.jit(fwd, donate_argnames=("cache",))


def _args(runner, cache, rows: int, width: int):
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    params, cache = _abstract(runner.model.params), _abstract(cache)
    if rows == runner.B:
        return (params, i32((rows, width)), cache), {"lengths": i32((rows,))}
    return (params, i32((rows, width)), cache, i32((rows,))), {"lengths": i32((rows,))}


def _header(runner, cache, platform: str, rows: int, width: int) -> dict:
    return {"format": MAGIC.decode().strip(), "platform": platform, "rows": rows,
            "width": width, "plan": runner.plan.digest(), "signature": signature(runner, cache),
            "jax": jax.__version__}


def export_forwards(runner, cache_shapes, platform: str) -> dict[tuple[int, int], bytes]:
    """{(rows, width): blob} for every shape the runner runs, exported for `platform`. Needs only
    the params' and cache's shapes and dtypes (`cache_shapes` may be abstract)."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    checks = ([export.DisabledSafetyCheck.custom_call(t) for t in _CUDA_TARGETS]
              if platform == "cuda" else [])
    out = {}
    with _tracing_for(platform):
        for rows, width in runner.shapes():
            args, kwargs = _args(runner, cache_shapes, rows, width)
            exp = export.export(_forward_fn(runner, rows), platforms=[platform],
                                disabled_checks=checks)(*args, **kwargs)
            head = _canonical(_header(runner, cache_shapes, platform, rows, width))
            out[(rows, width)] = MAGIC + head + b"\n" + bytes(exp.serialize())
    return out


def read_header(blob: bytes) -> tuple[dict, bytes]:
    """(header, serialized Exported) of a blob; ExportMismatch if it is not one."""
    if not blob.startswith(MAGIC):
        raise ExportMismatch("not an exported forward (no ninfer-exported/1 header)")
    head, sep, body = blob[len(MAGIC):].partition(b"\n")
    try:
        header = json.loads(head)
    except ValueError:
        header = None
    if not sep or not isinstance(header, dict):
        raise ExportMismatch("an exported forward with a malformed header")
    return header, body


def check_forwards(runner, cache, blobs: dict) -> None:
    """Refuse blobs not made for this runner on this machine: ExportMismatch naming the first
    difference (platform, plan, the set of shapes, model/params/cache, a blob's own shape)."""
    here, want = backend_platform(), _header(runner, cache, backend_platform(), 0, 0)
    shapes = sorted(runner.shapes())
    if sorted(blobs) != shapes:
        raise ExportMismatch(f"the exported forwards are for shapes {sorted(blobs)}; this "
                             f"engine runs {shapes}")
    for sw, blob in sorted(blobs.items()):
        h, _ = read_header(blob)
        if h.get("platform") != here:
            raise ExportMismatch(f"forward {sw[0]}x{sw[1]} was exported for platform "
                                 f"{h.get('platform')!r}; this machine runs {here!r}")
        if h.get("plan") != want["plan"]:
            raise ExportMismatch(f"forward {sw[0]}x{sw[1]} was exported under kernel plan "
                                 f"{str(h.get('plan'))[:16]}...; this engine's plan is "
                                 f"{want['plan'][:16]}...")
        if (h.get("rows"), h.get("width")) != sw:
            raise ExportMismatch(f"forward {sw[0]}x{sw[1]} holds shape "
                                 f"{h.get('rows')}x{h.get('width')}")
        if h.get("signature") != want["signature"]:
            raise ExportMismatch(f"forward {sw[0]}x{sw[1]} was exported for another model "
                                 f"config, params, cache or engine size")


def load_forwards(runner, blobs: dict, cache, threads: int | None = None) -> float:
    """Check `blobs` (check_forwards), then compile each deserialized forward into
    `runner._compiled` (`ModelRunner.forward` calls them; nothing is traced but the exported
    call itself); returns seconds. A plan with the CUDA ops has them built and registered
    first, as compile() does."""
    t0 = time.monotonic()
    check_forwards(runner, cache, blobs)
    if runner.plan.uses_cuda:
        from engine.kernels import cuda_build

        cuda_build.require(runner.plan)

    def compile_one(item):
        (rows, width), blob = item
        exp = export.deserialize(bytearray(read_header(blob)[1]))
        args, kwargs = _args(runner, cache, rows, width)
        if rows == runner.B:
            def call(params, tokens, cache, lengths):
                return exp.call(params, tokens, cache, lengths=lengths)
        else:
            def call(params, tokens, cache, rows, lengths):
                return exp.call(params, tokens, cache, rows, lengths=lengths)
        return (rows, width), jax.jit(call, donate_argnames=("cache",)).lower(
            *args, **kwargs).compile()
    # XLA compiles with the GIL released: the shapes overlap, as in compile()
    with concurrent.futures.ThreadPoolExecutor(threads or worker_threads(),
                                               "ninfer-exported") as pool:
        for sw, compiled in pool.map(compile_one, sorted(blobs.items())):
            runner._compiled[sw] = compiled
            runner.exec_counts["exported"] = runner.exec_counts.get("exported", 0) + 1
    return time.monotonic() - t0


# ---- a lane's runner at its real shapes, without weights ----------------------------------
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}


def abstract_params(cfg, recipe: str, compute_dtype):
    """The stacked params' shapes and dtypes of `cfg` stored under the converter's `recipe`
    ("fp32", "bf16", "int4", ...) and served in `compute_dtype`, as the loader puts them on
    the device: dense tensors in the compute dtype, quantized matrices as stored."""
    from engine.io.convert import RECIPES
    from engine.ops.quant import QTensor, part_layout

    fmt = RECIPES[recipe]
    flat = {}
    for name, shape in cfg.tensor_specs().items():
        dense = (fmt is None or len(shape) == 1 or name.endswith("conv1d")
                 or name == "embed_tokens")
        if dense:
            flat[name] = jax.ShapeDtypeStruct(tuple(shape), compute_dtype)
            continue
        parts = {k: jax.ShapeDtypeStruct(s, np.dtype(d) if d != "float8_e4m3fn"
                                         else jnp.float8_e4m3fn)
                 for k, (d, s) in part_layout(fmt, tuple(shape)).items()}
        flat[name] = QTensor(data=parts["data"], scale=parts["scale"], fmt=fmt,
                             shape=tuple(shape))
    return jax.eval_shape(lambda f: M.stack_params(f, cfg), flat)


def abstract_cache(cfg, *, batch: int, context_tokens: int, capacity_tokens: int, kv_dtype,
                   conv_dtype):
    """The batched paged cache's shapes and dtypes, as `Memory` builds it (runtime/memory.py)."""
    from engine.model.cache import init_paged_cache
    from engine.ops import paged_kv as pk
    from engine.runtime.pages import pages_for

    max_pages = pages_for(context_tokens, pk.PAGE_SIZE)
    num_pages = max(pages_for(capacity_tokens, pk.PAGE_SIZE), batch * max_pages)
    table = np.zeros((batch, max_pages), np.int32)
    return jax.eval_shape(lambda: init_paged_cache(
        cfg, pk.init_kv_pool(cfg, num_pages, pk.PAGE_SIZE, kv_dtype), table, conv_dtype))


def lane_runner(profile):
    """(ModelRunner, abstract cache) of a lane at its model config, weight format, plan, rows
    (max_concurrency), prefill chunk and KV pool, with abstract params: no weights are made."""
    from engine.io.loader import LoadedModel
    from engine.runtime.runner import ModelRunner
    from lanes.profile import model_config

    cfg = model_config(profile)
    dt, kv = _DTYPES[profile.compute_dtype], _DTYPES[profile.kv_dtype]
    model = LoadedModel(cfg=cfg, params=abstract_params(cfg, profile.weights, dt),
                        tokenizer=None, chat_template="", sha256="", path=None,
                        compute_dtype=dt, kv_dtype=kv)
    runner = ModelRunner(model, profile.plan, batch=profile.max_concurrency,
                         prefill_chunk=profile.prefill_chunk)
    cache = abstract_cache(cfg, batch=profile.max_concurrency,
                           context_tokens=profile.context_tokens,
                           capacity_tokens=profile.kv_capacity_tokens, kv_dtype=kv,
                           conv_dtype=dt)
    return runner, cache
