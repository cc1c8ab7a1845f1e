"""The model with the pallas plan against the reference plan (engine/plan.py): decode steps
over the contiguous and the paged cache, dense and int4 weights (Pallas interpreter on CPU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine.model.model as M
from engine.model.config import TEST_SMALL
from engine.model.params import random_flat_params, stack_params
from engine.ops import paged_kv as pk
from engine.ops.quant import quantize
from engine.plan import PALLAS, REFERENCE, PlanError
from tests.kernel_checks import assert_close


def _small_params(fmt):
    flat = random_flat_params(TEST_SMALL, seed=3)
    if fmt != "dense":
        flat = {n: (jax.tree.map(jnp.asarray, quantize(w, fmt))
                    if w.ndim == 2 and n != "embed_tokens" and w.shape[1] % 64 == 0 else w)
                for n, w in flat.items()}
    return stack_params(flat, TEST_SMALL)


@pytest.mark.parametrize("fmt,paged", [("int4_g64", False), ("dense", True)])
def test_model_pallas_equals_xla(fmt, paged):
    """Prefill 16 tokens with the reference, then 2 decode steps both ways: same logits."""
    cfg, b = TEST_SMALL, 2
    params = _small_params(fmt)
    rng = np.random.default_rng()
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 16)), jnp.int32)

    def cache():
        if not paged:
            return M.init_cache(cfg, b, 64)
        pool = pk.init_kv_pool(cfg, 2 * b, 32, jnp.float32)
        return M.init_paged_cache(cfg, pool, np.arange(2 * b, dtype=np.int32).reshape(b, 2))

    fwd = M.jit_forward()
    _, _, c0 = fwd(params, cfg, prompt, cache())
    outs = {}
    for name, plan in (("reference", REFERENCE), ("pallas", PALLAS)):
        c = jax.tree.map(jnp.copy, c0)
        tok, logits = prompt[:, -1:], []
        for _ in range(2):
            lg, _, c = fwd(params, cfg, tok, c, plan=plan)
            logits.append(lg)
            tok = jnp.argmax(lg[:, -1], -1).astype(jnp.int32)[:, None]
        outs[name] = jnp.concatenate(logits, 1)
    assert_close(outs["pallas"], outs["reference"], jnp.float32)


def test_model_rejects_a_plan_that_is_not_a_kernel_plan():
    """A plan given as anything but a KernelPlan (an old kernels= string such as "cuda") is a
    PlanError (a ValueError) naming what it must be, before anything is traced."""
    with pytest.raises(PlanError, match="KernelPlan"):
        M.forward({}, TEST_SMALL, jnp.zeros((1, 1), jnp.int32), M.init_cache(TEST_SMALL, 1, 8),
                  plan="cuda")
    assert issubclass(PlanError, ValueError)
