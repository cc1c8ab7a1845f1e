"""The CUDA int4_g64 GEMM of prefill pieces (engine/kernels/cuda_ops.py `int4_gemm_multi`, XLA
FFI) against the fp32 reference of the same bf16 x (`linear` on fp32 x: exact weights). On
the GPU (-m gpu) it is built and registered as the h200 plan builds the CUDA ops; on the CPU
the tests check which shapes it takes, that it lowers to its FFI call for CUDA, that a plan's
gemm "cuda" sends a piece of up to 64 rows there (wider ones to the Pallas GEMM), and that a
plan naming it where it cannot run is refused, naming the field."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels import cuda_ops
from engine.kernels.stacked import Stacked
from engine.model.linear import linear, linear_multi
from engine.plan import H200, PlanError
from tests.kernel_checks import assert_close, cuda_module_text, on_gpu
from tests.test_kernels_cuda_gemv import _qtensor

GEMM = H200  # the h200 preset runs it (gemm "cuda")
PALLAS_PIECES = dataclasses.replace(H200, gemm="pallas")


def test_shapes_it_takes():
    w = _qtensor(48, 256, 0)
    x = jnp.ones((64, 256), jnp.bfloat16)
    assert cuda_ops.gemm_takes(x, [w])  # N = 48 (GDN's b and a) too: no tile divides N
    assert cuda_ops.gemm_takes(x[:1], [w]) and cuda_ops.gemm_takes(x[:9], [w, w, w, w])
    assert not cuda_ops.gemm_takes(jnp.ones((65, 256), jnp.bfloat16), [w])  # > 64 rows
    assert not cuda_ops.gemm_takes(x.astype(jnp.float32), [w])  # bf16 x only
    assert not cuda_ops.gemm_takes(jnp.ones((16, 192), jnp.bfloat16), [_qtensor(48, 192, 0)])
    assert not cuda_ops.gemm_takes(x, [w] * 5)
    assert not cuda_ops.gemm_takes(x, [w], lead=1)  # the weight is not a stack
    with pytest.raises(ValueError, match="int4_gemm takes"):
        cuda_ops.int4_gemm_multi(x.astype(jnp.float32), [w])


def test_k_split_fills_the_gpu_by_shape():
    """Few output tiles (down: 5120 rows, 20 tiles of 256) split K so that the GPU's 132
    multiprocessors all work; each part keeps at least 4 stages of 128 inputs; the fp32
    partials cost more at more rows of x, so a wider piece never splits more."""
    assert cuda_ops.gemm_splits(5120, 17408, 64) >= 5
    assert cuda_ops.gemm_splits(5120, 512, 9) == 1  # 4 stages in all
    for n, k in ((34816, 5120), (16480, 5120), (5120, 6144), (5120, 17408), (48, 5120)):
        got = [cuda_ops.gemm_splits(n, k, m) for m in (9, 16, 32, 64)]
        assert all(1 <= s <= k // 128 // 4 for s in got)
        assert got == sorted(got, reverse=True)


def test_lowers_to_one_ffi_call_with_partial_sums():
    w = _qtensor(1000, 5120, 0, lead=(2,))
    text = cuda_module_text(lambda x, w, i: cuda_ops.int4_gemm_multi(x, [w, w], i, concat=True),
                            jnp.ones((37, 5120), jnp.bfloat16), w, jnp.array([1], jnp.int32))
    assert text.count(f"custom_call @{cuda_ops.INT4_GEMM_TARGET}(") == 1
    splits = cuda_ops.gemm_splits(2000, 5120, 37)
    assert f"tensor<{splits}x37x2000xf32>" in text  # one fp32 partial a K part, added by XLA


PALLAS_GEMM = "jit(_int4_matmul)"  # the Pallas GEMM's trace (interpreted on this CPU)


@pytest.mark.parametrize("rows,target", [(9, cuda_ops.INT4_GEMM_TARGET),
                                         (64, cuda_ops.INT4_GEMM_TARGET),
                                         (65, PALLAS_GEMM)])
def test_plan_sends_short_pieces_to_the_cuda_gemm(rows, target):
    plan = dataclasses.replace(GEMM, int4_gemm_rows=128)
    w = _qtensor(256, 512, 1)
    x = jnp.ones((rows, 512), jnp.bfloat16)
    text = cuda_module_text(lambda x, w: linear(x, w, plan), x, w)
    assert target in text
    assert ({cuda_ops.INT4_GEMM_TARGET, PALLAS_GEMM} - {target}).pop() not in text
    # a layer's projections of one input: one launch
    text = cuda_module_text(lambda x, w: linear_multi(x, [w, w, w], plan, concat=True), x, w)
    calls = text.count(f"custom_call @{cuda_ops.INT4_GEMM_TARGET}(")
    assert calls == (1 if target == cuda_ops.INT4_GEMM_TARGET else 0)


def test_plan_refuses_what_cannot_run_naming_the_field():
    with pytest.raises(PlanError, match="gemm 'cuda' needs 102 KB"):
        dataclasses.replace(GEMM, cuda_arch="89")
    with pytest.raises(PlanError, match="gemm 'cuda' needs int4_gemm_rows"):
        dataclasses.replace(GEMM, int4_gemm_rows=0)
    with pytest.raises(PlanError, match="'gemm' must be one of"):
        dataclasses.replace(GEMM, gemm="tma")
    assert GEMM.gemm == "cuda" and GEMM.digest() != PALLAS_PIECES.digest()


def _reference(x, w):
    """x @ w in fp32 from the same bf16 x and the exact weights (code - 8) * scale: what the
    kernel's exact products and fp32 sums compute, up to the order of the sums and the
    output's rounding to bf16."""
    with jax.default_matmul_precision("highest"):
        return linear(x.astype(jnp.float32), w)


GPU_CASES = [  # (M, N, K): N not a multiple of 256 (a partial tile), K split or not
    (9, 37, 128), (16, 4096, 5120), (33, 1000, 17408), (64, 999, 6144), (64, 16480, 5120),
    (17, 48, 5120), (64, 256, 384), (1, 512, 1024), (40, 5120, 17408)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_CASES)
def test_matches_reference_on_gpu(m, n, k):
    assert on_gpu()
    cuda_ops.require(GEMM)
    w = _qtensor(n, k, m + n + k)
    x = jnp.asarray(np.random.default_rng(k + m).standard_normal((m, k)), jnp.bfloat16)
    got = jax.jit(lambda x, w: cuda_ops.int4_gemm_multi(x, [w])[0])(x, w)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    assert_close(got, _reference(x, w), jnp.bfloat16)
    again = jax.jit(lambda x, w: cuda_ops.int4_gemm_multi(x, [w])[0])(x, w)
    assert bool(jnp.all(got == again))  # deterministic: fixed sums, no atomics


@pytest.mark.gpu
@pytest.mark.parametrize("lead,index", [((3,), (2,)), ((2, 3), (1, 2))])
def test_reads_a_layer_of_a_stack_and_several_weights_on_gpu(lead, index):
    assert on_gpu()
    cuda_ops.require(GEMM)
    ws = [_qtensor(n, 1024, 7 + n, lead=lead) for n in (512, 48, 300)]
    x = jnp.asarray(np.random.default_rng(8).standard_normal((24, 1024)), jnp.bfloat16)
    idx = jnp.asarray(index, jnp.int32)
    outs = jax.jit(lambda x, i: cuda_ops.int4_gemm_multi(x, ws, i))(x, idx)
    for w, got in zip(ws, outs):
        assert_close(got, _reference(x, Stacked(w, idx).materialize()), jnp.bfloat16)


def test_a_plan_without_the_field_keeps_its_identity():
    """gemm entered the plans after they were first fingerprinted: a plan at its default keeps
    the digest it had (checkpoint fingerprints, executable keys, lane hashes); a plan that sets
    it is another plan, and both read back from their identity."""
    from engine.plan import LATE_DEFAULTS, PALLAS, from_dict
    assert "gemm" in LATE_DEFAULTS and "gemm" not in PALLAS_PIECES.to_dict()
    assert "gemm" not in PALLAS.to_dict() and "gemm" not in PALLAS.describe()
    assert GEMM.to_dict()["gemm"] == GEMM.describe()["gemm"] == "cuda"
    assert from_dict(GEMM.to_dict()) == GEMM and from_dict(PALLAS.to_dict()) == PALLAS
