"""The Qwen3.5/3.8 hybrid forward: embed -> num_blocks x ([GDN] * (interval-1) + [attention])
-> final norm -> lm_head, plus the MTP draft head.

The blocks run as ONE lax.scan over stacked block weights, so compile time does not grow with
depth. The whole cache rides in the scan carry and each block updates its slice in place. The
cache is a contiguous `Cache` or a `PagedCache` (KV in a shared page pool); the type picks the
attention KV path at trace time, everything else is shared.

    fwd = jax.jit(forward, static_argnames=FORWARD_STATIC, donate_argnames=("cache",))
    logits, hidden, cache = fwd(params, cfg, tokens, cache)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from engine.kernels.stacked import flatten_stack, select_layer, sub_layer
from engine.model.cache import Cache, PagedCache, init_cache, init_paged_cache  # noqa: F401
from engine.model.config import ConfigError, ModelConfig
from engine.model.layers import StackedStates, attention_layer, gdn_layer
from engine.model.linear import linear
from engine.model.params import ParamError, stack_params  # noqa: F401  (re-exported)
from engine.ops.gdn import GDN_RULES
from engine.ops.norms import rms_norm
from engine.ops.paged_kv import PagedKV
from engine.ops.quant import embedding_lookup
from engine.plan import REFERENCE, KernelPlan, check_plan

FORWARD_STATIC = ("cfg", "gdn_mode", "last_only", "plan")


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


def _run_blocks(blocks, cfg: ModelConfig, x, cache, positions, lengths, valid, mode,
                plan: KernelPlan = REFERENCE):
    """Scan the stacked blocks over x [B, T, H]; returns (x, cache with its attention KV, conv
    and rec updated). The plan's unroll_blocks unrolls both scans (same math, static weight
    slices, compile grows with depth). The carry holds the KV arrays only (the pool, or k and
    v); the block table is constant and closed over."""
    paged = isinstance(cache, PagedCache)
    unroll = plan.unroll_blocks

    # block_loop "views": the scans carry layer indices and the matrices stay stacked, read in
    # place by the kernels through `Stacked` views (engine/kernels/stacked.py says why).
    views = plan.block_loop == "views"
    # a decode step with the fused GDN kernel updates the state stacks in place (layers.py)
    stacked = views and x.shape[1] == 1 and plan.gdn_decode == "fused"

    swap = False
    if stacked:
        from engine.kernels.gdn_decode_fused import KERNEL_PARAMS
        gdn_flat = flatten_stack(blocks["gdn"], 2)
        # "swap": the layers read the cache's conv stack and write a second one in place,
        # which the scans carry and the step returns (no copy a layer into the stack)
        swap = plan.gdn_conv_write == "swap"

    def block(carry, xs):
        x, kv, conv, rec = carry
        p, i = xs
        if views:
            p = select_layer(blocks, i, 1)

        def gdn(x, layer_xs):
            lp, conv_l, rec_l = layer_xs
            if views:
                lp = sub_layer(p["gdn"], lp)
            x, conv_l, rec_l = gdn_layer(lp, cfg, x, conv_l, rec_l, lengths, valid, mode,
                                         plan)
            return x, (conv_l, rec_l)

        def gdn_stacked(c, j):
            x, conv, rec = c
            layer = i * cfg.gdn_per_block + j
            # the layer's weights by their flat index into the [blocks * n, ...] stacks: the
            # GEMVs, the fused kernel and the states all take the one index
            st = StackedStates(cache.conv if swap else conv, rec, layer,
                               {k: gdn_flat["linear_attn"][k] for k in KERNEL_PARAMS},
                               conv_out=conv if swap else None)
            x, st, _ = gdn_layer(select_layer(gdn_flat, layer, 1), cfg, x, st, None, lengths,
                                 valid, mode, plan)
            return (x, st.conv_out if swap else st.conv, st.rec), None

        gdn_ids = jnp.arange(cfg.gdn_per_block, dtype=jnp.int32)
        if stacked:
            (x, conv, rec), _ = lax.scan(gdn_stacked, (x, conv, rec), gdn_ids, unroll=unroll)
        else:
            gdn_xs = gdn_ids if views else p["gdn"]
            x, (conv_i, rec_i) = lax.scan(gdn, x, (gdn_xs, conv[i], rec[i]), unroll=unroll)
            conv, rec = conv.at[i].set(conv_i), rec.at[i].set(rec_i)
        if paged:
            x, layer_kv = attention_layer(p["attn"], cfg, x, PagedKV(kv, cache.block_table), i,
                                          positions, valid, plan)
            kv = layer_kv.pool
        else:
            x, kv = attention_layer(p["attn"], cfg, x, kv, i, positions, valid, plan)
        return (x, kv, conv, rec), None

    kv = cache.pool if paged else (cache.k, cache.v)
    ids = jnp.arange(cfg.num_blocks, dtype=jnp.int32)
    xs = (ids if views else blocks, ids)
    # swap: every GDN layer writes its slot of the new stack (an idle row its old window)
    conv0 = jnp.zeros_like(cache.conv) if swap else cache.conv
    (x, kv, conv, rec), _ = lax.scan(block, (x, kv, conv0, cache.rec), xs, unroll=unroll)
    if paged:
        return x, cache._replace(pool=kv, conv=conv, rec=rec)
    return x, cache._replace(k=kv[0], v=kv[1], conv=conv, rec=rec)


def _head(params, cfg: ModelConfig, h, lengths, last_only: bool,
          plan: KernelPlan = REFERENCE):
    """Logits fp32 [B, T, V], or [B, 1, V] at each row's last valid step when last_only."""
    if last_only:
        idx = jnp.maximum(lengths - 1, 0)[:, None, None]
        h = jnp.take_along_axis(h, idx, axis=1)
        if plan.head_rows and h.shape[0] > 1:
            return _head_rows(params["lm_head"], h, lengths, cfg.vocab_size, plan)
    return linear(h, params["lm_head"], plan).astype(jnp.float32)


def _head_rows(w, h, lengths, vocab: int, plan: KernelPlan):
    """The plan's head_rows: [B, 1, V] logits of h [B, 1, H], one live row at a time, the same
    one-row product whatever the other rows hold; rows of length 0 get zeros."""
    def one(args):
        row, n = args
        return lax.cond(n > 0, lambda r: linear(r[None], w, plan)[0].astype(jnp.float32),
                        lambda r: jnp.zeros((1, vocab), jnp.float32), row)
    return lax.map(one, (h, lengths))


def forward(params, cfg: ModelConfig, tokens, cache: Cache | PagedCache, *,
            gdn_mode: str = "chunk", lengths=None, last_only: bool = False,
            plan: KernelPlan = REFERENCE):
    """Process T new tokens per row at each row's cache position (prefill T > 1, decode T = 1).

    params: `stack_params` tree; tokens: [B, T] int32; cache: `init_cache(cfg, B, max_len)` or
    `init_paged_cache(cfg, pool, block_table)` (same results; see engine/ops/paged_kv.py).
    gdn_mode: "chunk" (WY/UT form) or "recurrent" (step-by-step); both give the same result.
    lengths: optional [B] int32, valid tokens per row (right padding; a row with 0 is untouched).
    last_only: return logits only at each row's last valid token ([B, 1, V]), for long prefills.
    plan: the KernelPlan (engine/plan.py) that picks each part's implementation: the plain-JAX
    references, Pallas kernels (Triton on a GPU, the Pallas interpreter elsewhere) or the CUDA
    ops, where the shapes fit.
    Returns (logits fp32 [B, T, V], hidden [B, T, H] after the final norm (the MTP input),
    new cache with pos += lengths). A paged cache with `mtp_hidden` set (MTP drafting) also has
    its MTP layer's entries for these tokens written (`mtp_track`). Tokens past max_len (paged: past the block table, or on a
    page id < 0) are silently dropped from the KV cache: the caller must keep pos + T <= max_len
    (paged: the row's table must cover slots [pos, pos + T)).
    """
    if gdn_mode not in GDN_RULES:
        raise ValueError(f"gdn_mode must be one of {sorted(GDN_RULES)}, got {gdn_mode!r}")
    check_plan(plan)
    lengths, valid = _steps(tokens, lengths)
    positions = cache.pos[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    x = _embed(params, tokens)
    x, cache = _run_blocks(params["blocks"], cfg, x, cache, positions, lengths, valid, gdn_mode,
                           plan)
    hidden = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    logits = _head(params, cfg, hidden, lengths, last_only, plan)
    cache = cache._replace(pos=cache.pos + lengths)
    if isinstance(cache, PagedCache) and cache.mtp_hidden is not None:
        cache = mtp_track(params, cfg, hidden, tokens, cache, lengths, plan)
    return logits, hidden, cache


def forward_rows(params, cfg: ModelConfig, tokens, cache: PagedCache, rows, *, lengths=None,
                 plan: KernelPlan = REFERENCE):
    """`forward` (last_only) over a few rows of a batched paged cache: tokens [n, T] for the
    cache rows `rows` [n] int32 (distinct), the other rows left alone and not computed.

    A prefill piece is one row's work: `forward` over all B rows would run the other B - 1
    as padding through every matmul (an engine of two rows prefilled at half the rate on the
    H200). The rows' GDN states, positions and block-table rows are taken out, `forward` runs
    on them with the shared KV pool, and they are put back (in place once the cache is
    donated; the states' copy is ~0.15 GB a 27B row, tens of us against a piece's ms).
    Returns (logits fp32 [B, 1, V] with zeros in the rows not run, the new cache)."""
    rows = jnp.asarray(rows, jnp.int32)
    mtp = cache.mtp_hidden is not None
    sub = cache._replace(block_table=cache.block_table[rows], conv=cache.conv[:, :, rows],
                         rec=cache.rec[:, :, rows], pos=cache.pos[rows],
                         mtp_pos=cache.mtp_pos[rows],
                         mtp_hidden=cache.mtp_hidden[rows] if mtp else None)
    logits, _, sub = forward(params, cfg, tokens, sub, lengths=lengths, last_only=True,
                             plan=plan)
    out = jnp.zeros((cache.pos.shape[0],) + logits.shape[1:], logits.dtype).at[rows].set(logits)
    cache = cache._replace(pool=sub.pool, conv=cache.conv.at[:, :, rows].set(sub.conv),
                           rec=cache.rec.at[:, :, rows].set(sub.rec),
                           pos=cache.pos.at[rows].set(sub.pos))
    if mtp:
        cache = cache._replace(mtp_pos=cache.mtp_pos.at[rows].set(sub.mtp_pos),
                               mtp_hidden=cache.mtp_hidden.at[rows].set(sub.mtp_hidden))
    return out, cache


def jit_forward_rows():
    """forward_rows, jitted with cfg/plan static and the cache donated."""
    return jax.jit(forward_rows, static_argnames=("cfg", "plan"), donate_argnames=("cache",))


def mtp_forward(params, cfg: ModelConfig, hidden, tokens, cache: Cache | PagedCache, *,
                lengths=None, last_only: bool = False, plan: KernelPlan = REFERENCE):
    """Multi-token-prediction head: entry t pairs the main model's hidden h_t with token x_{t+1}
    and predicts x_{t+2}.

    hidden: [B, T, H] from `forward` (after the final norm); tokens: [B, T] int32, the tokens that
    follow those hidden states. Entries sit at positions cache.mtp_pos + t in the MTP layer's own
    KV cache (paged: pool layer num_blocks, slot position + 1, through the rows' block tables;
    the pool must be built with mtp=True and the tables must cover slot mtp_pos + T).
    h' = fc(cat[norm_e(embed(x_{t+1})), norm_h(h_t)]) -> one attention decoder layer ->
    mtp.norm -> shared lm_head. Returns (logits fp32 [B, T, V] (or [B, 1, V] with last_only),
    mtp hidden [B, T, H] after mtp.norm (input for a further draft step), new cache with
    mtp_pos += lengths).
    """
    lengths, _ = _steps(tokens, lengths)
    h, cache = _mtp_layer(params, cfg, hidden, tokens, cache, lengths, plan)
    return _head(params, cfg, h, lengths, last_only, plan), h, cache


def _mtp_layer(params, cfg: ModelConfig, hidden, tokens, cache, lengths,
               plan: KernelPlan = REFERENCE):
    """`mtp_forward` without the lm_head: (mtp hidden [B, T, H], cache). The plan's GEMV
    takes fc (as it takes the shared lm_head in `_head`); the decoder layer runs the reference
    path, since its weights are not in the block stacks the plan's kernels read."""
    if not cfg.mtp_layers or "mtp" not in params:
        raise ConfigError(f"model config {cfg.name!r} has no MTP layer")
    if isinstance(cache, PagedCache) and cache.pool.k.shape[0] <= cfg.num_blocks:
        raise ConfigError("the paged KV pool has no MTP layer: build it with "
                          "init_kv_pool(..., mtp=True)")
    m, eps = params["mtp"], cfg.rms_norm_eps
    lengths, valid = _steps(tokens, lengths)
    positions = cache.mtp_pos[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    e = rms_norm(_embed(params, tokens), m["pre_fc_norm_embedding"], eps)
    h = rms_norm(hidden.astype(e.dtype), m["pre_fc_norm_hidden"], eps)
    x = linear(jnp.concatenate([e, h], axis=-1), m["fc"], plan)
    if isinstance(cache, PagedCache):
        # Slot = position + 1: entry j depends on tokens[0..j+1], like main-model slot j + 1.
        kv = PagedKV(cache.pool, cache.block_table, slot_offset=1)
        x, kv = attention_layer(m["layer"], cfg, x, kv, cfg.num_blocks, positions, valid)
        cache = cache._replace(pool=kv.pool)
    else:
        x, (k, v) = attention_layer(m["layer"], cfg, x, (cache.mtp_k, cache.mtp_v), 0,
                                    positions, valid)
        cache = cache._replace(mtp_k=k, mtp_v=v)
    h = rms_norm(x, m["norm"], eps)
    return h, cache._replace(mtp_pos=cache.mtp_pos + lengths)


def mtp_track(params, cfg: ModelConfig, hidden, tokens, cache: PagedCache, lengths,
              plan: KernelPlan = REFERENCE):
    """Keep the MTP layer's KV current behind a forward that fed `tokens` [B, T] (lengths[b]
    valid) and gave `hidden` [B, T, H]; `cache` is the forward's (pos already advanced).

    Entry j pairs h_j with x_{j+1}: the forward's first token completes the entry of the row's
    previous last hidden state (`cache.mtp_hidden`), so a forward of T tokens at position p
    writes entries p - 1 .. p + T - 2 and keeps h_{p+T-1} for the next. Then mtp_pos = pos - 1
    (the entry a draft starts at) and mtp_hidden = the last valid hidden state. A row's first
    forward (p = 0) writes a placeholder entry -1 (slot 0, which no real entry uses) from a zero
    hidden state; rows of length 0 are left alone. The lm_head is not run: drafts come from
    `mtp_draft`, after the verifier's token is known."""
    before = cache.pos - lengths
    h_in = jnp.concatenate([cache.mtp_hidden[:, None].astype(hidden.dtype), hidden[:, :-1]], 1)
    first = (before == 0)[:, None] & (jnp.arange(h_in.shape[1]) == 0)[None, :]
    h_in = jnp.where(first[:, :, None], 0, h_in)
    _, c = _mtp_layer(params, cfg, h_in, tokens, cache._replace(mtp_pos=before - 1), lengths,
                      plan)
    last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], 1)[:, 0]
    keep = jnp.where((lengths > 0)[:, None], last.astype(cache.mtp_hidden.dtype),
                     cache.mtp_hidden)
    return c._replace(mtp_pos=cache.pos - 1, mtp_hidden=keep)


def mtp_draft(params, cfg: ModelConfig, last, cache: PagedCache, steps, k: int,
              plan: KernelPlan = REFERENCE):
    """Greedy MTP drafts [B, k] int32: row b's first steps[b] (<= k) are its drafts after its
    last sampled token `last` [B], not fed yet (pos and mtp_hidden as `mtp_track` left them).
    Step 1 completes the row's pending entry (mtp_hidden, last) at mtp_pos and predicts the token
    after `last`; step i > 1 feeds the MTP layer's own hidden state and draft i - 1. Step i
    writes slot pos + i - 1 of the row: its pages must cover slots pos .. pos + steps - 1. The
    verify pass that follows rewrites the entries it keeps; mtp_pos is left as it was."""
    steps = jnp.asarray(steps, jnp.int32)
    c, h, tok, drafts = (cache._replace(mtp_pos=cache.pos - 1), cache.mtp_hidden,
                         jnp.asarray(last, jnp.int32), [])
    for i in range(k):
        active = (i < steps).astype(jnp.int32)
        hh, c = _mtp_layer(params, cfg, h[:, None], tok[:, None], c, active, plan)
        logits = _head(params, cfg, hh, active, True, plan)
        tok = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        drafts.append(tok)
        h = hh[:, 0]
    return jnp.stack(drafts, axis=1), c._replace(mtp_pos=cache.mtp_pos)


def jit_forward():
    """forward, jitted with cfg/gdn_mode/last_only/plan static and the cache donated."""
    return jax.jit(forward, static_argnames=FORWARD_STATIC, donate_argnames=("cache",))


def jit_mtp_draft():
    """mtp_draft, jitted with cfg/k/plan static and the cache donated."""
    return jax.jit(mtp_draft, static_argnames=("cfg", "k", "plan"), donate_argnames=("cache",))


def jit_mtp_forward():
    """mtp_forward, jitted with cfg/last_only/plan static and the cache donated."""
    return jax.jit(mtp_forward, static_argnames=("cfg", "last_only", "plan"),
                   donate_argnames=("cache",))
