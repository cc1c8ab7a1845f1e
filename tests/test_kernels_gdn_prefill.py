"""Chunked gated-delta-rule prefill kernel (engine/kernels/gdn_prefill.py) against the chunked
reference (and the step-by-step oracle), in the Pallas interpreter on CPU, lowered for CUDA, and
on the GPU (-m gpu)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels.gdn_decode import gdn_recurrent
from engine.kernels.gdn_inverse import diag_inverse
from engine.kernels.gdn_prefill import chunk_len, gdn_chunk, gdn_chunk_ref
from engine.model.gdn import select_rule
from engine.ops import gdn
from engine.ops.gdn import recurrent_gated_delta_rule
from engine.plan import PALLAS, REFERENCE
from tests.kernel_checks import assert_close, lowers_for_cuda, on_gpu, rel_err
from tests.test_kernels_gdn import _gdn_inputs


def _args(rng, b, t, hk, hv, dk, dv, dtype, with_state):
    q, k, v, g, beta, s0 = _gdn_inputs(rng, b, t, hk, hv, dk, dv)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    return q, k, v, g, beta, s0 if with_state else None


# The kernel's diagonal-block inverse against XLA's, in the terms XLA prepares for the scan:
# fp32 rounding, or bf16's last bit where the inverse is rounded to bf16 for its products.
SAME_INVERSE = {"float32": 1e-5, "bfloat16": 1e-3}


def _check(args, dtype):
    out, state = gdn_chunk(*args)
    ro, rs = gdn_chunk_ref(*args)
    assert out.shape == ro.shape and out.dtype == jnp.float32
    assert_close(out, ro, dtype)
    assert_close(state, rs, dtype)
    return out, state


def _check_inverse_terms(args, dtype):
    """The state-independent terms `gdn_chunk` has XLA prepare (`gdn.chunk_intra`, padded and
    cast as the kernel does), with the diagonal blocks inverted by engine/kernels/gdn_inverse.py
    and by XLA's substitution (`gdn.diag_block_inverse`): the same to SAME_INVERSE."""
    q, k, v, g, beta, _ = args
    t, f32 = q.shape[1], jnp.float32
    cdt = f32 if jnp.dtype(dtype) == f32 else jnp.bfloat16
    c = chunk_len(t)
    pad = (-t) % c
    q, k, v = (jnp.pad(x.astype(cdt), ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    g, beta = (jnp.pad(x.astype(f32), ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    ops = "fp32" if cdt == f32 else "bf16"
    scale = q.shape[-1] ** -0.5
    with_kernel = gdn.chunk_intra(q, k, v, g, beta, c, scale, ops, diag_inverse)
    with_xla = gdn.chunk_intra(q, k, v, g, beta, c, scale, ops)
    for got, base in zip(with_kernel, with_xla):
        assert rel_err(got, base) < SAME_INVERSE[jnp.dtype(dtype).name]


# lengths 1..3 (one padded 16-step chunk) and ragged multi-chunk lengths (whole chunks: below)
@pytest.mark.parametrize("t,batch,dk,with_state,dtype", [
    (1, 2, 16, True, jnp.float32), (3, 1, 32, False, jnp.float32),
    (100, 2, 32, False, jnp.float32),
    (200, 1, 32, True, jnp.float32),
    (2, 1, 16, True, jnp.bfloat16), (130, 2, 32, True, jnp.bfloat16)])
def test_gdn_chunk_matches_reference(t, batch, dk, with_state, dtype):
    """Every state-independent term from XLA (gdn.chunk_intra) feeding the lean scan
    kernel."""
    args = _args(np.random.default_rng(), batch, t, 2, 4, dk, 32, dtype, with_state)
    _check(args, dtype)


def test_gdn_chunk_with_the_inverse_kernel():
    """The UT transform's diagonal blocks come from engine/kernels/gdn_inverse.py: the terms
    XLA prepares are the ones with XLA's substitution to fp32 rounding (with bf16 inputs the
    inverse is rounded to bf16 for its products, where the last bit can differ), the result
    the reference's within the dtype's bound. It is what the model's rule runs (gdn_prefill
    "pallas")."""
    for t, dtype in ((200, jnp.float32), (130, jnp.bfloat16)):
        args = _args(np.random.default_rng(), 2, t, 2, 4, 32, 32, dtype, True)
        got = gdn_chunk(*args)
        _check_inverse_terms(args, dtype)
        for g_, r_ in zip(got, gdn_chunk_ref(*args)):
            assert_close(g_, r_, dtype)
    for g_, w_ in zip(select_rule("chunk", PALLAS, 512)(*args), got):
        np.testing.assert_array_equal(g_, w_)
    q, k, v, g, beta, _ = args
    with pytest.raises(ValueError, match="ops"):
        gdn.chunk_intra(q, k, v, g, beta, chunk_len(q.shape[1]), 1.0, "fp16")


def test_lean_scan_with_128_step_chunks():
    """128-step chunks through the lean scan match the reference (a ragged last chunk, a
    carried state) and are what the model's rule runs for a caller's chunk_size=128."""
    args = _args(np.random.default_rng(7), 1, 300, 2, 4, 32, 32, jnp.float32, True)
    got = gdn_chunk(*args, chunk_size=128)
    for g_, r_ in zip(got, gdn_chunk_ref(*args)):
        assert_close(g_, r_, jnp.float32)
    rule = select_rule("chunk", PALLAS, 512)
    for g_, w_ in zip(rule(*args, chunk_size=128), got):
        np.testing.assert_array_equal(g_, w_)


def test_gdn_chunk_matches_recurrent_oracle_and_carries_state():
    """Whole chunks; two calls carrying the state equal one call and the step-by-step rule."""
    q, k, v, g, beta, s0 = _args(np.random.default_rng(), 1, 96, 2, 4, 16, 16, jnp.float32, True)
    out, state = gdn_chunk(q, k, v, g, beta, s0, chunk_size=16)
    ro, rs = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert_close(out, ro, jnp.float32)
    assert_close(state, rs, jnp.float32)
    o1, s1 = gdn_chunk(q[:, :48], k[:, :48], v[:, :48], g[:, :48], beta[:, :48], s0,
                       chunk_size=16)
    o2, s2 = gdn_chunk(q[:, 48:], k[:, 48:], v[:, 48:], g[:, 48:], beta[:, 48:], s1,
                       chunk_size=16)
    assert_close(jnp.concatenate([o1, o2], 1), ro, jnp.float32)
    assert_close(s2, rs, jnp.float32)


def test_chunk_len_and_selection():
    assert [chunk_len(t) for t in (1, 3, 16, 17, 63, 64, 1000)] == [16, 16, 16, 32, 64, 64, 64]
    # the kernel is the prefill rule of gdn_prefill "pallas", fed every state-independent
    # term by XLA; gdn_prefill "xla" keeps the reference
    rule = select_rule("chunk", PALLAS, 512)
    assert rule.bf16_operands and rule.__module__ == gdn_chunk.__module__
    args = _args(np.random.default_rng(1), 1, 40, 2, 4, 16, 16, jnp.float32, True)
    for got, want in zip(rule(*args), gdn_chunk(*args)):
        np.testing.assert_array_equal(got, want)
    assert (select_rule("chunk", dataclasses.replace(PALLAS, gdn_prefill="xla"), 512)
            is gdn.chunk_gated_delta_rule)
    assert select_rule("chunk", PALLAS, 1) is gdn_recurrent
    assert select_rule("chunk", REFERENCE, 512) is gdn.chunk_gated_delta_rule
    assert select_rule("recurrent", PALLAS, 512) is gdn.recurrent_gated_delta_rule
    # head dims that are not Triton tiles take the reference
    args = _args(np.random.default_rng(), 1, 5, 1, 2, 24, 16, jnp.float32, True)
    for got, want in zip(gdn_chunk(*args), gdn_chunk_ref(*args)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gdn_chunk_lowers_to_triton(dtype):
    args = _args(np.random.default_rng(0), 1, 100, 16, 48, 128, 128, dtype, True)
    text = lowers_for_cuda(lambda *a: gdn_chunk(*a, interpret=False), *args)
    assert text.count("__gpu$xla.gpu.triton") == 2  # the diagonal blocks' inverse + scan


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gdn_chunk_gpu_27b_heads(dtype):
    assert on_gpu()
    args = _args(np.random.default_rng(), 2, 1000, 16, 48, 128, 128, dtype, True)
    _check(args, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gdn_chunk_gpu_27b_heads_inverse_kernel(dtype):
    """The terms XLA prepares with the diagonal blocks' inverse kernel against those with
    XLA's substitution, and the rule's result against the reference, compiled."""
    assert on_gpu()
    args = _args(np.random.default_rng(), 2, 1000, 16, 48, 128, 128, dtype, True)
    _check_inverse_terms(args, dtype)
    for g_, r_ in zip(gdn_chunk(*args), gdn_chunk_ref(*args)):
        assert_close(g_, r_, dtype)


@pytest.mark.gpu
def test_lean_scan_gpu_27b_heads_128_step_chunks():
    assert on_gpu()
    args = _args(np.random.default_rng(), 1, 1000, 16, 48, 128, 128, jnp.bfloat16, True)
    for got, want in zip(gdn_chunk(*args, chunk_size=128), gdn_chunk_ref(*args)):
        assert_close(got, want, jnp.bfloat16)


def test_model_prefill_pallas_equals_xla():
    """A ragged 40-token prefill through the model both ways: same logits and GDN states (the
    chunked GDN layers take `select_rule`'s choice for the pallas plan)."""
    import engine.model.model as M
    from engine.model.config import TEST_SMALL
    from engine.model.params import random_flat_params, stack_params

    cfg, b, t = TEST_SMALL, 2, 40
    params = stack_params(random_flat_params(cfg, seed=5), cfg)
    tokens = jnp.asarray(np.random.default_rng().integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    lengths = jnp.asarray([t, 27], jnp.int32)
    fwd = M.jit_forward()
    got = {k: fwd(params, cfg, tokens, M.init_cache(cfg, b, 64), lengths=lengths, plan=plan)
           for k, plan in (("xla", REFERENCE), ("pallas", PALLAS))}
    assert_close(got["pallas"][0], got["xla"][0], jnp.float32)
    assert_close(got["pallas"][2].rec, got["xla"][2].rec, jnp.float32)


def test_bf16_model_hands_the_kernel_bf16_operands(monkeypatch):
    """A bf16 model's GDN mixer gives the chunked kernel bf16 q, k, v (tensor-core dots); an
    fp32 model keeps fp32 operands (IEEE dots, the tests' precision)."""
    import engine.model.layers as layers
    from engine.model.config import TEST_SMALL as cfg
    from engine.model.params import random_flat_params

    seen = []
    real = select_rule

    def spy(mode, plan, t):
        rule = real(mode, plan, t)
        if not getattr(rule, "bf16_operands", False):
            return rule

        def wrapped(q, k, v, *rest):
            seen.append((q.dtype, k.dtype, v.dtype))
            return rule(q, k, v, *rest)
        wrapped.bf16_operands = True
        return wrapped
    monkeypatch.setattr(layers, "select_rule", spy)
    flat = random_flat_params(cfg)
    pre = "layers.0.linear_attn."
    conv_dim = 2 * cfg.key_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    b, t = 1, 20
    for dtype in (jnp.bfloat16, jnp.float32):
        p = {k[len(pre):]: jnp.asarray(v, dtype) for k, v in flat.items() if k.startswith(pre)}
        x = jnp.asarray(np.random.default_rng(0).standard_normal((b, t, cfg.hidden_size)), dtype)
        conv = jnp.zeros((b, conv_dim, cfg.linear_conv_kernel - 1), dtype)
        rec = jnp.zeros((b, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim), jnp.float32)
        out, _, state = layers.gdn_mixer(p, cfg, x, conv, rec, jnp.array([t], jnp.int32),
                                         jnp.ones((b, t), bool), "chunk", PALLAS)
        assert out.shape == (b, t, cfg.hidden_size) and bool(jnp.isfinite(state).all())
        assert seen[-1] == (jnp.dtype(dtype),) * 3
