"""Gated delta rule, step by step, with the fp32 state in and out: the GDN decode kernel.

Decode touches each layer's state [B, Hv, K, V] (3 MB per row at the 27B shapes) once per token,
so this step is memory-bound: the kernel reads a [K, bv] slice of the state once, runs all T
steps in registers (T = 1 for decode; a few for a speculative verification) and writes it back
in place (the state buffer is aliased to the output). Grid: (row, value head, V / bv). Key head
j serves value heads [j*r, (j+1)*r), read straight from the key-head layout (no repeat).

`gdn_recurrent` has `gdn.recurrent_gated_delta_rule`'s signature and result.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from engine.kernels import resolve_interpret, triton_params
from engine.ops.gdn import recurrent_gated_delta_rule

gdn_recurrent_ref = recurrent_gated_delta_rule


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, so_ref, *, t_len, r, bv, scale):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // r
    cols = pl.ds(j * bv, bv)
    state = s_ref[b, h, :, cols]                                          # [K, bv] fp32

    def step(t, st):
        q = q_ref[b, t, hk, :] * scale                                    # [K]
        k = k_ref[b, t, hk, :]
        v = v_ref[b, t, h, cols]                                          # [bv]
        st = st * jnp.exp(g_ref[b, t, h])
        pred = jnp.sum(st * k[:, None], axis=0)                           # [bv]
        st = st + k[:, None] * ((v - pred) * beta_ref[b, t, h])[None, :]
        o_ref[b, t, h, cols] = jnp.sum(st * q[:, None], axis=0)
        return st

    so_ref[b, h, :, cols] = lax.fori_loop(0, t_len, step, state)


@functools.partial(jax.jit, static_argnames=("chunk_size", "scale", "interpret", "bv",
                                             "num_warps"))
def gdn_recurrent(q, k, v, g, beta, initial_state=None, chunk_size: int = 64,
                  scale: float | None = None, *, interpret: bool | None = None, bv: int = 32,
                  num_warps: int = 4):
    """q, k: [B, T, Hk, K]; v: [B, T, Hv, V]; g, beta: [B, T, Hv]; initial_state [B, Hv, K, V]
    or None. Returns (out [B, T, Hv, V] fp32, final state [B, Hv, K, V] fp32)."""
    del chunk_size
    interpret = resolve_interpret(interpret)
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    f32 = jnp.float32
    if initial_state is None:
        initial_state = jnp.zeros((b, hv, dk, dv), f32)
    bv = min(bv, dv)
    kern = functools.partial(_kernel, t_len=t, r=hv // hk, bv=bv,
                             scale=dk ** -0.5 if scale is None else scale)
    out, state = pl.pallas_call(
        kern, grid=(b, hv, dv // bv),
        out_shape=(jax.ShapeDtypeStruct((b, t, hv, dv), f32),
                   jax.ShapeDtypeStruct((b, hv, dk, dv), f32)),
        input_output_aliases={5: 1}, interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, 1),
        name="gdn_recurrent")(q.astype(f32), k.astype(f32), v.astype(f32), g.astype(f32),
                              beta.astype(f32), initial_state.astype(f32))
    return out, state
