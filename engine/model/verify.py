"""The verify pass of speculative decoding, and the rollback after it.

`verify_forward` scores T tokens per row (the row's last committed token, then its draft) in ONE
compiled call and keeps, for every position, the logits and the GDN conv and recurrent state
after it (per-position snapshots). `commit_verified` then keeps each row's state after its last
accepted position and sets its position there: a rejected draft leaves the row's GDN state as
if it had never been seen. Its KV slots stay written but lie past the row's position, so they
are masked until the next token fed there overwrites them; the runtime gives their whole pages
back (`PageTable.truncate`), and a checkpoint export zeroes a partial page's tail.

The pass is a scan of the decode step (width 1) over the T positions, so each position's
arithmetic is the decode step's: on XLA:CPU fp32 the logits, states and KV it gives are bit for
bit those of T decode steps (a width-T forward blocks the matmuls differently and differs in
the last bits, tests/test_engine_padding.py), which is what lets speculation on and off give the
same tokens and the same stored state. Every position reads the weights again; a wide form (one
width-T forward whose GDN rule emits per-position states, one weight read a pass) is the one a
GPU wants and is not built yet.

Snapshots against replay (restore the state from before the pass, then run the accepted tokens
again): replay runs a second forward of up to T tokens after every pass, snapshots only write
T states. Measured on the 2-core CPU box, tiny model, two rows, T = 5: a decode step 19 ms, the
pass 92 ms with its snapshots (their copy is a few hundred KB: within the runs' spread); replay
would add a forward of the accepted tokens, 19-92 ms. On an H200 with the 27B at int4 a row's
recurrent state is 48 GDN layers x 48 heads x 128 x 128 x 4 B = 151 MB a position, so K = 3
writes 0.6 GB (0.13 ms at 4.8 TB/s), while a replay reads the 13.5 GB of weights again
(about 3 ms): snapshots, by about 20x.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from engine.model.cache import PagedCache
from engine.model.config import ModelConfig
from engine.model.model import forward
from engine.plan import REFERENCE, KernelPlan


def verify_forward(params, cfg: ModelConfig, tokens, cache: PagedCache, lengths, *,
                   plan: KernelPlan = REFERENCE):
    """Score tokens [B, T] (row b's first lengths[b] valid; a row of length 0 is left alone).

    Returns ((logits fp32 [T, B, V], conv [T, ...cache.conv], rec [T, ...cache.rec], mtp_hidden
    [T, B, H] or None), cache): entry t the logits at position t and the states after it (a row
    past its length keeps its last valid state); the cache has every valid token's KV (and, when
    drafting with MTP, its MTP entries) written and pos += lengths."""
    lengths = jnp.asarray(lengths, jnp.int32)

    def step(c, xs):
        tok, t = xs
        n = (t < lengths).astype(jnp.int32)
        logits, _, c = forward(params, cfg, tok[:, None], c, lengths=n, last_only=True,
                               plan=plan)
        return c, (logits[:, 0], c.conv, c.rec, c.mtp_hidden)

    t = tokens.shape[1]
    cache, ys = lax.scan(step, cache, (jnp.asarray(tokens, jnp.int32).T,
                                       jnp.arange(t, dtype=jnp.int32)))
    return ys, cache


def commit_verified(cache: PagedCache, conv_all, rec_all, lengths, keep, mtp_all=None):
    """Keep row b's state after its first keep[b] positions of the pass (1 <= keep <= its
    length; 0 for a row of length 0, which the pass left alone) and set its position there:
    pos = pos - lengths + keep. With MTP drafting (`mtp_all`, the pass's mtp_hidden after each
    position) the row's pending hidden state is the one after its last kept position too."""
    idx = jnp.maximum(jnp.asarray(keep, jnp.int32) - 1, 0)
    rows = jnp.arange(idx.shape[0])
    # conv_all [T, nb, G, B, ...]: take entry idx[b] of each row b
    conv = jnp.moveaxis(conv_all[idx, :, :, rows], 0, 2)
    rec = jnp.moveaxis(rec_all[idx, :, :, rows], 0, 2)
    pos = cache.pos - jnp.asarray(lengths, jnp.int32) + jnp.asarray(keep, jnp.int32)
    cache = cache._replace(conv=conv.astype(cache.conv.dtype), rec=rec, pos=pos)
    if mtp_all is not None:
        cache = cache._replace(mtp_hidden=mtp_all[idx, rows], mtp_pos=pos - 1)
    return cache


def jit_verify():
    """verify_forward, jitted with cfg/plan static and the cache donated."""
    return jax.jit(verify_forward, static_argnames=("cfg", "plan"), donate_argnames=("cache",))


jit_commit = jax.jit(commit_verified, donate_argnames=("cache",))
