"""The RTX lanes' kernel plans against the h200 plan on one GPU (-m gpu): the same model, prompt
and paged cache through each plan's kernels give the same logits within bf16's bound.

The rtx3090/4090/5090 profiles take the `pallas` preset (Pallas's Triton kernels, compiled for
whatever card runs them, and no CUDA op), so the H200 runs the very code paths those lanes run;
only the card's speed differs. Each lane's own KV format (int8) is used for both plans.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine.model.model as M
from engine.ops import paged_kv as pk
from engine.plan import H200, REFERENCE
from lanes.profile import load_profile
from tests.kernel_checks import assert_close, on_gpu

PROMPT, STEPS, PAGE = 200, 4, 64
_H200: dict = {}  # the h200 plan's logits by KV dtype, computed once


def plan_logits(model, plan, kv_dtype) -> jax.Array:
    """Prefill a fixed 200-token prompt (two rows) on a paged cache, then 4 greedy decode
    steps; the logits of every decode step, [2, 4, vocab], in float32."""
    cfg, b = model.cfg, 2
    prompt = jnp.asarray(np.random.default_rng(7).integers(0, 50_000, (b, PROMPT)), jnp.int32)
    pages = -(-(PROMPT + STEPS) // PAGE)
    pool = pk.init_kv_pool(cfg, b * pages, PAGE, kv_dtype)
    cache = M.init_paged_cache(cfg, pool, np.arange(b * pages, dtype=np.int32).reshape(b, pages),
                               dtype=model.compute_dtype)
    fwd = M.jit_forward()
    lg, _, cache = fwd(model.params, cfg, prompt, cache, plan=plan)
    tok, out = jnp.argmax(lg[:, -1], -1).astype(jnp.int32)[:, None], []
    for _ in range(STEPS):
        lg, _, cache = fwd(model.params, cfg, tok, cache, plan=plan)
        out.append(lg.astype(jnp.float32))
        tok = jnp.argmax(lg[:, -1], -1).astype(jnp.int32)[:, None]
    return jnp.concatenate(out, 1)


@pytest.fixture(scope="module")
def bf16_model(embedded_models_dir):
    from engine.io.loader import load_model

    return load_model(embedded_models_dir / "tiny.ninfer", compute_dtype="bfloat16",
                      kv_dtype="bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("lane", ["rtx3090", "rtx4090", "rtx5090"])
def test_rtx_lane_plan_equals_the_h200_plan_on_gpu(bf16_model, lane):
    assert on_gpu()
    from engine.kernels import cuda_ops

    cuda_ops.require(H200)
    profile = load_profile(lane)
    assert not profile.plan.uses_cuda  # Triton kernels only: nothing built for another card
    kv = jnp.dtype(profile.kv_dtype)
    if kv.name not in _H200:
        _H200[kv.name] = plan_logits(bf16_model, H200, kv)
    assert_close(plan_logits(bf16_model, profile.plan, kv), _H200[kv.name], jnp.bfloat16)


@pytest.mark.slow  # ~35 s of Pallas's interpreter on a CPU
def test_plan_logits_agree_between_plans_on_this_machine(bf16_model):
    """The comparison itself, on any machine: the rtx lanes' plan against the reference."""
    plan = load_profile("rtx4090").plan
    assert_close(plan_logits(bf16_model, plan, jnp.int8),
                 plan_logits(bf16_model, REFERENCE, jnp.int8), jnp.bfloat16)
