"""Paged attention for a prefill chunk (T > 1 query tokens per row) over the KV pool of
engine/ops/paged_kv.py.

The reference (`paged_prefill_attend_ref`, what `paged_write_attend` does after its write)
gathers all max_pages pages of each row and materialises [B, heads, T, max_pages * P] fp32
scores: ~100 GB for the 27B heads at 128K context and an 8K chunk. The kernel is flash
attention through the block table:

- Tile rows are (query token, query head) pairs of ONE KV head, flattened token-major
  (row = t * r + i for query head g * r + i, HF repeat_kv order), `block_rows` of them per
  program (a power of two >= 16, the smallest Triton dot). With r = 6 no row is padding except
  in the row's last tile, and every K/V page a program loads serves all r query heads of its
  KV head: K/V are read once per tile of block_rows / r tokens, not once per query head.
- Grid (row, kv head, row tile). A program walks the row's pages through the block table
  (scalar loads, one [P, hd] page of K and V per step, P = the page size), online softmax in
  fp32, from the page of slot_offset up to the page holding the tile's last visible slot
  (causal stop: the causal upper half is never read). INT8 pages are dequantized in registers
  with their per-token scales (as engine/kernels/paged_decode.py does).
- Short chunks (kv_heads x tiles below `programs`, e.g. a few speculative tokens at long
  context) would leave the GPU nearly idle with one program per tile walking 2K pages, so a
  tile's pages are then split flash-decoding style: grid axis 2 is (tile, split), each split
  writes fp32 (max, sum, acc) partials and XLA merges them. The split count is static (the
  grid); the pages each split takes are not: a tile's live pages (slot_offset's page to its
  last visible one) are cut into that many equal runs at run time, so every split works
  whatever share of the table the context fills, and the result does not depend on the
  table's width. Long chunks take the whole range per program and write the normalised result
  directly.
- Each program owns one batch row; the tiles and the split depend only on T, the heads and the
  table width, never on B or the other rows, so the result is batch invariant.

Query step t of row b sees slots slot_offset..slots[b, t] of its own row. A step that sees no
slot (an invalid, padded step whose slot is below slot_offset) yields 0, not NaN; a slot past
the table sees the whole table, like the reference. Table entries are clipped to the pool, so
-1 entries past a row's length are never read out of range.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from engine.kernels import resolve_interpret, triton_params
from engine.ops.attention import attend
from engine.ops.paged_kv import KVPool, _load

_MIN_TILE = 16  # smallest M/N/K of a Triton dot


def paged_prefill_attend_ref(pool: KVPool, table, layer, q, slots, slot_offset: int = 0, **_):
    """Reference. pool: KVPool; table [B, max_pages] int32; layer: int32 scalar; q [B, T, nh, hd];
    slots [B, T] int32 (positions + slot_offset: query t of row b sees slots
    slot_offset..slots[b, t]). Returns [B, T, nh, hd] in q.dtype."""
    n, p, mp = pool.num_pages, pool.page_size, table.shape[1]
    pages = jnp.clip(table, 0, n - 1)
    keys = _load(pool.k, pool.k_scale, layer, pages)
    vals = _load(pool.v, pool.v_scale, layer, pages)
    s = jnp.arange(mp * p)[None, None, :]
    visible = (s >= slot_offset) & (s <= slots[:, :, None])
    return attend(q, keys, vals, visible)


def _pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _tile_rows(t: int, r: int, block_rows: int) -> int:
    """Rows per program: block_rows, or the next power of two >= 16 covering T * r when the
    chunk is smaller (a function of T and the heads only, never of B)."""
    need = max(_MIN_TILE, 1 << max(0, (t * r - 1).bit_length()))
    return min(block_rows, need)


def supported(pool: KVPool, q, block_rows: int = 128) -> bool:
    """Shapes the kernel tiles: head_dim and page size powers of two >= 16, whole query-head
    groups, block_rows a power of two >= 16."""
    hd, nh = q.shape[3], q.shape[2]
    kvh, page = pool.k.shape[3], pool.page_size
    return (q.ndim == 4 and _pow2(hd) and hd >= _MIN_TILE and _pow2(page) and page >= _MIN_TILE
            and nh % kvh == 0 and _pow2(block_rows) and block_rows >= _MIN_TILE
            and pool.k.shape[4] == hd)


def _kernel(layer_ref, table_ref, rs_ref, q_ref, k_ref, v_ref, *rest, rows, page, hd,
            max_pages, num_pages, slot_offset, quant, scale, cdt, splits):
    if quant:
        ks_ref, vs_ref, *outs = rest
    else:
        outs = rest
    b, g, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    i, s = (c, 0) if splits == 1 else (c // splits, c % splits)
    layer = layer_ref[0]
    tile = pl.ds(pl.multiple_of(i * rows, rows), rows)
    q = q_ref[b, g, tile, :]                                             # [rows, hd]
    rs = rs_ref[b, tile]                                                 # [rows] last slot
    # Pages [lo, hi): from slot_offset's page to the page of the tile's last visible slot;
    # split s takes the s-th of `splits` equal runs of them (the last one shorter, runs past
    # hi empty).
    lo = slot_offset // page
    hi = jnp.minimum(jnp.max(rs) // page + 1, max_pages)
    if splits > 1:
        per = jnp.maximum(hi - lo + splits - 1, 0) // splits
        lo, hi = lo + s * per, jnp.minimum(hi, lo + (s + 1) * per)
    tok = lax.broadcasted_iota(jnp.int32, (rows, page), 1)
    prec = lax.Precision.HIGHEST if cdt == jnp.float32 else None

    def body(j, carry):
        m_i, l_i, acc = carry
        pid = jnp.clip(table_ref[b, j], 0, num_pages - 1)
        k = k_ref[layer, pid, :, g, :]                                   # [page, hd]
        v = v_ref[layer, pid, :, g, :]
        if quant:
            k = (k.astype(jnp.float32) * ks_ref[layer, pid, :, g][:, None]).astype(cdt)
            v = (v.astype(jnp.float32) * vs_ref[layer, pid, :, g][:, None]).astype(cdt)
        else:
            k, v = k.astype(cdt), v.astype(cdt)
        sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32) * scale  # [rows, page]
        slot = j * page + tok
        sc = jnp.where((slot >= slot_offset) & (slot <= rs[:, None]), sc, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(sc, axis=1))
        # A row that has seen no visible slot yet keeps m = -inf: guard the exp.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        pr = jnp.exp(sc - m_safe[:, None])
        alpha = jnp.exp(m_i - m_safe)
        acc = acc * alpha[:, None] + lax.dot_general(
            pr.astype(cdt), v, (((1,), (0,)), ((), ())), precision=prec,
            preferred_element_type=jnp.float32)
        return m_new, l_i * alpha + jnp.sum(pr, axis=1), acc

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, hd), jnp.float32))
    m_i, l_i, acc = lax.fori_loop(lo, hi, body, init)
    if splits == 1:
        o_ref, = outs
        o_ref[b, g, tile, :] = (acc / jnp.maximum(l_i, 1e-30)[:, None]).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = outs
        o_ref[b, s, g, tile, :] = acc
        m_ref[b, s, g, tile] = m_i
        l_ref[b, s, g, tile] = l_i


def _splits(kvh: int, tiles: int, max_pages: int, programs: int) -> int:
    """Splits of each tile's live pages. Long chunks (kvh * tiles >= programs) take them in
    one program per tile; short ones (a new turn's last tokens, speculative verify) split them
    so that at most `programs` programs share each row's pages, flash-decoding style. A
    function of T, the heads and the table width only, never of B: the split decides the merge
    order, and a row's result must not change with the rows beside it."""
    return max(1, min(max_pages, programs // (kvh * tiles)))


@functools.partial(jax.jit, static_argnames=("slot_offset", "interpret", "block_rows",
                                             "programs", "num_warps", "num_stages"))
def paged_prefill_attend(pool: KVPool, table, layer, q, slots, slot_offset: int = 0, *,
                         interpret: bool | None = None, block_rows: int = 128,
                         programs: int = 132, num_warps: int | None = None,
                         num_stages: int = 2):
    """The kernel; same contract as `paged_prefill_attend_ref`. Shapes `supported` rejects take
    the reference. block_rows: (token, head) rows per program (128: 371 TFLOP/s for one 27B
    layer at 32K tokens on the H200 against 193 with 64); programs: while kv_heads * tiles is
    below it (short chunks), each tile's live pages are split so that at most this many
    programs share a row, the splits' partials merged in XLA (132, one wave of the H100's and
    H200's multiprocessors: 65 tokens after 32K took 13% less than at 512,
    bench/lab/gemm_arrangement.md); num_warps None: 4 for head_dim <= 128, else 8."""
    if not supported(pool, q, block_rows):
        return paged_prefill_attend_ref(pool, table, layer, q, slots, slot_offset)
    interpret = resolve_interpret(interpret)
    b, t, nh, hd = q.shape
    kvh, page, mp = pool.k.shape[3], pool.page_size, table.shape[1]
    r = nh // kvh
    rows = _tile_rows(t, r, block_rows)
    n_rows = t * r
    tiles = -(-n_rows // rows)
    pad = tiles * rows - n_rows
    splits = _splits(kvh, tiles, mp, programs)
    cdt = jnp.float32 if pool.k.dtype == jnp.float32 else jnp.bfloat16
    # [B, T, kvh, r, hd] -> [B, kvh, T * r, hd]: row t * r + i is token t, query head g * r + i.
    qg = q.reshape(b, t, kvh, r, hd).transpose(0, 2, 1, 3, 4).reshape(b, kvh, n_rows, hd)
    qg = jnp.pad(qg.astype(cdt), ((0, 0), (0, 0), (0, pad), (0, 0)))
    # Each row's last visible slot; padding rows see nothing (slot_offset - 1 < slot_offset).
    rs = jnp.repeat(slots.astype(jnp.int32), r, axis=1)
    rs = jnp.pad(rs, ((0, 0), (0, pad)), constant_values=slot_offset - 1)
    quant = pool.k_scale is not None
    if num_warps is None:
        num_warps = 4 if hd <= 128 else 8
    kern = functools.partial(_kernel, rows=rows, page=page, hd=hd, max_pages=mp,
                             num_pages=pool.num_pages, slot_offset=slot_offset, quant=quant,
                             scale=hd ** -0.5, cdt=cdt, splits=splits)
    args = [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), table.astype(jnp.int32), rs, qg,
            pool.k, pool.v]
    if quant:
        args += [pool.k_scale, pool.v_scale]
    f32, width = jnp.float32, tiles * rows
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((b, kvh, width, hd), q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((b, splits, kvh, width, hd), f32),
                     jax.ShapeDtypeStruct((b, splits, kvh, width), f32),
                     jax.ShapeDtypeStruct((b, splits, kvh, width), f32))
    out = pl.pallas_call(
        kern, grid=(b, kvh, tiles * splits), out_shape=out_shape, interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
        name="paged_prefill")(*args)
    if splits > 1:
        # Merge the splits; an empty split has m = -inf and weighs 0, a row that sees nothing
        # at all yields 0.
        # The sums run split by split in a fixed order, as elementwise adds: a reduction over
        # the split axis is laid out by XLA per shape, and its order (so the result's last
        # bits) then changed with B on the H200 (6 splits, block_rows 128).
        acc, m, l = out
        m_all = jnp.max(m, axis=1, keepdims=True)
        w = jnp.where(jnp.isfinite(m), jnp.exp(m - m_all), 0.0)      # [B, S, kvh, width]
        num, den = acc[:, 0] * w[:, 0, ..., None], l[:, 0] * w[:, 0]
        for i in range(1, splits):
            num, den = num + acc[:, i] * w[:, i, ..., None], den + l[:, i] * w[:, i]
        out = (num / jnp.maximum(den, 1e-30)[..., None]).astype(q.dtype)
    out = out[:, :, :n_rows].reshape(b, kvh, t, r, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, nh, hd)
