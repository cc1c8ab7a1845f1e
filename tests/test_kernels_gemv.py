"""Weight-only GEMV kernel (engine/kernels/qgemv.py) against the model's `linear`
(engine/model/linear.py), in the Pallas interpreter on CPU, lowered to Triton for CUDA, and
compiled on the GPU (-m gpu)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels import qgemv
from engine.model.linear import linear
from engine.ops import quant
from engine.plan import PALLAS
from tests.kernel_checks import assert_close, lowers_for_cuda, on_gpu

FMTS = ("int4_g64", "int8_row", "fp8_row", "dense")


def _weight(fmt, n, k, rng, dense_dtype=jnp.float32):
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    if fmt == "dense":
        return jnp.asarray(w, dense_dtype)
    return jax.tree.map(jnp.asarray, quant.quantize(w, fmt))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dot", [False, True])
def test_gemv_matches_linear_interpret(fmt, rows, dot):
    rng = np.random.default_rng()  # fresh inputs every run
    # K = 640 (10 groups) and N = 96 make the planner split K and pick bn < the default.
    w = _weight(fmt, 96, 640, rng)
    x = jnp.asarray(rng.standard_normal((rows, 1, 640)), jnp.float32)
    cfg = qgemv.GemvConfig(bn=32, bk=128, programs=12, dot=dot)
    got = qgemv.qmatmul(x, w, interpret=True, config=cfg)
    assert got.shape == (rows, 1, 96) and got.dtype == jnp.float32
    assert_close(got, linear(x, w), jnp.float32)


@pytest.mark.parametrize("fmt", ["int4_g64", "dense"])
def test_gemv_bf16_activations(fmt):
    rng = np.random.default_rng()
    w = _weight(fmt, 64, 256, rng, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.bfloat16)
    got = qgemv.qmatmul(x, w, interpret=True)
    assert got.dtype == jnp.bfloat16
    want = linear(x.astype(jnp.float32), jax.tree.map(
        lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, w))
    assert_close(got, want, jnp.bfloat16)


def test_linear_pallas_option_and_fallback():
    rng = np.random.default_rng()
    w = _weight("int4_g64", 32, 128, rng)
    x1 = jnp.asarray(rng.standard_normal((1, 1, 128)), jnp.float32)
    assert_close(linear(x1, w, PALLAS), linear(x1, w), jnp.float32)
    # Prefill-sized x is not GEMV work: the reference path, bit for bit.
    xt = jnp.asarray(rng.standard_normal((1, 16, 128)), jnp.float32)
    assert not qgemv.supported(xt, w)
    np.testing.assert_array_equal(linear(xt, w, PALLAS), linear(xt, w))


@pytest.mark.parametrize("fmt", ["int4_g64", "dense"])
def test_gemv_reads_a_layer_of_a_stack_in_place(fmt):
    rng = np.random.default_rng()
    layers = [_weight(fmt, 48, 256, rng) for _ in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    x = jnp.asarray(rng.standard_normal((1, 256)), jnp.float32)
    for i in (0, 2):
        got = qgemv.qmatmul(x, stack, jnp.asarray([i], jnp.int32), interpret=True)
        assert_close(got, linear(x, layers[i]), jnp.float32)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dot", [False, True])
def test_gemv_lowers_to_triton(fmt, dot):
    rng = np.random.default_rng(0)
    w = _weight(fmt, 256, 5120, rng, jnp.bfloat16)
    x = jnp.zeros((2, 5120), jnp.bfloat16)
    cfg = qgemv.GemvConfig(dot=dot)
    lowers_for_cuda(lambda x, w: qgemv.qmatmul(x, w, interpret=False, config=cfg), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k", [(5120, 17408), (10240, 5120), (48, 5120)])
def test_gemv_gpu_27b_shapes(fmt, n, k):
    assert on_gpu()
    rng = np.random.default_rng()
    w = _weight(fmt, n, k, rng, jnp.bfloat16)
    for rows, dot in ((1, False), (2, False), (1, True), (2, True)):
        x = jnp.asarray(rng.standard_normal((rows, 1, k)), jnp.bfloat16)
        got = qgemv.qmatmul(x, w, config=qgemv.GemvConfig(dot=dot))
        w32 = w.astype(jnp.float32) if fmt == "dense" else quant.dequantize(w)
        want = jnp.einsum("...i,oi->...o", x.astype(jnp.float32), w32,
                          precision=jax.lax.Precision.HIGHEST)
        assert_close(got, want, jnp.bfloat16)
