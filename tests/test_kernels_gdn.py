"""Recurrent gated-delta-rule kernel (engine/kernels/gdn_decode.py) against the references, and
in the Pallas interpreter on CPU, lowered for CUDA, and on the GPU (-m gpu)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels.gdn_decode import gdn_recurrent, gdn_recurrent_ref
from engine.ops.gdn import chunk_gated_delta_rule, l2_normalize
from tests.kernel_checks import assert_close, lowers_for_cuda, on_gpu


def _gdn_inputs(rng, b, t, hk, hv, dk, dv):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k = l2_normalize(f(b, t, hk, dk)), l2_normalize(f(b, t, hk, dk))
    g = -jnp.asarray(rng.uniform(0.0, 2.0, (b, t, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, t, hv)), jnp.float32)
    return q, k, f(b, t, hv, dv), g, beta, f(b, hv, dk, dv)


@pytest.mark.parametrize("t,batch", [(1, 2), (3, 1)])
def test_gdn_recurrent_matches_references(t, batch):
    rng = np.random.default_rng()
    args = _gdn_inputs(rng, batch, t, 2, 6, 32, 32)
    out, state = gdn_recurrent(*args, interpret=True, bv=16)
    ro, rs = gdn_recurrent_ref(*args)
    assert_close(out, ro, jnp.float32)
    assert_close(state, rs, jnp.float32)
    co, cs = chunk_gated_delta_rule(*args)  # the chunked form agrees too
    assert_close(state, cs, jnp.float32)


def test_gdn_recurrent_lowers_to_triton():
    args = _gdn_inputs(np.random.default_rng(0), 1, 1, 16, 48, 128, 128)
    lowers_for_cuda(lambda *a: gdn_recurrent(*a, interpret=False), *args)


@pytest.mark.gpu
def test_gdn_recurrent_gpu_27b_heads():
    assert on_gpu()
    args = _gdn_inputs(np.random.default_rng(), 2, 1, 16, 48, 128, 128)
    out, state = gdn_recurrent(*args)
    ro, rs = gdn_recurrent_ref(*args)
    assert_close(out, ro, jnp.float32)
    assert_close(state, rs, jnp.float32)
