"""The int4_g64 GEMM for prefill pieces (engine/kernels/qgemm.py) against the model's `linear`
(engine/model/linear.py), in the Pallas interpreter on CPU, lowered to Triton for CUDA, and
compiled on the GPU (-m gpu)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels import qgemm
from engine.model.linear import linear
from engine.ops import quant
from engine.plan import PALLAS
from tests.kernel_checks import assert_close, lowers_for_cuda, on_gpu


def _weight(n, k, rng, lead=()):
    w = (rng.standard_normal((*lead, n, k)) / np.sqrt(k)).astype(np.float32)
    if lead:
        qs = [quant.quantize(w[i], "int4_g64") for i in range(lead[0])]
        return jax.tree.map(lambda *a: jnp.stack([jnp.asarray(v) for v in a]), *qs), qs
    return jax.tree.map(jnp.asarray, quant.quantize(w, "int4_g64")), None


def _f32(w):
    return jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, w)


@pytest.mark.parametrize("m", [9, 40, 64, 100])
def test_gemm_matches_linear_interpret(m):
    rng = np.random.default_rng()  # fresh inputs every run
    # K = 512 (8 groups, 4 loop steps of 2) and N = 96 (three 32-wide tiles); programs=6
    # splits K; m = 100 pads the second 64-row tile, 9 and 40 run one narrower tile.
    w, _ = _weight(96, 512, rng)
    x = jnp.asarray(rng.standard_normal((1, m, 512)), jnp.float32)
    cfg = qgemm.GemmConfig(bm=64, bn=32, gb=2, programs=6)
    bm, bn, gb, split, iters = qgemm.plan(m, 96, 512, cfg)
    assert bn == 32 and gb == 2 and split * iters == 4 and (split > 1) == (m <= 64)
    got = qgemm.int4_matmul(x, w, interpret=True, config=cfg)
    assert got.shape == (1, m, 96) and got.dtype == jnp.float32
    assert_close(got, linear(x, w), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gemm_16_bit_activations(dtype):
    rng = np.random.default_rng()
    w, _ = _weight(64, 256, rng)
    x = jnp.asarray(rng.standard_normal((2, 24, 256)), dtype)
    got = qgemm.int4_matmul(x, w, interpret=True, config=qgemm.GemmConfig(bm=16, bn=32))
    assert got.dtype == dtype and got.shape == (2, 24, 64)
    assert_close(got, linear(x.astype(jnp.float32), _f32(w)), dtype)


def test_gemm_reads_a_layer_of_a_stack_in_place():
    rng = np.random.default_rng()
    stack, layers = _weight(48, 256, rng, lead=(3,))
    x = jnp.asarray(rng.standard_normal((20, 256)), jnp.float32)
    cfg = qgemm.GemmConfig(bm=16, bn=16, gb=1, programs=4)
    for i in (0, 2):
        got = qgemm.int4_matmul(x, stack, jnp.asarray([i], jnp.int32), interpret=True,
                                config=cfg)
        assert_close(got, linear(x, jax.tree.map(jnp.asarray, layers[i])), jnp.float32)


def test_gemm_steps_by_the_groups_that_divide_k():
    rng = np.random.default_rng()
    w, _ = _weight(64, 192, rng)  # 3 groups: one group a loop step
    assert qgemm.plan(12, 64, 192, qgemm.DEFAULT)[2] == 1
    assert qgemm.plan(12, 64, 17408, qgemm.DEFAULT)[2] == 4  # the 27B's down_proj: 272 groups
    x = jnp.asarray(rng.standard_normal((12, 192)), jnp.float32)
    assert qgemm.takes(x, w)
    assert_close(qgemm.int4_matmul(x, w, interpret=True), linear(x, w), jnp.float32)


def test_gemm_refuses_what_it_cannot_tile():
    rng = np.random.default_rng()
    w, _ = _weight(64, 128, rng)
    few = jnp.zeros((8, 128), jnp.float32)  # decode-sized: the GEMV's
    assert not qgemm.takes(few, w)
    assert qgemm.takes(jnp.zeros((9, 128), jnp.float32), w)
    dense = jnp.zeros((64, 128), jnp.float32)
    assert not qgemm.takes(jnp.zeros((12, 128)), dense)


def test_gemm_lowers_to_triton():
    rng = np.random.default_rng(0)
    w, _ = _weight(256, 5120, rng)
    x = jnp.zeros((64, 5120), jnp.bfloat16)
    lowers_for_cuda(lambda x, w: qgemm.int4_matmul(x, w, interpret=False), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [9, 64, 200, 1024])
@pytest.mark.parametrize("nk", [(5120, 17408), (17408, 5120), (1024, 5120)])
def test_gemm_gpu_27b_shapes(m, nk):
    assert on_gpu()
    plan = dataclasses.replace(PALLAS, int4_gemm_rows=1024)
    rng = np.random.default_rng()
    n, k = nk
    w, _ = _weight(n, k, rng)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    got = qgemm.int4_matmul(x, w)
    assert_close(got, linear(x.astype(jnp.float32), _f32(w)), jnp.bfloat16)
    # the model's path: linear with a plan's int4_gemm_rows takes this kernel
    np.testing.assert_array_equal(np.asarray(linear(x, w, plan), np.float32),
                                  np.asarray(got, np.float32))


def test_gemm_leaves_non_power_of_two_columns_to_the_reference():
    rng = np.random.default_rng()
    w, _ = _weight(48, 128, rng)  # GDN's in_proj_b / in_proj_a are 48 x 5120
    x = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
    assert not qgemm.takes(x, w)
    np.testing.assert_array_equal(qgemm.int4_matmul(x, w, interpret=True), linear(x, w))
