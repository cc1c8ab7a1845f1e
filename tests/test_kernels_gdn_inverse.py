"""The diagonal-block inverse kernel of the GDN prefill (engine/kernels/gdn_inverse.py) against
its reference (`gdn.diag_block_inverse`, the substitution XLA runs) and numpy's float64
inverse: in the Pallas interpreter on CPU, lowered for CUDA, and on the GPU (-m gpu)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels.gdn_inverse import diag_inverse, diag_inverse_ref, supported
from engine.ops import gdn
from engine.ops.gdn import l2_normalize
from tests.kernel_checks import lowers_for_cuda, on_gpu, rel_err


def _blocks(rng, lead, s, correlated: bool):
    """The chunk solve's kind of block: I + strict_lower(beta k k^T) with L2-normalised keys
    (correlated: sharing a common direction, the harder case), and noise above the diagonal,
    which the inverse must not read."""
    k = rng.standard_normal((*lead, s, 32)).astype(np.float32)
    if correlated:
        k = 0.3 * k + rng.standard_normal((*lead, 1, 32)).astype(np.float32)
    k = np.asarray(l2_normalize(k))
    beta = rng.uniform(0.0, 1.0, (*lead, s, 1)).astype(np.float32)
    d = np.tril((beta * k) @ np.swapaxes(k, -1, -2), -1) + np.eye(s, dtype=np.float32)
    return d + np.triu(rng.standard_normal(d.shape).astype(np.float32), 1)


@pytest.mark.parametrize("lead,s,correlated", [((3, 4), 16, False), ((2, 5, 4), 16, True),
                                               ((37,), 16, True), ((5,), 8, False),
                                               ((1,), 32, True)])
def test_diag_inverse_matches_reference_and_float64(lead, s, correlated):
    """Any number of blocks (37 pads to whole programs), several sides; the upper triangle's
    noise is ignored; within fp32 rounding of the reference and of the float64 inverse."""
    d = _blocks(np.random.default_rng(), lead, s, correlated)
    got = np.asarray(diag_inverse(jnp.asarray(d)))
    want = np.asarray(jax.jit(diag_inverse_ref)(jnp.asarray(d)))
    exact = np.linalg.inv(np.tril(d.astype(np.float64)))
    assert got.shape == d.shape and got.dtype == np.float32
    assert np.array_equal(np.triu(got, 1), np.zeros_like(got))
    assert np.array_equal(np.diagonal(got, axis1=-2, axis2=-1), np.ones(got.shape[:-1]))
    assert rel_err(got, want) < 1e-6
    assert rel_err(got, exact) < 1e-6


def test_sides_the_kernel_does_not_tile_take_the_reference():
    assert supported(jnp.zeros((4, 16, 16))) and not supported(jnp.zeros((4, 12, 12)))
    d = jnp.asarray(_blocks(np.random.default_rng(3), (4,), 12, False))
    np.testing.assert_array_equal(diag_inverse(d), jax.jit(diag_inverse_ref)(d))


def test_unit_lower_inverse_with_the_kernel():
    """The chunk solve's whole 64 x 64 inverse, its diagonal blocks from the kernel: within
    fp32 rounding of the one built on the reference's blocks."""
    rng = np.random.default_rng(11)
    k = np.asarray(l2_normalize(rng.standard_normal((3, 2, 64, 16)).astype(np.float32)))
    beta = rng.uniform(0.0, 1.0, (3, 2, 64, 1)).astype(np.float32)
    m = jnp.asarray(np.tril((beta * k) @ np.swapaxes(k, -1, -2), -1) + np.eye(64, dtype=np.float32))
    got = jax.jit(lambda x: gdn._unit_lower_inverse(x, diag_inverse))(m)
    want = jax.jit(gdn._unit_lower_inverse)(m)
    assert rel_err(got, want) < 1e-6


def test_diag_inverse_lowers_to_triton():
    d = jnp.zeros((1, 16, 3, 128, 4, 16, 16), jnp.float32)  # an 8K prefill's blocks, 27B heads
    text = lowers_for_cuda(lambda x: diag_inverse(x, interpret=False), d)
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("correlated", [False, True])
def test_diag_inverse_gpu_27b_prefill_blocks(correlated):
    """The compiled kernel on the blocks of a 2K-token chunk at the 27B's heads."""
    assert on_gpu()
    d = _blocks(np.random.default_rng(), (1, 16, 3, 32, 4), 16, correlated)
    got = np.asarray(diag_inverse(jnp.asarray(d)))
    want = np.asarray(jax.jit(diag_inverse_ref)(jnp.asarray(d)))
    assert rel_err(got, want) < 1e-6
    assert rel_err(got, np.linalg.inv(np.tril(d.astype(np.float64)))) < 1e-6
