"""The fused decode norms (engine/kernels/norm_sums.py) against their pure-JAX references in the
Pallas interpreter, their Triton lowering, and the model's decode step through them against
the plain norms; on a GPU (`-m gpu`) the compiled kernels against the references."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels import norm_sums as N
import engine.model.model as M
from engine.model.config import TEST_SMALL
from engine.model.params import random_flat_params, stack_params
from engine.plan import PALLAS
from tests.kernel_checks import BOUNDS, assert_close, lowers_for_cuda, on_gpu, rel_err

DTYPES = (jnp.bfloat16, jnp.float32)


def _rms_case(rng, m, k, dtype, add, lead=(3,)):
    x = jnp.asarray(rng.standard_normal((m, 1, k)) * 3, dtype)
    h = jnp.asarray(rng.standard_normal((m, 1, k)), dtype) if add else None
    w = jnp.asarray(rng.standard_normal((*lead, k)) * 0.2, dtype)
    index = jnp.asarray([int(rng.integers(0, d)) for d in lead], jnp.int32)
    return x, h, w, index


def _check_rms(got, want, dtype):
    s, y, sums = got
    assert s.dtype == y.dtype == dtype and sums.dtype == jnp.float32
    assert s.shape == y.shape == want[1].shape and sums.shape == want[2].shape
    assert np.array_equal(np.asarray(s, np.float32), np.asarray(want[0], np.float32))
    assert_close(y, want[1], dtype)
    assert_close(sums, want[2], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("m,k", [(1, 5120), (2, 5120), (4, 320), (3, 64)])
def test_rms_norm_sums_matches_reference(dtype, add, m, k):
    rng = np.random.default_rng()
    x, h, w, index = _rms_case(rng, m, k, dtype, add)
    got = N.rms_norm_sums(x, w, 1e-6, h, index=index)
    _check_rms(got, N.rms_norm_sums_ref(x, w[index[0]], 1e-6, h), dtype)


def test_rms_norm_sums_reads_a_two_level_stack_and_a_plain_weight():
    rng = np.random.default_rng()
    x, h, w, index = _rms_case(rng, 2, 256, jnp.bfloat16, True, lead=(2, 3))
    got = N.rms_norm_sums(x, w, 1e-6, h, index=index)
    _check_rms(got, N.rms_norm_sums_ref(x, w[index[0], index[1]], 1e-6, h), jnp.bfloat16)
    plain = N.rms_norm_sums(x, w[1, 2], 1e-6, h)
    _check_rms(plain, N.rms_norm_sums_ref(x, w[1, 2], 1e-6, h), jnp.bfloat16)


def test_rms_norm_sums_rows_are_batch_invariant():
    """A row's results do not depend on the rows beside it: the same bits alone and in a
    batch of four."""
    rng = np.random.default_rng()
    x, h, w, index = _rms_case(rng, 4, 5120, jnp.bfloat16, True)
    batch = N.rms_norm_sums(x, w, 1e-6, h, index=index)
    alone = N.rms_norm_sums(x[2:3], w, 1e-6, h[2:3], index=index)
    for a, b in zip(alone, batch):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b[2:3], np.float32))


def test_norm_sums_reject_bad_shapes():
    x = jnp.zeros((1, 1, 100), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64"):
        N.rms_norm_sums(x, jnp.zeros((100,), jnp.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="do not match"):
        N.rms_norm_sums(jnp.zeros((1, 1, 128), jnp.bfloat16), jnp.zeros((64,), jnp.bfloat16),
                        1e-6)
    with pytest.raises(ValueError, match="must be \\[K\\]"):
        N.rms_norm_sums(jnp.zeros((1, 1, 128), jnp.bfloat16),
                        jnp.zeros((2, 128), jnp.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="must fit"):
        N.gated_norm_sums(jnp.zeros((1, 1, 4, 64)), jnp.zeros((1, 1, 300), jnp.bfloat16), 100,
                          jnp.zeros((64,), jnp.bfloat16), 1e-6)


def _gated_case(rng, m, hv, dv, z_at, extra=96):
    out = jnp.asarray(rng.standard_normal((m, 1, hv, dv)), jnp.float32)
    proj = jnp.asarray(rng.standard_normal((m, 1, z_at + hv * dv + extra)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((5, dv)), jnp.bfloat16)
    z = proj[:, :, z_at:z_at + hv * dv].reshape(m, 1, hv, dv)
    return out, proj, w, z


@pytest.mark.parametrize("m,hv,dv,z_at", [(1, 48, 128, 10240), (2, 48, 128, 10240),
                                          (3, 4, 64, 192), (4, 6, 128, 64)])
def test_gated_norm_sums_matches_reference(m, hv, dv, z_at):
    rng = np.random.default_rng()
    out, proj, w, z = _gated_case(rng, m, hv, dv, z_at)
    y, sums = N.gated_norm_sums(out, proj, z_at, w, 1e-6, index=jnp.asarray([3], jnp.int32))
    want_y, want_sums = N.gated_norm_sums_ref(out, z, w[3], 1e-6)
    assert y.shape == want_y.shape and y.dtype == jnp.bfloat16
    assert sums.shape == (m, 1, hv * dv // 64)
    assert_close(y, want_y, jnp.bfloat16)
    assert_close(sums, want_sums, jnp.bfloat16)


def test_norm_kernels_lower_to_triton():
    rng = np.random.default_rng()
    x, h, w, index = _rms_case(rng, 2, 5120, jnp.bfloat16, True)
    lowers_for_cuda(lambda x, h, w: N.rms_norm_sums(x, w, 1e-6, h, index=index,
                                                    interpret=False), x, h, w)
    lowers_for_cuda(lambda x, w: N.rms_norm_sums(x, w, 1e-6, index=index, interpret=False),
                    x, w)
    out, proj, w, _ = _gated_case(rng, 2, 48, 128, 10240)
    lowers_for_cuda(lambda o, p, w: N.gated_norm_sums(o, p, 10240, w, 1e-6,
                                                      index=jnp.asarray([1], jnp.int32),
                                                      interpret=False), out, proj, w)


# A small model whose GDN value heads are 64 wide, so that the gated norm's kernel applies too.
CFG = dataclasses.replace(TEST_SMALL, name="test-small-norms", hidden_size=128,
                          linear_value_head_dim=64)


# The fused norms need no CUDA op: PALLAS with norms "fused" runs them in the interpreter here.
FUSED = dataclasses.replace(PALLAS, norms="fused")


def _decode(plan, params, c0, tok, steps=2, feed=None):
    """`steps` decode steps; each next token is the step's argmax, or `feed`'s (the tokens
    another plan chose: a bf16 near-tie between two logits may pick another token, after
    which the steps would no longer compare the same inputs). Returns (logits, tokens fed
    after the first, the forward)."""
    fwd = M.jit_forward()  # the plan is a static argument: each plan its own trace
    c, outs, fed = jax.tree.map(jnp.copy, c0), [], []
    for i in range(steps):
        lg, _, c = fwd(params, CFG, tok, c, plan=plan)
        outs.append(lg)
        tok = (jnp.argmax(lg[:, -1], -1).astype(jnp.int32)[:, None] if feed is None
               else feed[i])
        fed.append(tok)
    return jnp.concatenate(outs, 1), fed, fwd


def test_model_decode_through_fused_norms_matches_plain_norms():
    """bf16 decode steps with the pallas plan: with norms "fused" (as the h200 plan has them)
    the logits are about as close to a float32 reference (the same weights, upcast) as the
    plain norms' are (within twice their error, or twice bf16's bound), and the traced step does call both kernels;
    with norms "xla" it does not call the fused RMSNorm. (Fused against plain directly is
    the sum of both paths' rounding: on about one prompt in 60 that passed 2e-2 while each
    path alone was as close to float32 as the other.) Every run feeds the plain plan's
    tokens, so that a bf16 near-tie between two logits cannot change the next step's input."""
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a,
                          stack_params(random_flat_params(CFG, seed=5), CFG))
    b = 2
    rng = np.random.default_rng()
    prompt = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, 8)), jnp.int32)
    _, _, c0 = M.jit_forward()(params, CFG, prompt, M.init_cache(CFG, b, 32, jnp.bfloat16))
    plain, fed, _ = _decode(PALLAS, params, c0, prompt[:, -1:])
    fused, _, fwd = _decode(FUSED, params, c0, prompt[:, -1:], feed=fed)
    p32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a,
                       params)
    _, _, c32 = M.jit_forward()(p32, CFG, prompt, M.init_cache(CFG, b, 32, jnp.float32))
    ref, _, _ = _decode(PALLAS, p32, c32, prompt[:, -1:], feed=fed)
    err, err_plain = rel_err(fused, ref), rel_err(plain, ref)
    # two steps through the whole model: the plain path itself was up to 2.9e-2 from float32
    # (80 prompts); a wrong norm is off by ~1
    assert err < 2 * max(BOUNDS["bfloat16"], err_plain), (err, err_plain)
    text = str(jax.make_jaxpr(lambda c: fwd(params, CFG, prompt[:, -1:], c,
                                            plan=FUSED))(c0))
    assert "rms_norm_sums" in text and "gated_norm_sums" in text
    text = str(jax.make_jaxpr(lambda c: M.jit_forward()(params, CFG, prompt[:, -1:], c,
                                                        plan=PALLAS))(c0))
    assert "rms_norm_sums" not in text


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu(), reason="needs a GPU (run with -m gpu on the H200)")
@pytest.mark.parametrize("m", [1, 2, 4])
def test_norm_kernels_gpu_27b_shapes(m):
    rng = np.random.default_rng()
    x, h, w, index = _rms_case(rng, m, 5120, jnp.bfloat16, True, lead=(64,))
    _check_rms(N.rms_norm_sums(x, w, 1e-6, h, index=index),
               N.rms_norm_sums_ref(x, w[index[0]], 1e-6, h), jnp.bfloat16)
    out, proj, w, z = _gated_case(rng, m, 48, 128, 10240)
    y, sums = N.gated_norm_sums(out, proj, 10240, w, 1e-6, index=jnp.asarray([2], jnp.int32))
    want_y, want_sums = N.gated_norm_sums_ref(out, z, w[2], 1e-6)
    assert_close(y, want_y, jnp.bfloat16)
    assert_close(sums, want_sums, jnp.bfloat16)
