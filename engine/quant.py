"""Weight formats and the one matmul entry point the model uses.

`linear(x, w)` computes x @ w.T for a weight in HF orientation [out, in], whatever its storage
format. Dense weights are plain arrays; quantized ones are `QTensor` pytrees (added by the
weight-format work).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w) -> jax.Array:
    """x: [..., in] -> [..., out], with w: [out, in]."""
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype))
