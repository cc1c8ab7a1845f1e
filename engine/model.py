"""The Qwen3.5/3.8 hybrid forward: embed -> num_blocks x ([GDN] * (interval-1) + [attention])
-> final norm -> lm_head, plus the MTP draft head.

The blocks run as ONE lax.scan over stacked block weights, so compile time does not grow with
depth. The whole cache rides in the scan carry and each block updates its slice in place.

    fwd = jax.jit(forward, static_argnames=FORWARD_STATIC, donate_argnames=("cache",))
    logits, hidden, cache = fwd(params, cfg, tokens, cache)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from engine.cache import Cache, init_cache  # noqa: F401  (re-exported)
from engine.config import ConfigError, ModelConfig
from engine.layers import GDN_RULES, attention_layer, gdn_layer
from engine.norms import rms_norm
from engine.params import ParamError, stack_params  # noqa: F401  (re-exported)
from engine.quant import embedding_lookup, linear

FORWARD_STATIC = ("cfg", "gdn_mode", "last_only", "unroll")


def _steps(tokens, lengths):
    """lengths [B] int32 (default: all T steps valid) and valid [B, T] bool."""
    b, t = tokens.shape
    if lengths is None:
        lengths = jnp.full((b,), t, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    return lengths, jnp.arange(t, dtype=jnp.int32)[None, :] < lengths[:, None]


def _embed(params, tokens):
    """[B, T] ids -> [B, T, H] in the activation dtype, which is the final norm weight's dtype
    (the embedding table may be a quantized QTensor and then carries no compute dtype)."""
    return embedding_lookup(params["embed_tokens"], tokens, dtype=params["norm"].dtype)


def _run_blocks(blocks, cfg: ModelConfig, x, cache: Cache, positions, lengths, valid, mode,
                unroll: bool):
    """Scan the stacked blocks over x [B, T, H]; returns (x, cache with k/v/conv/rec updated).
    unroll=True unrolls both scans (same math, static weight slices, compile grows with depth)."""

    def block(carry, xs):
        x, k, v, conv, rec = carry
        p, i = xs

        def gdn(x, layer_xs):
            lp, conv_l, rec_l = layer_xs
            x, conv_l, rec_l = gdn_layer(lp, cfg, x, conv_l, rec_l, lengths, valid, mode)
            return x, (conv_l, rec_l)

        x, (conv_i, rec_i) = lax.scan(gdn, x, (p["gdn"], conv[i], rec[i]), unroll=unroll)
        conv, rec = conv.at[i].set(conv_i), rec.at[i].set(rec_i)
        x, (k, v) = attention_layer(p["attn"], cfg, x, (k, v), i, positions, valid)
        return (x, k, v, conv, rec), None

    carry = (x, cache.k, cache.v, cache.conv, cache.rec)
    xs = (blocks, jnp.arange(cfg.num_blocks, dtype=jnp.int32))
    (x, k, v, conv, rec), _ = lax.scan(block, carry, xs, unroll=unroll)
    return x, cache._replace(k=k, v=v, conv=conv, rec=rec)


def _head(params, cfg: ModelConfig, h, lengths, last_only: bool):
    """Logits fp32 [B, T, V], or [B, 1, V] at each row's last valid step when last_only."""
    if last_only:
        idx = jnp.maximum(lengths - 1, 0)[:, None, None]
        h = jnp.take_along_axis(h, idx, axis=1)
    return linear(h, params["lm_head"]).astype(jnp.float32)


def forward(params, cfg: ModelConfig, tokens, cache: Cache, *, gdn_mode: str = "chunk",
            lengths=None, last_only: bool = False, unroll: bool = False):
    """Process T new tokens per row at each row's cache position (prefill T > 1, decode T = 1).

    params: `stack_params` tree; tokens: [B, T] int32; cache: `init_cache(cfg, B, max_len)`.
    gdn_mode: "chunk" (WY/UT form) or "recurrent" (step-by-step); both give the same result.
    lengths: optional [B] int32, valid tokens per row (right padding; a row with 0 is untouched).
    last_only: return logits only at each row's last valid token ([B, 1, V]), for long prefills.
    unroll: unroll the block scan (compile time then grows with depth; see engine/bench.py).
    Returns (logits fp32 [B, T, V], hidden [B, T, H] after the final norm (the MTP input),
    new cache with pos += lengths). Tokens past max_len are silently dropped from the KV cache:
    the caller must keep pos + T <= max_len.
    """
    if gdn_mode not in GDN_RULES:
        raise ValueError(f"gdn_mode must be one of {sorted(GDN_RULES)}, got {gdn_mode!r}")
    lengths, valid = _steps(tokens, lengths)
    positions = cache.pos[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    x = _embed(params, tokens)
    x, cache = _run_blocks(params["blocks"], cfg, x, cache, positions, lengths, valid, gdn_mode,
                           unroll)
    hidden = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    logits = _head(params, cfg, hidden, lengths, last_only)
    return logits, hidden, cache._replace(pos=cache.pos + lengths)


def mtp_forward(params, cfg: ModelConfig, hidden, tokens, cache: Cache, *, lengths=None,
                last_only: bool = False):
    """Multi-token-prediction head: entry t pairs the main model's hidden h_t with token x_{t+1}
    and predicts x_{t+2}.

    hidden: [B, T, H] from `forward` (after the final norm); tokens: [B, T] int32, the tokens that
    follow those hidden states. Entries sit at positions cache.mtp_pos + t in the MTP layer's own
    KV cache. h' = fc(cat[norm_e(embed(x_{t+1})), norm_h(h_t)]) -> one attention decoder layer ->
    mtp.norm -> shared lm_head. Returns (logits fp32 [B, T, V] (or [B, 1, V] with last_only),
    mtp hidden [B, T, H] after mtp.norm (input for a further draft step), new cache with
    mtp_pos += lengths).
    """
    if not cfg.mtp_layers or "mtp" not in params:
        raise ConfigError(f"model config {cfg.name!r} has no MTP layer")
    m, eps = params["mtp"], cfg.rms_norm_eps
    lengths, valid = _steps(tokens, lengths)
    positions = cache.mtp_pos[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    e = rms_norm(_embed(params, tokens), m["pre_fc_norm_embedding"], eps)
    h = rms_norm(hidden.astype(e.dtype), m["pre_fc_norm_hidden"], eps)
    x = linear(jnp.concatenate([e, h], axis=-1), m["fc"])
    x, (k, v) = attention_layer(m["layer"], cfg, x, (cache.mtp_k, cache.mtp_v), 0, positions,
                                valid)
    h = rms_norm(x, m["norm"], eps)
    logits = _head(params, cfg, h, lengths, last_only)
    return logits, h, cache._replace(mtp_k=k, mtp_v=v, mtp_pos=cache.mtp_pos + lengths)


def jit_forward():
    """forward, jitted with cfg/gdn_mode/last_only static and the cache donated."""
    return jax.jit(forward, static_argnames=FORWARD_STATIC, donate_argnames=("cache",))


def jit_mtp_forward():
    """mtp_forward, jitted with cfg/last_only static and the cache donated."""
    return jax.jit(mtp_forward, static_argnames=("cfg", "last_only"), donate_argnames=("cache",))
