"""The GDN prefill's diagonal-block inverses in one kernel.

The UT transform of each chunk (`gdn._unit_lower_inverse`) inverts the chunk's 16 x 16 diagonal
blocks by forward substitution: 16 dependent steps over all blocks of the call. XLA runs each
step as a few small kernels: ~48 a GDN layer, ~2,300 in an 8K-token prefill of the 27B, about
7 ms of its 744 ms on the H200. Here a program inverts `bn` blocks with the 16 steps in
registers, so a layer's blocks take one launch that reads and writes each block once.

Row i of a block's inverse X is e_i - L[i, :] X, where L is the block's strict lower part and
X's rows i and beyond are still zero: the same substitution as the reference, with the row's
sum over all 16 columns (zeros where j >= i), so the result agrees with the reference to fp32
rounding (the sums' order may differ).

`diag_inverse` has `gdn.diag_block_inverse`'s signature and result.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from engine.kernels import resolve_interpret, triton_params
from engine.ops.gdn import diag_block_inverse

diag_inverse_ref = diag_block_inverse


def _kernel(d_ref, o_ref, *, bn: int, s: int):
    blk = pl.ds(pl.program_id(0) * bn, bn)
    col = lax.broadcasted_iota(jnp.int32, (1, s), 1)
    row = lax.broadcasted_iota(jnp.int32, (1, s, 1), 1)
    x = jnp.zeros((bn, s, s), jnp.float32)
    for i in range(s):  # static: the steps unrolled, X in registers
        li = jnp.where(col < i, d_ref[blk, i, :].astype(jnp.float32), 0.0)     # [bn, s]
        acc = jnp.sum(li[:, :, None] * x, axis=1)                              # [bn, s]
        x = jnp.where(row == i, (jnp.where(col == i, 1.0, 0.0) - acc)[:, None, :], x)
    o_ref[blk, :, :] = x


def supported(d) -> bool:
    """Blocks whose side the kernel tiles (a power of two, 2 to 64)."""
    s = d.shape[-1]
    return d.ndim >= 2 and d.shape[-2] == s and 2 <= s <= 64 and not s & (s - 1)


@functools.partial(jax.jit, static_argnames=("interpret", "bn", "num_warps"))
def diag_inverse(d, *, interpret: bool | None = None, bn: int = 16, num_warps: int = 4):
    """d: [..., s, s] unit-lower-triangular blocks (only the strict lower parts are read).
    Returns their inverses, fp32, same shape. Sides the kernel does not tile take the
    reference."""
    if not supported(d):
        return diag_inverse_ref(d.astype(jnp.float32))
    interpret = resolve_interpret(interpret)
    s = d.shape[-1]
    flat = d.reshape(-1, s, s).astype(jnp.float32)
    n = flat.shape[0]
    bn = max(1, min(bn, 1 << max(0, n - 1).bit_length()))  # no wider than the call
    pad = (-n) % bn
    if pad:  # zero blocks: their inverse is the identity, cut off below
        flat = jnp.pad(flat, ((0, pad), (0, 0), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, bn=bn, s=s), grid=((n + pad) // bn,),
        out_shape=jax.ShapeDtypeStruct(flat.shape, jnp.float32), interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, 1),
        name="gdn_diag_inverse")(flat)
    return out[:n].reshape(d.shape)
