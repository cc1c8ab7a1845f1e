"""Gated DeltaNet reference math in plain jnp: the gated delta rule (chunked and step-by-step),
the depthwise causal conv that feeds it, and `gdn_core`, a GDN layer's whole step between its
projections (given the rule to run; the model's `select_rule` picks it by the plan). cfg is a
`ModelConfig` (engine/model/config.py), read for its fields only.

Everything here is fp32 and written for clarity; GPU kernels are checked against these functions.
Recurrence (per value head, state S: [K, V]):

    S <- exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T (scale q_t)

A step with g = 0 and beta = 0 leaves S unchanged: that is how padding and ragged rows are masked.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

from engine.ops.norms import gated_rms_norm

if TYPE_CHECKING:
    from engine.model.config import ModelConfig

# The reference must not silently drop to TF32/bf16 passes on GPU.
_HI = lax.Precision.HIGHEST


def _expand_heads(q, k, v, g, beta, initial_state):
    """Repeat key heads onto value heads and move to fp32, heads-major layout.

    Key head j serves value heads [j*r, (j+1)*r) with r = Hv // Hk (HF uses repeat_interleave,
    not tile). Returns q, k: [B, Hv, T, K]; v: [B, Hv, T, V]; g, beta: [B, Hv, T]; state fp32.
    """
    hk, hv = q.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads {hv} not a multiple of key heads {hk}")
    if hv != hk:
        q = jnp.repeat(q, hv // hk, axis=2)
        k = jnp.repeat(k, hv // hk, axis=2)
    f32 = jnp.float32
    q, k, v = (x.astype(f32).transpose(0, 2, 1, 3) for x in (q, k, v))
    g, beta = (x.astype(f32).transpose(0, 2, 1) for x in (g, beta))
    if initial_state is None:
        initial_state = jnp.zeros((v.shape[0], hv, k.shape[-1], v.shape[-1]), f32)
    return q, k, v, g, beta, initial_state.astype(f32)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64,
                               scale: float | None = None):
    """Step-by-step gated delta rule (lax.scan over time): the decode path and the oracle.

    q, k: [B, T, Hk, K]; v: [B, T, Hv, V]; g (log decay, <= 0), beta: [B, T, Hv];
    initial_state: [B, Hv, K, V] or None (zeros). `chunk_size` is ignored (same signature as the
    chunked form). q is multiplied by `scale` (default K ** -0.5); q/k L2 normalisation is the
    caller's job. Returns (out [B, T, Hv, V] fp32, final_state [B, Hv, K, V] fp32).
    """
    del chunk_size
    q, k, v, g, beta, state = _expand_heads(q, k, v, g, beta, initial_state)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)

    def step(s, xs):  # s: [B, Hv, K, V]
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[..., None, None]
        pred = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=_HI)
        delta = (v_t - pred) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=_HI)

    time_major = [jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta)]
    state, out = lax.scan(step, state, time_major)  # out: [T, B, Hv, V]
    return out.transpose(1, 0, 2, 3), state


_BLOCK = 16  # diagonal blocks inverted by substitution in _unit_lower_inverse


def _diag_blocks(m, s: int):
    """The diagonal s x s blocks of m [..., C, C] (C a multiple of s): [..., C/s, s, s]."""
    c = m.shape[-1]
    r = m.reshape(*m.shape[:-2], c // s, s, c // s, s)
    return jnp.moveaxis(jnp.diagonal(r, axis1=-4, axis2=-2), -1, -3)


def diag_block_inverse(d):
    """The inverses of unit-lower-triangular blocks d [..., s, s] (only their strict lower
    parts are read), by forward substitution: s steps, each over all blocks at once. The
    reference of engine/kernels/gdn_inverse.py."""
    s = d.shape[-1]
    strict = jnp.tril(d, -1)

    def row(i, x):
        acc = jnp.einsum("...j,...jv->...v", strict[..., i, :], x, precision=_HI)
        return x.at[..., i, :].set(jnp.where(jnp.arange(s) == i, 1.0, 0.0) - acc)

    return lax.fori_loop(0, s, row, jnp.zeros_like(d))


def _unit_lower_inverse(m, diag_inverse=None):
    """The inverse of the unit-lower-triangular m [..., C, C], in fp32.

    The diagonal 16 x 16 blocks are inverted by forward substitution, all at once (16 steps
    that each touch [..., C/16, 16, 16]); then blocks are merged pairwise with matmuls,
    [[A, 0], [L, B]]^-1 = [[A^-1, 0], [-B^-1 L A^-1, B^-1]], until one block is left. A
    substitution over the whole C rows instead costs C steps that each read the whole
    right-hand side: on the H200 that loop alone was a quarter of a 27B prefill (3072 steps,
    305 ms of 1.29 s for 8K tokens). The usual recursive
    triangular inversion: exact in exact arithmetic; in fp32 checked against numpy's float64
    inverse on the chunk's own kind of matrix (tests/test_gdn.py). diag_inverse: what inverts
    the diagonal blocks (default `diag_block_inverse`; the Pallas kernel of
    engine/kernels/gdn_inverse.py does it in one launch)."""
    c = m.shape[-1]
    s = min(c, _BLOCK)
    while s < c and (c % s or (c // s) & (c // s - 1)):  # merged pairwise: C/s a power of 2
        s *= 2
    s = min(s, c)
    inv = (diag_inverse or diag_block_inverse)(_diag_blocks(m, s))  # [..., C/s, s, s]
    while s < c:
        a, bb = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        low = _diag_blocks(m, 2 * s)[..., s:, :s]
        low = -jnp.einsum("...ij,...jk,...kl->...il", bb, low, a, precision=_HI)
        zero = jnp.zeros_like(a)
        inv = jnp.concatenate([jnp.concatenate([a, zero], -1),
                               jnp.concatenate([low, bb], -1)], -2)
        s *= 2
    return inv[..., 0, :, :]


def _check_ops(ops: str) -> None:
    if ops not in ("fp32", "bf16"):
        raise ValueError(f"ops must be 'fp32' or 'bf16', got {ops!r}")


def _product(spec, a, b, ops: str):
    """einsum(spec, a, b) in fp32 (ops="fp32"), or with bf16 operands and fp32 sums as tensor
    cores take them (ops="bf16")."""
    if ops == "bf16":
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)
    return jnp.einsum(spec, a, b, precision=_HI)


def _uw(k, v, g, beta, ops: str = "fp32", diag_inverse=None):
    """The UT transform of every chunk: inputs [..., C, ...] (a chunk on axis -2 of k and v,
    -1 of g and beta). k's leading dims may be 1 where v's are not (a key head's k shared by
    its value heads): K K^T is then taken once a key head. Returns u, w, gamma (the log decay
    from the chunk start, inclusive) and the causal decay exp(gamma_i - gamma_j) [..., C, C].
    ops="bf16": the large products (K K^T and M^-1 times the right-hand sides) take bf16
    operands with fp32 sums, as tensor cores do; beta, the decays, M and its inverse stay fp32.
    diag_inverse: as for `_unit_lower_inverse`."""
    c = k.shape[-2]
    gamma = jnp.cumsum(g, axis=-1)  # log decay from the chunk start to each step, inclusive
    causal = jnp.tril(jnp.ones((c, c), bool))
    # exp(gamma_i - gamma_j) for j <= i; masked before exp because the upper half would overflow.
    decay = jnp.exp(jnp.where(causal, gamma[..., :, None] - gamma[..., None, :], -jnp.inf))
    # M = I + strict_lower(diag(beta) (K K^T o decay)); solving it folds the C sequential delta
    # updates of a chunk into matmuls: u = M^-1 diag(beta) V, w = M^-1 diag(beta e^gamma) K.
    kk = beta[..., :, None] * _product("...ik,...jk->...ij", k, k, ops) * decay
    m = jnp.tril(kk, -1) + jnp.eye(c, dtype=kk.dtype)
    inv = _unit_lower_inverse(m, diag_inverse)
    # two products, not one over [V | K] side by side: its slices were copies (profiled)
    u = _product("...ij,...jv->...iv", inv, v * beta[..., None], ops)
    w = _product("...ij,...jk->...ik", inv, k * (beta * jnp.exp(gamma))[..., None], ops)
    return u, w, gamma, decay


def _head_chunks(x, hk: int, chunk_size: int):
    """[B, T, H, ...] -> [B, Hk, H / Hk, N, C, ...] fp32: value head h = j * r + i (HF's
    repeat_interleave order) at key head j, group member i; key heads (H = Hk) get a group
    axis of 1, which broadcasts against their value heads'."""
    b, t, h = x.shape[:3]
    x = jnp.moveaxis(x.astype(jnp.float32), 2, 1)
    return x.reshape(b, hk, h // hk, t // chunk_size, chunk_size, *x.shape[3:])


def _value_heads(x, hv: int):
    """[B, Hk, r, N, C, D] (broadcast where r = 1) -> [B, Hv, T, D]."""
    b, t = x.shape[0], x.shape[3] * x.shape[4]
    return jnp.broadcast_to(x, (b, x.shape[1], hv // x.shape[1], *x.shape[3:])).reshape(
        b, hv, t, x.shape[-1])


def chunk_intra(q, k, v, g, beta, chunk_size: int, scale: float, ops: str = "fp32",
                diag_inverse=None):
    """`_intra_chunk` for a kernel whose sequential pass then only multiplies by the state
    (engine/kernels/gdn_prefill.py). q, k: [B, T, Hk, K]; v: [B, T, Hv, V]; g, beta:
    [B, T, Hv]; T a multiple of chunk_size. ops: "fp32" or "bf16" (`_product`), diag_inverse:
    as for `_uw`. The products of q and k alone (q k^T, K K^T) are taken once a key head, not
    once a value head.
    Returns u [B, Hv, T, V], w, q_in (scaled q decayed from its chunk's start), k_out (k
    decayed to its chunk's end) [B, Hv, T, K], qk (the causal decayed scaled q k^T of each
    chunk, row by row) [B, Hv, T, C], all fp32, and the chunks' decays [B, Hv, N] fp32."""
    _check_ops(ops)
    hk, hv = k.shape[2], v.shape[2]
    q, k, v, g, beta = (_head_chunks(x, hk, chunk_size) for x in (q, k, v, g, beta))
    u, w, q_in, qk, k_out, end = _intra_chunk(q * scale, k, v, g, beta, ops, diag_inverse)
    end = end[..., 0]  # [B, Hk, r, N]
    return (*(_value_heads(x, hv) for x in (u, w, q_in, k_out, qk)),
            end.reshape(end.shape[0], hv, end.shape[-1]))


def _intra_chunk(q, k, v, g, beta, ops: str = "fp32", diag_inverse=None):
    """Everything that does not depend on the carried state, for all chunks at once.

    Inputs [..., N, C, ...]; q and k may have 1 where v, g and beta have a key head's value
    heads (`_uw`). Returns u (the UT-transformed values), w (the decayed keys), q decayed from
    the chunk start, the causal decayed q k^T, k decayed to the chunk end, and the chunk's
    decay [..., N, 1]. ops: the products' precision (`_product`); diag_inverse as for `_uw`.
    """
    u, w, gamma, decay = _uw(k, v, g, beta, ops, diag_inverse)
    qk = _product("...ik,...jk->...ij", q, k, ops) * decay
    g_end = gamma[..., -1:]
    q_in = q * jnp.exp(gamma)[..., None]            # q decayed from the chunk start
    k_out = k * jnp.exp(g_end - gamma)[..., None]   # k decayed to the chunk end
    return u, w, q_in, qk, k_out, jnp.exp(g_end)


def _chunk_step(s, xs):
    """Carry the state through one chunk. s: [B, H, K, V]; returns (new s, out [B, H, C, V])."""
    u, wq, qk, k_out, end_decay = xs
    c = u.shape[-2]
    both = jnp.einsum("bhck,bhkv->bhcv", wq, s, precision=_HI)  # [w; q_in] @ s
    v_new = u - both[..., :c, :]  # corrections actually written
    out = both[..., c:, :] + jnp.einsum("bhij,bhjv->bhiv", qk, v_new, precision=_HI)
    s = s * end_decay + jnp.einsum("bhck,bhcv->bhkv", k_out, v_new, precision=_HI)
    return s, out


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64,
                           scale: float | None = None):
    """Chunked (WY/UT) gated delta rule; same contract as `recurrent_gated_delta_rule`.

    T is padded up to a multiple of the chunk with g = 0, beta = 0 (identity steps), so the final
    state is exact. When T < chunk_size the chunk shrinks to T: the math holds for any chunk
    length and a decode step then costs no padding. Intra-chunk work is batched over all chunks
    (O(T * C) memory per head); only the state pass is sequential.
    """
    q, k, v, g, beta, state = _expand_heads(q, k, v, g, beta, initial_state)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    b, h, t = v.shape[:3]
    c = max(1, min(chunk_size, t))
    pad = (-t) % c
    if pad:
        pad4 = ((0, 0), (0, 0), (0, pad), (0, 0))
        q, k, v = (jnp.pad(x, pad4) for x in (q, k, v))
        g, beta = (jnp.pad(x, pad4[:3]) for x in (g, beta))
    n = (t + pad) // c
    u, w, q_in, qk, k_out, end = _intra_chunk(
        *(x.reshape(b, h, n, c, *x.shape[3:]) for x in (q, k, v, g, beta)))
    # w and q_in both multiply the carried state: stacked, one dot per scan step serves both
    parts = (u, jnp.concatenate([w, q_in], axis=-2), qk, k_out, end[..., None])
    state, out = lax.scan(_chunk_step, state, [jnp.moveaxis(x, 2, 0) for x in parts])
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, -1)[:, :, :t]
    return out.transpose(0, 2, 1, 3), state


def causal_conv1d(x, weight, state, lengths=None):
    """Depthwise causal conv over time with a carried state (no bias, no activation).

    x: [B, T, C]; weight: [C, W] (HF conv1d weight [C, 1, W] squeezed); state: [B, C, W-1], the
    last W-1 inputs before x (zeros at sequence start). lengths: [B] int32 or None, the number of
    valid steps of each row; the new state is the W-1 inputs ending at each row's last valid step,
    so padded steps never enter it. Computed in fp32.
    Returns (y [B, T, C] fp32, new_state [B, C, W-1] in state.dtype).

    The taps read x shifted in with zeros, and the state's part of the first W-1 outputs comes
    from the small [state; 0] window: no [state; x] array of T + W - 1 rows is built. Built as
    one array it was a separate fp32 copy that a 27B prefill wrote channel-major (19 ms of an
    8K prefill); this way every term is element-wise in x and
    fuses into the conv's consumers.
    """
    b, t, c = x.shape
    w = weight.shape[-1]
    xf, wf = x.astype(jnp.float32), weight.astype(jnp.float32)
    sf = state.astype(jnp.float32).transpose(0, 2, 1)  # [B, W-1, C]
    y = sum(jnp.pad(xf, ((0, 0), (w - 1 - i, 0), (0, 0)))[:, :t] * wf[:, i] for i in range(w))
    # output row r < W-1 also sums state rows r + i (i < W-1-r): taps over [state; zeros]
    win = jnp.concatenate([sf, jnp.zeros_like(sf)], axis=1)  # [B, 2(W-1), C]
    head = sum(win[:, i:i + w - 1] * wf[:, i] for i in range(w))[:, :min(t, w - 1)]
    y = y + jnp.pad(head, ((0, 0), (0, t - head.shape[1]), (0, 0)))
    ends = jnp.full((b,), t, jnp.int32) if lengths is None else lengths
    # the W-1 inputs ending at each row's last valid step: [state; x] read only there
    tail = jax.vmap(lambda s_row, x_row, n: lax.dynamic_slice_in_dim(
        jnp.concatenate([s_row, x_row], axis=0), n, w - 1, axis=0))(sf, xf, ends)
    return y, tail.transpose(0, 2, 1).astype(state.dtype)


def l2_normalize(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) over the last axis in fp32 (the FLA/HF form, eps inside)."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# The references by the name a forward's gdn_mode gives.
GDN_RULES = {"chunk": chunk_gated_delta_rule, "recurrent": recurrent_gated_delta_rule}


def gdn_core(p, cfg: ModelConfig, qkv, z, b_in, a_in, conv_state, rec_state, lengths, valid,
             rule, out_dtype):
    """The GDN mixer between its input projections and out_proj: causal conv + SiLU, q/k L2
    norms, the gates, the gated delta rule, the gated output norm. qkv [B, T, conv_dim], z
    [B, T, Hv*Dv], b_in/a_in [B, T, Hv] as the projections give them; rule: the gated delta
    rule (a reference of `GDN_RULES`, or a kernel with the same signature: the model's
    `select_rule`). Returns (out [B, T, Hv, Dv] out_dtype, conv_state, rec_state). With a
    reference rule, the reference of the fused decode kernel
    (engine/kernels/gdn_decode_fused.py)."""
    b, t, _ = qkv.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qkv, conv_state = causal_conv1d(qkv, p["conv1d"], conv_state, lengths)
    qkv = jax.nn.silu(qkv)  # fp32 from here to the output norm
    q, k, v = jnp.split(qkv, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
    q = l2_normalize(q.reshape(b, t, hk, dk))
    k = l2_normalize(k.reshape(b, t, hk, dk))
    v = v.reshape(b, t, hv, dv)
    beta = jax.nn.sigmoid(b_in.astype(jnp.float32))
    a = a_in.astype(jnp.float32)
    # A_log is float even in bf16 checkpoints: exp of a bf16 A_log loses the decay's precision.
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a + p["dt_bias"].astype(jnp.float32))
    g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
    if out_dtype == jnp.bfloat16 and getattr(rule, "bf16_operands", False):
        # The Pallas chunked kernel's dots take bf16 operands with fp32 sums (as FLA's chunked
        # kernels do): fp32 operands make Triton emulate IEEE fp32 dots without tensor cores.
        q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
    out, rec_state = rule(q, k, v, g, beta, rec_state)
    z = z.reshape(b, t, hv, dv)
    out = gated_rms_norm(out, z, p["norm"], cfg.rms_norm_eps).astype(out_dtype)
    return out, conv_state, rec_state
