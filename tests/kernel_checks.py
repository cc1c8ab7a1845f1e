"""Helpers shared by the kernel tests (tests/test_kernels_*.py): normwise error, bounds per
dtype, and the check that a kernel lowers to Triton for CUDA (runs on a CPU-only machine)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from engine.kernels.cuda_build import FFI_TARGETS

# ||out - ref|| / ||ref|| bounds by compute dtype (METHOD.md: fp32 far under 1e-3; bf16
# operands 1e-3..1e-2).
BOUNDS = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3}


def rel_err(got, want) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    assert np.isfinite(got).all(), "kernel output has NaN/inf"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_close(got, want, dtype) -> None:
    err = rel_err(got, want)
    assert err < BOUNDS[jnp.dtype(dtype).name], f"normwise error {err:.3g} ({jnp.dtype(dtype)})"


# The custom calls a CUDA lowering may hold: Pallas's Triton calls and the CUDA ops' FFI targets
CUDA_TARGETS = ("__gpu$xla.gpu.triton", *FFI_TARGETS)


def cuda_module_text(fn, *args) -> str:
    """`fn` exported for CUDA (no GPU needed): the lowered module's text."""
    exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call(t) for t in CUDA_TARGETS])(*args)
    return exp.mlir_module()


def lowers_for_cuda(fn, *args) -> str:
    """Export `fn` (a kernel call with interpret=False) for CUDA: this runs the Pallas -> Triton
    lowering, so unsupported primitives or block shapes fail here, without a GPU."""
    text = cuda_module_text(fn, *args)
    assert "__gpu$xla.gpu.triton" in text
    return text


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def random_pool(rng, kv_dtype, layers, pages, page, kvh, hd):
    """A KV pool of random K/V (bf16/f32, or int8 codes with per-token scales)."""
    from engine.ops.paged_kv import KVPool, quantize_kv

    k = rng.standard_normal((layers, pages, page, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((layers, pages, page, kvh, hd)).astype(np.float32)
    if kv_dtype == "int8":
        (kc, ks), (vc, vs) = quantize_kv(jnp.asarray(k)), quantize_kv(jnp.asarray(v))
        return KVPool(kc, vc, ks, vs)
    return KVPool(jnp.asarray(k, kv_dtype), jnp.asarray(v, kv_dtype), None, None)


def paged_decode_ab(cfg, plans: dict, marker: str, marked=("on",), seed: int = 9) -> dict:
    """The bf16 model's two paged decode steps (two rows after an 8-token prefill) under each
    KernelPlan of `plans` ({name: plan}, engine/plan.py): {name: (logits, cache)}. Asserts
    that the kernel named `marker` is in the step's jaxpr exactly for the plans named in
    `marked`. The plans are static arguments of the forward: each is its own trace."""
    import engine.model.model as M
    from engine.model.params import random_flat_params, stack_params
    from engine.ops import paged_kv as pk

    assert set(marked) <= set(plans), f"marked {marked} not among the plans {list(plans)}"
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a,
                          stack_params(random_flat_params(cfg, seed=seed), cfg))
    b = 2
    prompt = jnp.asarray(np.random.default_rng().integers(0, cfg.vocab_size, (b, 8)),
                         jnp.int32)
    pool = pk.init_kv_pool(cfg, 2 * b, 16, jnp.bfloat16)
    c0 = M.init_paged_cache(cfg, pool, np.arange(2 * b, dtype=np.int32).reshape(b, 2))
    fwd = M.jit_forward()
    _, _, c0 = fwd(params, cfg, prompt, c0)
    outs = {}
    for name, plan in plans.items():
        c, lg = jax.tree.map(jnp.copy, c0), []
        tok = prompt[:, -1:]
        for _ in range(2):
            out, _, c = fwd(params, cfg, tok, c, plan=plan)
            lg.append(out)
            tok = jnp.argmax(out[:, -1], -1).astype(jnp.int32)[:, None]
        outs[name] = (jnp.concatenate(lg, 1), c)
        text = str(jax.make_jaxpr(lambda c: fwd(params, cfg, prompt[:, -1:], c,
                                                plan=plan))(c0))
        assert (marker in text) == (name in marked), (name, marker)
    return outs
