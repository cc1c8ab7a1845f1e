"""Attention's references: RoPE (HF's inverse frequencies, rotate-half on the first rotary_dim
dims) and `attend`, the layout-free softmax core that every KV layout's reference and the
attention kernels (engine/kernels/flash_prefill.py, paged_decode.py, paged_prefill.py) are
checked against. cfg is a `ModelConfig` (engine/model/config.py), read for its fields only."""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

if TYPE_CHECKING:
    from engine.model.config import ModelConfig

_HI = lax.Precision.HIGHEST


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE's inverse frequencies [rotary_dim / 2] fp32, the way HF computes them."""
    d = cfg.rotary_dim
    return (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32)
                                                  / np.float32(d)))).astype(np.float32)


def rope_tables(cfg: ModelConfig, positions):
    """cos, sin: [B, T, rotary_dim] fp32 for integer positions [B, T].

    Qwen3.5 declares multimodal RoPE sections, but for text all three position streams are equal,
    which makes it plain 1-D RoPE. inv_freq in fp32 the same way HF computes it.
    """
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(cfg), jnp.float32)
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE on the first rotary_dim dims of x [B, T, heads, head_dim]; the rest pass."""
    d = cos.shape[-1]
    xf = x.astype(jnp.float32)
    rot, rest = xf[..., :d], xf[..., d:]
    half = d // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    rot = rot * cos[:, :, None] + rotated * sin[:, :, None]
    return jnp.concatenate([rot, rest], axis=-1).astype(x.dtype)


def attend(q, keys, vals, visible):
    """Softmax attention of q over gathered keys/values, in fp32, whatever the storage layout.

    q: [B, T, heads, head_dim]; keys, vals: [B, S, kv_heads, head_dim] fp32; visible: [B, T, S]
    bool (which slots query t of row b may see). Returns [B, T, heads, head_dim] in q.dtype.
    """
    b, t, nh, hd = q.shape
    kvh = keys.shape[2]
    # GQA: query head h reads kv head h // (nh // kvh) (HF repeat_kv order).
    qg = q.astype(jnp.float32).reshape(b, t, kvh, nh // kvh, hd)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, keys, precision=_HI) * hd ** -0.5
    # A finite floor, not -inf: a query whose own slot was dropped (past S) sees nothing and must
    # yield garbage rather than NaN that would poison the rest of the batch row.
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, vals, precision=_HI)
    return out.reshape(b, t, nh, hd).astype(q.dtype)
