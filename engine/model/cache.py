"""The per-batch model state: attention KV, GDN conv and recurrent states, positions.

Two kinds, and `model.forward` dispatches on the type:
- `Cache`: contiguous per-row KV [block, B, max_len, ...] (tests, single-sequence tools).
- `PagedCache`: attention KV in a shared page pool (engine/ops/paged_kv.py) reached through per-row
  block tables; the GDN states stay per row. The MTP layer's KV is one more layer of the same
  pool, addressed through the same tables (see paged_kv's module docstring for its slot rule).

Contiguous: one buffer per kind, indexed [block, ...] so the forward's scan over blocks updates it
in place (the cache is donated to the jitted step). Each batch row is an independent sequence at
its own position; KV slots at or past a row's `pos` are stale and never read, so rolling a row back
is just lowering its `pos` (GDN states cannot be rolled back that way: snapshot them instead).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from engine.model.config import ModelConfig
from engine.ops.paged_kv import KVPool


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
    kv = (cfg.num_blocks, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    mtp_kv = (cfg.mtp_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    conv, rec = _gdn_states(cfg, batch, dtype)
    return Cache(
        k=jnp.zeros(kv, dtype), v=jnp.zeros(kv, dtype), conv=conv, rec=rec,
        pos=jnp.zeros((batch,), jnp.int32),
        mtp_k=jnp.zeros(mtp_kv, dtype), mtp_v=jnp.zeros(mtp_kv, dtype),
        mtp_pos=jnp.zeros((batch,), jnp.int32),
    )


def _gdn_states(cfg: ModelConfig, batch: int, dtype):
    """Zero conv [nb, g, B, conv_dim, W-1] (dtype) and recurrent [nb, g, B, Hv, Dk, Dv] (fp32)."""
    nb, g = cfg.num_blocks, cfg.gdn_per_block
    return (jnp.zeros((nb, g, batch, cfg.conv_dim, cfg.linear_conv_kernel - 1), dtype),
            jnp.zeros((nb, g, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                       cfg.linear_value_head_dim), jnp.float32))


class PagedCache(NamedTuple):
    pool: KVPool             # shared by all sequences; leading axis = attention layer = block
    block_table: jax.Array   # [B, max_pages] int32: page ids of each row, in token order
    conv: jax.Array          # [num_blocks, gdn_per_block, B, conv_dim, conv_kernel-1] dtype
    rec: jax.Array           # [num_blocks, gdn_per_block, B, Hv, Dk, Dv]              fp32
    pos: jax.Array           # [B] int32: tokens already processed per row
    mtp_pos: jax.Array       # [B] int32: entries already processed by the MTP layer per row
    # MTP drafting (engine/model/model.py `mtp_track`): [B, H] activation dtype, each row's last
    # hidden state, the input of its next MTP entry; None: the forward leaves the MTP layer alone
    mtp_hidden: jax.Array | None = None


def init_paged_cache(cfg: ModelConfig, pool: KVPool, block_table, dtype=jnp.float32
                     ) -> PagedCache:
    """A batch of fresh rows (pos 0, zero GDN states) over `pool`. block_table: [B, max_pages]
    int32 page ids (entries a row never reaches may be -1). `dtype` is the conv state dtype (the
    activation dtype); the KV dtype is the pool's. The caller owns the tables: before a step that
    writes slots [pos, pos + T) of a row, the row's pages for them must be in its table and
    owned by it alone (see model.paged_kv.paged_write_attend)."""
    block_table = jnp.asarray(block_table, jnp.int32)
    if block_table.ndim != 2:
        raise ValueError(f"block_table must be [batch, max_pages], got {block_table.shape}")
    batch = block_table.shape[0]
    conv, rec = _gdn_states(cfg, batch, dtype)
    # Two distinct buffers: the cache is donated, and one buffer may not be donated twice.
    return PagedCache(pool=pool, block_table=block_table, conv=conv, rec=rec,
                      pos=jnp.zeros((batch,), jnp.int32), mtp_pos=jnp.zeros((batch,), jnp.int32))
