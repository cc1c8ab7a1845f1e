"""Jitted copies between the live cache's GDN state and the state pool's device slots.

Row and slot indices are traced int32 scalars, so each function compiles once per shape, not
once per index. Indices are not bounds-checked on the device (dynamic indexing clamps): callers
check them on the host. Destinations are donated so XLA updates them in place.

Shapes (C = conv_dim, K = conv kernel, G = GDN layers per block, nb = num_blocks):
  cache conv  [nb, G, B, C, K-1]        cache rec  [nb, G, B, Hv, Dk, Dv] fp32
  slots conv  [S, nb, G, C, K-1]        slots rec  [S, nb, G, Hv, Dk, Dv] fp32
  row conv    [nb, G, C, K-1]           row rec    [nb, G, Hv, Dk, Dv]    fp32
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_BATCH_AXIS = 2  # of the cache's conv and rec arrays


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bits(x):
    # Copies run on the raw bits: XLA:CPU computes bf16 ops in f32, which canonicalises NaN
    # payloads, and an image must come back bit for bit whatever it holds.
    return lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])


def _unbits(u, dtype):
    return lax.bitcast_convert_type(u, dtype)


def _index(x, i, axis):
    return _unbits(lax.dynamic_index_in_dim(_bits(x), i, axis, keepdims=False), x.dtype)


def _update(x, row, i, axis):
    if row.dtype != x.dtype:  # no silent casts: an image is copied, never converted
        raise TypeError(f"writing {row.dtype} into {x.dtype}")
    return _unbits(lax.dynamic_update_index_in_dim(_bits(x), _bits(row), i, axis), x.dtype)


def _read(slots_conv, slots_rec, slot):
    return _index(slots_conv, slot, 0), _index(slots_rec, slot, 0)


def _write_row(cache_conv, cache_rec, batch_row, conv_row, rec_row):
    return (_update(cache_conv, conv_row, batch_row, _BATCH_AXIS),
            _update(cache_rec, rec_row, batch_row, _BATCH_AXIS))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def snapshot_to_slot(slots_conv, slots_rec, cache_conv, cache_rec, batch_row, slot):
    """Copy batch row `batch_row` of the cache into slot `slot`; returns the new slot arrays."""
    conv = _index(cache_conv, batch_row, _BATCH_AXIS)
    rec = _index(cache_rec, batch_row, _BATCH_AXIS)
    return _update(slots_conv, conv, slot, 0), _update(slots_rec, rec, slot, 0)


@jax.jit
def read_slot(slots_conv, slots_rec, slot):
    """The image in slot `slot`: (conv row, rec row)."""
    return _read(slots_conv, slots_rec, slot)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_slot(slots_conv, slots_rec, conv_row, rec_row, slot):
    """Put one image (e.g. fetched from the host) into slot `slot`; returns the new slot arrays."""
    return _update(slots_conv, conv_row, slot, 0), _update(slots_rec, rec_row, slot, 0)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_row(cache_conv, cache_rec, batch_row, conv_row, rec_row):
    """Write one image into batch row `batch_row` of the cache; returns the new cache arrays."""
    return _write_row(cache_conv, cache_rec, batch_row, conv_row, rec_row)


@functools.partial(jax.jit, donate_argnums=(2, 3))
def restore_to_row(slots_conv, slots_rec, cache_conv, cache_rec, slot, batch_row):
    """Copy slot `slot` straight into batch row `batch_row` (no intermediate row arrays)."""
    conv, rec = _read(slots_conv, slots_rec, slot)
    return _write_row(cache_conv, cache_rec, batch_row, conv, rec)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def zero_row(cache_conv, cache_rec, batch_row):
    """Clear batch row `batch_row` of the cache (a fresh sequence); returns the new arrays."""
    conv = jnp.zeros(cache_conv.shape[:2] + cache_conv.shape[3:], cache_conv.dtype)
    rec = jnp.zeros(cache_rec.shape[:2] + cache_rec.shape[3:], cache_rec.dtype)
    return _write_row(cache_conv, cache_rec, batch_row, conv, rec)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def set_position(pos, mtp_pos, batch_row, value):
    """Row `batch_row`'s position (and its MTP position) set to `value`; [B] int32 each."""
    return pos.at[batch_row].set(value), mtp_pos.at[batch_row].set(value)


@functools.partial(jax.jit, donate_argnums=(0,))
def clear_hidden(mtp_hidden, batch_row):
    """Row `batch_row` of the MTP drafter's pending hidden states [B, H] set to zero."""
    return mtp_hidden.at[batch_row].set(0)
