"""The per-batch model state: attention KV, GDN conv and recurrent states, positions.

One contiguous buffer per kind, indexed [block, ...] so the forward's scan over blocks updates it
in place (the cache is donated to the jitted step). Each batch row is an independent sequence at
its own position; KV slots at or past a row's `pos` are stale and never read, so rolling a row back
is just lowering its `pos` (GDN states cannot be rolled back that way: snapshot them instead).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from engine.config import ModelConfig


class Cache(NamedTuple):
    k: jax.Array         # [num_blocks, B, max_len, kv_heads, head_dim]            dtype
    v: jax.Array         # [num_blocks, B, max_len, kv_heads, head_dim]            dtype
    conv: jax.Array      # [num_blocks, gdn_per_block, B, conv_dim, conv_kernel-1] dtype
    rec: jax.Array       # [num_blocks, gdn_per_block, B, Hv, Dk, Dv]              fp32
    pos: jax.Array       # [B] int32: tokens already processed per row
    mtp_k: jax.Array     # [mtp_layers, B, max_len, kv_heads, head_dim]            dtype
    mtp_v: jax.Array     # [mtp_layers, B, max_len, kv_heads, head_dim]            dtype
    mtp_pos: jax.Array   # [B] int32: entries already processed by the MTP layer per row


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> Cache:
    """An empty cache for `batch` rows of up to `max_len` tokens. `dtype` is the KV and conv
    dtype; the recurrent state is always fp32 (it integrates over the whole sequence)."""
    nb, g = cfg.num_blocks, cfg.gdn_per_block
    kv = (nb, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    mtp_kv = (cfg.mtp_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return Cache(
        k=jnp.zeros(kv, dtype), v=jnp.zeros(kv, dtype),
        conv=jnp.zeros((nb, g, batch, cfg.conv_dim, cfg.linear_conv_kernel - 1), dtype),
        rec=jnp.zeros((nb, g, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                       cfg.linear_value_head_dim), jnp.float32),
        pos=jnp.zeros((batch,), jnp.int32),
        mtp_k=jnp.zeros(mtp_kv, dtype), mtp_v=jnp.zeros(mtp_kv, dtype),
        mtp_pos=jnp.zeros((batch,), jnp.int32),
    )
