"""Paged attention decode (one query token per row) over the KV pool of engine/ops/paged_kv.py.

Flash-decoding: the grid is (row, kv head, split); each program walks its share of the row's
pages through the block table, one page (64 tokens x head_dim, contiguous per token) per loop
step, with an online softmax, for all query heads of its KV head at once (GQA: the group's
heads are the rows of one [16, hd] tile, zero-padded, so both products are tensor-core dots).
Each row shares its own visible pages evenly among its programs, so a short row costs only its
own pages, in parallel, however wide the table. XLA then merges the splits' (max, sum, acc)
partials: in reductions, or with a plan's paged_merge "chain" as elementwise chains in split
order (`check_merge`; on the GPU a reduction's order varied with B).

INT8 pages enter the dots as their codes, converted to bf16 (``astype(bfloat16)``): every
int8 code is exact in bf16, so the dots multiply q (bf16) by the codes themselves, and the
softmax weights (bf16) by V's codes. The per-token scales then multiply the page's 64 scores
(K's, before the softmax) and its 64 softmax weights (V's, before their dot) instead of every
one of the page's 64 x head_dim elements: per element only the conversion is left. Against
dequantizing element by element before the dots, the 27B's decode over an int8 pool on the
H200 was faster for one and two rows at 32K and 128K tokens (7.5% for two rows at 128K). The
conversion is not what holds the kernel (a 128K row's pages are 4.3 G codes a step): fp16
codes (one conversion instruction, q and the weights in fp16) and a conversion-free bitcast
(the int16 code + 0x6480 has the bits of the fp16 1152 + code) were measured too, and neither
was faster than bf16 in the H200 decode step.

Launch settings (programs, warps, stages, pages a loop step) by the pool's dtype,
`LAUNCH_DEFAULTS`, measured per setting by bench/paged_decode_micro.py (which passes others).
The split of a row's pages (programs) must not depend on the batch size: it
orders the softmax merge (batch invariance).

`paged_attend` takes what `paged_write_attend` gives `attention.attend` (after the write) and
returns the same [B, 1, heads, head_dim]; `paged_attend_ref` is that reference path. The gated
variant, this kernel's partials merged by the attention tail kernel, is
`attn_merge.paged_attend_gated`.
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

_ROWS = 16  # minimum M of a Triton dot: the query-head group is padded to it
TILE_ROWS = _ROWS  # q's rows a KV head as the kernel takes them
# (`attn_merge.paged_attend_gated` heads=)


def paged_attend_ref(pool: KVPool, table, layer, q, last_slot, slot_offset: int = 0, **_):
    """Reference. pool: KVPool; table [B, max_pages] int32; layer: int32 scalar; q [B, 1, nh, hd];
    last_slot [B] int32 (the newest slot each row sees, inclusive); slots below slot_offset are
    not visible. Returns [B, 1, nh, hd] in q.dtype."""
    n, p, mp = pool.num_pages, pool.page_size, table.shape[1]
    pages = jnp.clip(table, 0, n - 1)
    keys = _load(pool.k, pool.k_scale, layer, pages)
    vals = _load(pool.v, pool.v_scale, layer, pages)
    s = jnp.arange(mp * p)[None, None, :]
    visible = (s >= slot_offset) & (s <= last_slot[:, None, None])
    return attend(q, keys, vals, visible)


def _kernel(layer_ref, table_ref, last_ref, q_ref, k_ref, v_ref, *rest, splits, page, hd,
            max_pages, num_pages, slot_offset, quant, scale, unroll):
    if quant:
        ks_ref, vs_ref, o_ref, m_ref, l_ref = rest
    else:
        o_ref, m_ref, l_ref = rest
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    last = last_ref[b]
    q = q_ref[b, h]                                                    # [16, hd]
    # The row's visible pages, shared evenly by the splits: a short row's few pages run in
    # parallel, one or two a program, rather than all in the first program's loop.
    pages = jnp.minimum(last // page + 1, max_pages)
    pps = jnp.maximum(1, (pages + splits - 1) // splits)
    first = s * pps
    n = jnp.clip(pages - first, 0, pps)
    tok = lax.broadcasted_iota(jnp.int32, (_ROWS, page), 1)

    def load(pj):
        """Page pj of the row (counted from 0): its K and V tiles [page, hd] and scales."""
        pid = jnp.clip(table_ref[b, pj], 0, num_pages - 1)
        k = k_ref[layer, pid, :, h, :]
        v = v_ref[layer, pid, :, h, :]
        ks = vs = None
        if quant:
            ks, vs = ks_ref[layer, pid, :, h], vs_ref[layer, pid, :, h]
        return pj, k, v, ks, vs

    def update(carry, pj, k, v, ks, vs):
        """The online softmax's step over one page."""
        m_i, l_i, acc = carry
        k_scale, v_scale = scale, None
        if quant:  # the codes exact in bf16; per-token scales on the scores and the weights
            k_scale = ks[None, :] * scale                                  # [1, page]
            v_scale = vs[None, :]
            k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) * k_scale  # [16, page]
        slot = pj * page + tok
        sc = jnp.where((slot >= slot_offset) & (slot <= last), sc, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(sc, axis=1))
        pr = jnp.exp(sc - m_new[:, None])
        alpha = jnp.exp(m_i - m_new)
        pv = pr if v_scale is None else pr * v_scale
        acc = acc * alpha[:, None] + lax.dot_general(
            pv.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return m_new, l_i * alpha + jnp.sum(pr, axis=1), acc

    def body(j, carry):  # `unroll` pages: every load first, then the updates in page order
        pages = [load(first + unroll * j + u) for u in range(unroll)]
        for pg in pages:
            carry = update(carry, *pg)
        return carry

    init = (jnp.full((_ROWS,), -jnp.inf, jnp.float32), jnp.zeros((_ROWS,), jnp.float32),
            jnp.zeros((_ROWS, hd), jnp.float32))
    carry = lax.fori_loop(0, n // unroll, body, init)
    if unroll > 1:  # the split's last n % unroll pages, one a step (the same order of updates)
        carry = lax.fori_loop(n // unroll * unroll, n,
                              lambda j, c: update(c, *load(first + j)), carry)
    m_i, l_i, acc = carry
    o_ref[b, s, h] = acc
    m_ref[b, s, h] = m_i
    l_ref[b, s, h] = l_i


def _splits(kvh: int, max_pages: int, programs: int) -> int:
    """Programs a row's pages are split over, per KV head. Each row divides its own visible
    pages among them (`_kernel`), so the split, which orders the softmax merge, depends on the
    row's length alone, never on the rows beside it (batch invariance: the same greedy tokens
    at C1 and C2). A table wider than the row (an engine's pool sized for its longest context)
    no longer leaves a short row's pages to one program (on the H200 that was 41 us a layer
    at 1K in a table of 133K, where the pages of a 1K table took a few)."""
    return max(1, min(max_pages, -(-programs // kvh)))


MERGES = ("reduce", "chain")


def check_merge(merge: str) -> str:
    """How the splits' partials are merged: "reduce" XLA reductions over the splits, row by
    row; "chain" one elementwise sum a split after the other, in split order, which XLA emits
    as a loop fusion (no reduction tiling): the same additions in the same order for every
    element at any batch size (a plan's paged_merge). An unknown name is an error."""
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    return merge


# programs, num_warps, num_stages, unroll by the pool's dtype. H200, the 27B's heads, a 128K
# row (bench/paged_decode_micro.py, kernel time and merge a call): bf16 pages 140.9 us
# with 8 warps against 148.7 with 4 (B = 2: 264.8 / 280.9); int8 pages 110.4 us with 4
# against 178.3 with 8. 1024 programs, 1 or 3 stages and 2 pages a loop step were no faster.
LAUNCH_DEFAULTS = {"int8": (512, 4, 2, 1), "bfloat16": (512, 8, 2, 1),
                   "float32": (512, 4, 2, 1)}


def launch_default(kv_dtype: str = "bfloat16") -> tuple[int, int, int, int]:
    """The kernel's programs, warps, stages and pages a loop step for pages of that dtype
    (LAUNCH_DEFAULTS)."""
    return LAUNCH_DEFAULTS.get(kv_dtype, LAUNCH_DEFAULTS["float32"])


def _settings(pool: KVPool, programs, num_warps, num_stages, unroll) -> dict:
    """The kernel's launch settings: None takes `launch_default`."""
    dp, dw, ds, du = launch_default(str(jnp.dtype(pool.k.dtype)))
    programs = dp if programs is None else programs
    num_warps = dw if num_warps is None else num_warps
    num_stages = ds if num_stages is None else num_stages
    unroll = du if unroll is None else unroll
    if min(programs, num_warps, num_stages, unroll) < 1:
        raise ValueError("paged_attend: programs, num_warps, num_stages and unroll must be "
                         f"positive, got {(programs, num_warps, num_stages, unroll)}")
    return dict(programs=programs, num_warps=num_warps, num_stages=num_stages,
                unroll=int(unroll))


def paged_attend(pool: KVPool, table, layer, q, last_slot, slot_offset: int = 0, *,
                 interpret: bool | None = None, programs: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 unroll: int | None = None, merge: str | None = None):
    """The kernel; same contract as `paged_attend_ref` (T must be 1). unroll: pages a loop
    step (their loads issued together; the updates, and so the bits, are the same).
    programs, num_warps, num_stages, unroll: None takes `launch_default()`. merge: how the
    splits are merged (`check_merge`; None: "reduce")."""
    merge = check_merge("reduce" if merge is None else merge)
    return _paged_attend(pool, table, layer, q, last_slot, slot_offset, interpret=interpret,
                         merge=merge, **_settings(pool, programs, num_warps, num_stages,
                                                  unroll))


_STATIC = ("slot_offset", "interpret", "programs", "num_warps", "num_stages", "unroll")


@functools.partial(jax.jit, static_argnames=_STATIC + ("merge",))
def _paged_attend(pool: KVPool, table, layer, q, last_slot, slot_offset: int, *,
                  interpret: bool | None, programs: int, num_warps: int, num_stages: int,
                  unroll: int, merge: str):
    b, _, nh, hd = q.shape
    r = nh // pool.k.shape[3]
    if r > _ROWS:
        return paged_attend_ref(pool, table, layer, q, last_slot, slot_offset)
    acc, m, l = _partials(pool, table, layer, q, last_slot, slot_offset, interpret=interpret,
                          programs=programs, num_warps=num_warps, num_stages=num_stages,
                          unroll=unroll)
    # Merge the splits. XLA's reductions over [B, S, ...] reduce in an order that varies with
    # B on the GPU (a row's result changed in 1-2 elements of 6,144 beside another row, and
    # reducing row by row did not fix it); "chain" fixes the order (`_merge_chain`).
    out = _merge_chain(acc, m, l) if merge == "chain" else _merge(acc, m, l)
    return out[:, :, :r].reshape(b, 1, nh, hd).astype(q.dtype)


def _partials(pool: KVPool, table, layer, q, last_slot, slot_offset: int, *,
              interpret: bool | None, programs: int, num_warps: int, num_stages: int,
              unroll: int, padded: bool = False):
    """The paged kernel's per-split partials (acc [B, S, kvh, 16, hd], m and l [B, S, kvh,
    16], fp32) for q [B, 1, nh, hd] with nh / kvh <= 16, or (padded) q already the kernel's
    [B, kvh, 16, hd]."""
    interpret = resolve_interpret(interpret)
    kvh, page, mp = pool.k.shape[3], pool.page_size, table.shape[1]
    if padded:
        b, hd = q.shape[0], q.shape[-1]
    else:
        b, t, nh, hd = q.shape
        if t != 1:
            raise ValueError(f"paged_attend decodes one token per row, got T={t}")
        r = nh // kvh
    splits = _splits(kvh, mp, programs)
    # [B, kvh, 16, hd]: head h = g * r + i (HF repeat_kv order) -> group g, row i.
    quant = pool.k_scale is not None
    cdt = jnp.bfloat16 if pool.k.dtype in (jnp.bfloat16, jnp.int8) else jnp.float32
    if padded:
        qg = q.astype(cdt)
    else:
        qg = q[:, 0].reshape(b, kvh, r, hd).astype(cdt)
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, _ROWS - r), (0, 0)))
    kern = functools.partial(_kernel, splits=splits, page=page, hd=hd, max_pages=mp,
                             num_pages=pool.num_pages, slot_offset=slot_offset, quant=quant,
                             scale=hd ** -0.5, unroll=unroll)
    args = [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), table.astype(jnp.int32),
            last_slot.astype(jnp.int32), qg, pool.k, pool.v]
    if quant:
        args += [pool.k_scale, pool.v_scale]
    f32 = jnp.float32
    out_shape = (jax.ShapeDtypeStruct((b, splits, kvh, _ROWS, hd), f32),
                 jax.ShapeDtypeStruct((b, splits, kvh, _ROWS), f32),
                 jax.ShapeDtypeStruct((b, splits, kvh, _ROWS), f32))
    return pl.pallas_call(
        kern, grid=(b, kvh, splits), out_shape=out_shape, interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
        name="paged_decode")(*args)


def _merge(acc, m, l):
    """The splits' partials [B, S, kvh, 16, (hd)] merged: an empty split has m = -inf and
    weighs 0."""
    m_all = jnp.max(m, axis=1, keepdims=True)
    w = jnp.where(jnp.isfinite(m), jnp.exp(m - m_all), 0.0)                   # [B, S, kvh, 16]
    return jnp.sum(acc * w[..., None], axis=1) / jnp.sum(l * w, axis=1)[..., None]


def _merge_chain(acc, m, l):
    """`_merge` as chains of elementwise ops in split order: the max (exact in any order),
    then the weighted sums split by split, so that every element's additions run in one
    order whatever the batch size (XLA's reductions tile by shape)."""
    n = m.shape[1]
    m_all = m[:, 0]
    for s in range(1, n):
        m_all = jnp.maximum(m_all, m[:, s])
    num = den = None
    for s in range(n):
        w = jnp.where(jnp.isfinite(m[:, s]), jnp.exp(m[:, s] - m_all), 0.0)   # [B, kvh, 16]
        a, d = acc[:, s] * w[..., None], l[:, s] * w
        num, den = (a, d) if num is None else (num + a, den + d)
    return num / den[..., None]
