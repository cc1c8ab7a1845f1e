"""RMSNorm variants of Qwen3.5, computed in fp32 and cast back to the input dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def rms_norm(x, w, eps: float):
    """Zero-centred RMSNorm: x_hat * (1 + w). x: [..., D]; w: [D] (stored around 0, so an
    all-zero weight is the identity scale). Used for the layer norms, q/k norms and final norm."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x, z, w, eps: float):
    """GDN output norm: x_hat * w * silu(z) (plain weight, NOT 1 + w; HF Qwen3_5RMSNormGated).
    x, z: [..., D]; w: [D]. Returns x.dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
