"""The custom calls and kernel names of the engine's forwards, lowered for CUDA on any machine
(no GPU needed): the inventory that pins what a kernel plan runs.

    .venv/bin/python -m tests.lowering_inventory --plan h200 --out tests/golden/h200_lowering.json

For each forward the engine compiles (the decode step of an engine of 1 and of 2 rows, and each
prefill piece width over one row of a 2-row engine) at the qwen3.8-27b shapes with int4_g64
weights and a bf16 KV pool, it lists every `stablehlo.custom_call` by target, with the Triton
kernel's name for a Pallas call and the attributes of an FFI call, counted.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tests.kernel_checks import cuda_module_text

CONTEXT = 32768
PREFILL_CHUNK = 8192
BATCH = 2

_CALL = re.compile(r'stablehlo\.custom_call @([\w$.]+)\((.*?)\)\s*\{(.*?)\}\s*:', re.S)
_TRITON_NAME = re.compile(r'name = \\?"([\w.]+)\\?"')
_FFI_ATTRS = re.compile(r'mhlo\.backend_config = \{(.*?)\}', re.S)


def _abstract_params(cfg):
    """The stacked params' shapes with int4_g64 matrices (as bench/bench_27b.py builds them)."""
    from engine.kernels.stacked import MATRICES
    import engine.model.model as M
    from engine.ops.quant import GROUP, INT4_G64, QTensor

    specs = cfg.tensor_specs()
    flat = {n: jax.ShapeDtypeStruct(s, jnp.bfloat16) for n, s in specs.items()}
    shapes = jax.eval_shape(lambda f: M.stack_params(f, cfg), flat)
    paths, tree = jax.tree_util.tree_flatten_with_path(shapes)
    out = []
    for path, leaf in paths:
        name = str(getattr(path[-1], "key", ""))
        if (name in MATRICES or name == "lm_head") and "mtp" not in str(path):
            *lead, n, k = leaf.shape
            out.append(QTensor(data=jax.ShapeDtypeStruct((*lead, n, k // 2), jnp.uint8),
                               scale=jax.ShapeDtypeStruct((*lead, n, k // GROUP), jnp.float32),
                               fmt=INT4_G64, shape=(n, k)))
        else:
            out.append(leaf)
    return jax.tree.unflatten(tree, out)


def _abstract_cache(cfg, batch: int):
    from engine.model.cache import init_paged_cache
    from engine.ops import paged_kv as pk
    from engine.runtime.pages import pages_for

    pages = pages_for(CONTEXT, pk.PAGE_SIZE)
    table = np.zeros((batch, pages), np.int32)
    return jax.eval_shape(lambda: init_paged_cache(
        cfg, pk.init_kv_pool(cfg, batch * pages, pk.PAGE_SIZE, jnp.bfloat16), table,
        jnp.bfloat16))


def summarize(text: str) -> dict[str, int]:
    """{"target[ kernel name | ffi attributes]": count} of a lowered module's custom calls."""
    counts: collections.Counter = collections.Counter()
    for target, _, attrs in _CALL.findall(text):
        label = target
        if "triton" in target:
            m = _TRITON_NAME.search(attrs)
            label += f" {m.group(1) if m else '?'}"
        elif target.startswith("ninfer_"):
            m = _FFI_ATTRS.search(attrs)
            if m:
                items = sorted(a.strip() for a in m.group(1).split(","))
                label += " {" + ", ".join(items) + "}"
        counts[label] += 1
    return dict(sorted(counts.items()))


def forwards(call_kw: dict):
    """(name, fn, args) for each forward the engine compiles, as Engine binds them."""
    import engine.model.model as M
    from engine.model.config import QWEN38_27B
    from engine.runtime.scheduler import piece_widths

    cfg = QWEN38_27B
    params = _abstract_params(cfg)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    for b in (1, BATCH):
        cache = _abstract_cache(cfg, b)
        yield (f"decode b{b}",
               lambda p, t, c, n: M.forward(p, cfg, t, c, lengths=n, last_only=True, **call_kw),
               (params, i32(b, 1), cache, i32(b)))
    cache = _abstract_cache(cfg, BATCH)
    for w in piece_widths(PREFILL_CHUNK):
        yield (f"prefill w{w}",
               lambda p, t, c, n, r: M.forward_rows(p, cfg, t, c, r, lengths=n, **call_kw),
               (params, i32(1, w), cache, i32(1), i32(1)))


def inventory(call_kw: dict) -> dict:
    """{forward name: summarize(its CUDA lowering)}; JAX's default backend reads "gpu" while
    tracing, so the kernels take their compiled (not interpreted) form."""
    real = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        return {name: summarize(cuda_module_text(fn, *args)) for name, fn, args in forwards(call_kw)}
    finally:
        jax.default_backend = real


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default="h200")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        from engine.plan import preset
        call_kw = {"plan": preset(a.plan)}
    except ImportError:  # the tree before kernel plans: its GPU defaults, CUDA op available
        from engine.kernels import cuda_ops
        cuda_ops.available = lambda: True
        call_kw = {"kernels": "pallas"}
    inv = inventory(call_kw)
    Path(a.out).write_text(json.dumps(inv, indent=1, sort_keys=True) + "\n")
    for name, calls in inv.items():
        print(f"{name}: {sum(calls.values())} calls, {len(calls)} kinds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
