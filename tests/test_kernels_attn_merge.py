"""The attention tail kernel (engine/kernels/attn_merge.py): the paged decode kernel's splits
merged, the output gated, o_proj's group sums, against the model's ops (interpreter on the
CPU; Triton lowering; `-m gpu` at the 27B's heads)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels import attn_merge as AM
from engine.kernels.attn_merge import paged_attend_gated
from engine.kernels.cuda_ops import group_sums
from engine.kernels.paged_decode import _partials, _settings, paged_attend
from engine.model.config import QWEN38_27B, TEST_SMALL
from engine.plan import PALLAS, PRESETS, KernelPlan
from tests.kernel_checks import assert_close, lowers_for_cuda, on_gpu, paged_decode_ab
from tests.test_kernels_attention import _paged_case


def _gated_ref(pool, table, q, last, gsrc, off=0, **kw):
    """The model's path: the paged kernel (its splits merged by XLA), then the gate."""
    b, _, nh, hd = q.shape
    out = paged_attend(pool, table, jnp.int32(1), q, last, off, **kw)
    gate = gsrc.reshape(b, nh, 2 * hd)[..., hd:].reshape(b, nh * hd)
    y = out.reshape(b, nh * hd) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(q.dtype)
    return y, group_sums(y)


def _gsrc(rng, q):
    b, _, nh, hd = q.shape
    return jnp.asarray(rng.standard_normal((b, nh * 2 * hd)) * 2, q.dtype)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("programs", [4, 64])
@pytest.mark.parametrize("off", [0, 1])
def test_gated_attend_matches_the_model_path(kv_dtype, programs, off):
    """Splits of several pages and splits past the rows' lengths (programs 4), one page a
    split with most of them empty (64: chunks of splits the kernel walks only while they
    hold pages)."""
    rng = np.random.default_rng()
    pool, table, q, last = _paged_case(rng, kv_dtype, 2, pages=48, page=16, kvh=2, hd=128,
                                       nh=6, mp=12)
    gsrc = _gsrc(rng, q)
    y, sums = paged_attend_gated(pool, table, jnp.int32(1), q, last, gsrc, 128, 256, off,
                                 interpret=True, programs=programs)
    want_y, want_sums = _gated_ref(pool, table, q, last, gsrc, off, interpret=True,
                                   programs=programs)
    assert y.shape == (2, 1, 6 * 128) and y.dtype == q.dtype and sums.shape == (2, 1, 12)
    assert_close(y[:, 0], want_y, q.dtype)
    # the sums are those of the values written, whatever their rounding
    np.testing.assert_allclose(np.asarray(sums[:, 0]), np.asarray(group_sums(y[:, 0])),
                               rtol=1e-6, atol=1e-5)
    assert_close(sums[:, 0], want_sums, q.dtype)


def test_merge_kernel_matches_its_reference_on_the_partials():
    """`merge_gate_sums` against `merge_gate_sums_ref` on the paged kernel's own partials,
    with one row that sees only its first slot (an idle row of a wider engine)."""
    rng = np.random.default_rng()
    pool, table, q, last = _paged_case(rng, "bfloat16", 3, pages=60, page=16, kvh=2, hd=128,
                                       nh=6, mp=16)
    last = last.at[2].set(0)
    acc, m, l = _partials(pool, table, jnp.int32(0), q, last, 0, interpret=True,
                          **_settings(pool, 32, None, None, None))
    gsrc = jnp.asarray(rng.standard_normal((3, 6 * 128)), jnp.bfloat16)
    y, sums = AM.merge_gate_sums(acc, m, l, last, gsrc, heads=6, page=16, max_pages=16,
                                 gate_at=0, gate_stride=128, out_dtype=jnp.bfloat16,
                                 interpret=True)
    want_y, want_sums = AM.merge_gate_sums_ref(acc, m, l, gsrc, jnp.bfloat16)
    assert_close(y, want_y, jnp.bfloat16)
    assert_close(sums, want_sums, jnp.bfloat16)
    # the row's active splits: pages up to its last slot over runs of ceil(pages / splits)
    assert [int(AM.active_splits(jnp.int32(s), 16, 16, 16)) for s in (0, 15, 16, 255)] == \
        [1, 1, 2, 16]
    assert int(AM.active_splits(jnp.int32(1000), 16, 4, 100)) == 4


def test_gated_attend_is_batch_invariant():
    """Row 0's bits alone and beside another row (the merge's order is the row's own)."""
    rng = np.random.default_rng()
    pool, table, q, last = _paged_case(rng, "bfloat16", 2, pages=48, page=16, kvh=2, hd=128,
                                       nh=6, mp=12)
    gsrc = _gsrc(rng, q)
    both = paged_attend_gated(pool, table, jnp.int32(1), q, last, gsrc, 128, 256,
                              interpret=True, programs=16)
    alone = paged_attend_gated(pool, table[:1], jnp.int32(1), q[:1], last[:1], gsrc[:1], 128,
                               256, interpret=True, programs=16)
    for a, b in zip(alone, both):
        assert np.array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))


def test_merge_checks_its_input():
    rng = np.random.default_rng()
    acc = jnp.zeros((1, 4, 2, 16, 128), jnp.float32)
    m = l = jnp.zeros((1, 4, 2, 16), jnp.float32)
    last = jnp.zeros((1,), jnp.int32)
    g = jnp.asarray(rng.standard_normal((1, 6 * 256)), jnp.bfloat16)
    kw = dict(page=16, max_pages=4, gate_at=128, gate_stride=256, out_dtype=jnp.bfloat16,
              interpret=True)
    with pytest.raises(ValueError, match="KV heads"):
        AM.merge_gate_sums(acc, m, l, last, g, heads=5, **kw)
    with pytest.raises(ValueError, match="must be acc's"):
        AM.merge_gate_sums(acc, m[:, :3], l, last, g, heads=6, **kw)
    with pytest.raises(ValueError, match="gates"):
        AM.merge_gate_sums(acc, m, l, last, g[:, :-1], heads=6, **kw)
    with pytest.raises(ValueError, match="tile"):
        AM.merge_gate_sums(acc, m, l, last, g, heads=6, tile=96, **kw)


def test_merge_lowers_to_triton():
    acc = jnp.zeros((2, 128, 4, 16, 256), jnp.float32)
    m = l = jnp.zeros((2, 128, 4, 16), jnp.float32)
    g = jnp.zeros((2, 24 * 512 + 2 * 4 * 256), jnp.bfloat16)
    lowers_for_cuda(lambda a, m, l, s, g: AM.merge_gate_sums(
        a, m, l, s, g, heads=24, page=64, max_pages=2048, gate_at=256, gate_stride=512,
        out_dtype=jnp.bfloat16, interpret=False), acc, m, l, jnp.zeros((2,), jnp.int32), g)


CFG = dataclasses.replace(TEST_SMALL, name="test-small-merge", head_dim=64)  # a group a head


def test_model_paged_decode_through_the_merge_matches_the_plain_path():
    """bf16 paged decode steps with the pallas plan and the prep kernel: the attention tail
    kernel (attn_merge=True) gives the XLA merge's logits within bf16's bound."""
    prep = dataclasses.replace(PALLAS, attn_prep=True)
    outs = paged_decode_ab(CFG, {"off": prep, "on": dataclasses.replace(prep, attn_merge=True)},
                           "attn_merge")
    assert_close(outs["on"][0], outs["off"][0], jnp.bfloat16)


def test_merge_is_off_by_default():
    assert AM.takes(CFG) and AM.takes(QWEN38_27B) and not AM.takes(TEST_SMALL)
    assert not AM.takes(dataclasses.replace(QWEN38_27B, head_dim=192))
    assert not AM.takes(dataclasses.replace(QWEN38_27B, num_heads=68))  # 17 a KV head
    assert not KernelPlan().attn_merge
    assert not any(p.attn_merge for p in PRESETS.values())


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_gated_attend_gpu_27b_heads(kv_dtype):
    """At the 27B's heads (24 on 4 KV heads of 256) over 40 pages of 64: the model path's
    values, and row 0's bits alone and beside another row."""
    assert on_gpu()
    rng = np.random.default_rng()
    pool, table, q, last = _paged_case(rng, kv_dtype, 2, layers=2, pages=80, page=64, kvh=4,
                                       hd=256, nh=24, mp=40)
    gsrc = _gsrc(rng, q)
    y, sums = paged_attend_gated(pool, table, jnp.int32(1), q, last, gsrc, 256, 512)
    want_y, want_sums = _gated_ref(pool, table, q, last, gsrc)
    assert_close(y[:, 0], want_y, jnp.bfloat16)
    assert_close(sums[:, 0], want_sums, jnp.bfloat16)
    alone = paged_attend_gated(pool, table[:1], jnp.int32(1), q[:1], last[:1], gsrc[:1], 256,
                               512)
    for a, b in zip(alone, (y, sums)):
        assert np.array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))


def test_gated_attend_takes_q_already_tiled():
    """heads=: q as the paged kernel's [B, kvh, 16, hd] tile (the prep kernel's pad) gives
    the plain call's bits; a q of another shape is an error."""
    rng = np.random.default_rng()
    pool, table, q, last = _paged_case(rng, "bfloat16", 2, pages=48, page=16, kvh=2, hd=128,
                                       nh=6, mp=12)
    gsrc = _gsrc(rng, q)
    tile = jnp.pad(q[:, 0].reshape(2, 2, 3, 128), ((0, 0), (0, 0), (0, 13), (0, 0)))
    plain = paged_attend_gated(pool, table, jnp.int32(1), q, last, gsrc, 128, 256,
                               interpret=True, programs=8)
    tiled = paged_attend_gated(pool, table, jnp.int32(1), tile, last, gsrc, 128, 256,
                               heads=6, interpret=True, programs=8)
    for a, b in zip(plain, tiled):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="padded q"):
        paged_attend_gated(pool, table, jnp.int32(1), tile[:, :, :8], last, gsrc, 128, 256,
                           heads=6, interpret=True)
