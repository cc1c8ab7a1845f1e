"""The fused GDN decode step (engine/kernels/gdn_decode_fused.py) against its reference
`engine.ops.gdn.gdn_core`: in the Pallas interpreter on CPU (tiny and 27B head shapes, fp32 and
bf16 activations, rows with and without a token), lowered for CUDA, and on the GPU (-m gpu)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels.gdn_decode_fused import gdn_decode_fused, gdn_decode_fused_ref
from engine.model.config import QWEN38_27B, preset
from engine.plan import PALLAS, REFERENCE, PlanError
from tests.kernel_checks import assert_close, lowers_for_cuda, on_gpu


def _inputs(rng, cfg, b, dtype, lengths):
    def f(*shape, scale=1.0, dt=dtype):
        return jnp.asarray(rng.standard_normal(shape) * scale, dt)

    hv = cfg.linear_num_value_heads
    p = {"conv1d": f(cfg.conv_dim, cfg.linear_conv_kernel, scale=0.5),
         "A_log": f(hv, scale=0.5, dt=jnp.float32), "dt_bias": f(hv),
         "norm": f(cfg.linear_value_head_dim)}
    lengths = jnp.asarray(lengths, jnp.int32)
    return (p, cfg, f(b, 1, cfg.conv_dim), f(b, 1, cfg.value_dim), f(b, 1, hv), f(b, 1, hv),
            f(b, cfg.conv_dim, cfg.linear_conv_kernel - 1),
            f(b, hv, cfg.linear_key_head_dim, cfg.linear_value_head_dim, scale=0.1,
              dt=jnp.float32),
            lengths, jnp.arange(1)[None, :] < lengths[:, None])


def _check(args, dtype, **kw):
    got = gdn_decode_fused(*args, "recurrent", PALLAS, dtype, **kw)
    want = gdn_decode_fused_ref(*args, "recurrent", REFERENCE, dtype)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_close(g, w, dtype)
    return got, want


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_matches_gdn_core(dtype):
    cfg = preset("tiny")
    args = _inputs(np.random.default_rng(), cfg, 3, dtype, [1, 0, 1])
    (out, conv, rec), _ = _check(args, dtype, interpret=True)
    # the row without a token keeps both states exactly
    assert np.array_equal(np.asarray(conv[1]), np.asarray(args[6][1]))
    assert np.array_equal(np.asarray(rec[1]), np.asarray(args[7][1]))
    # and the others moved
    assert not np.array_equal(np.asarray(rec[0]), np.asarray(args[7][0]))


def test_fused_matches_at_27b_heads():
    """16 key heads serving 48 value heads (three programs read each key head's window, one
    writes it), 128-wide heads, width-4 conv, two rows."""
    args = _inputs(np.random.default_rng(1), QWEN38_27B, 2, jnp.float32, [1, 1])
    _check(args, jnp.float32, interpret=True)


def test_fused_rejects_more_than_one_step():
    cfg = preset("tiny")
    p, _, qkv, z, b_in, a_in, cs, rs, lengths, valid = _inputs(
        np.random.default_rng(2), cfg, 1, jnp.float32, [1])
    with pytest.raises(ValueError, match="T == 1"):
        gdn_decode_fused(p, cfg, jnp.concatenate([qkv, qkv], 1), z, b_in, a_in, cs, rs,
                         lengths, valid, "recurrent", PALLAS, jnp.float32, interpret=True)


def test_fused_lowers_to_triton():
    p, cfg, *arrays = _inputs(np.random.default_rng(3), QWEN38_27B, 1, jnp.bfloat16, [1])
    lowers_for_cuda(lambda p, *a: gdn_decode_fused(p, cfg, *a, "recurrent", PALLAS,
                                                   jnp.bfloat16, interpret=False), p, *arrays)


def _tiny_model_after_prefill(seed: int):
    """The tiny model (params from `seed`), a 2-row cache after a 5-token prefill on the
    reference path, and the next decode step's tokens."""
    import engine.model.model as M
    from engine.model.params import random_flat_params, stack_params

    cfg = preset("tiny")
    params = stack_params(random_flat_params(cfg, seed=seed), cfg)
    cache = M.init_cache(cfg, 2, 64, jnp.float32)
    toks = jnp.asarray(np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, (2, 5)),
                       jnp.int32)
    _, _, cache = M.forward(params, cfg, toks, cache, plan=REFERENCE)
    return cfg, params, cache, jnp.asarray([[7], [11]], jnp.int32)


def test_model_decode_with_fused_kernel_matches():
    """The whole tiny model's decode step with the fused kernel (the pallas plan) against the
    reference path, and gdn_decode "pallas" (the recurrent kernel alone) not running it."""
    import engine.model.model as M

    cfg, params, cache, step = _tiny_model_after_prefill(5)
    want, _, wc = M.forward(params, cfg, step, cache, plan=REFERENCE)
    def traced(plan):
        return str(jax.make_jaxpr(lambda c: M.forward(params, cfg, step, c, plan=plan))(
            cache))
    assert "gdn_decode_fused" not in traced(dataclasses.replace(PALLAS, gdn_decode="pallas"))
    assert "gdn_decode_fused" in traced(PALLAS)  # the pallas plan: the fused kernel runs
    got, _, gc = M.forward(params, cfg, step, cache, plan=PALLAS)
    assert_close(got, want, jnp.float32)
    for g, w in zip(jax.tree.leaves(gc), jax.tree.leaves(wc)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_on_gpu_27b_heads(dtype):
    assert on_gpu()
    args = _inputs(np.random.default_rng(), QWEN38_27B, 2, dtype, [1, 0])
    _check(args, dtype)


def test_fused_rows_do_not_depend_on_each_other():
    """Batch invariance: a row's output and states are bit for bit the same alone or beside
    another row (one program per row and head, no sum across rows)."""
    cfg = preset("tiny")
    p, _, *two = _inputs(np.random.default_rng(5), cfg, 2, jnp.float32, [1, 1])
    qkv, z, b_in, a_in, cs, rs, lengths, valid = two
    both = gdn_decode_fused(p, cfg, *two, "recurrent", PALLAS, jnp.float32, interpret=True)
    one = gdn_decode_fused(p, cfg, qkv[:1], z[:1], b_in[:1], a_in[:1], cs[:1], rs[:1],
                           lengths[:1], valid[:1], "recurrent", PALLAS, jnp.float32,
                           interpret=True)
    for a, b in zip(one, both):
        assert np.array_equal(np.asarray(a[0]), np.asarray(b[0]))


def _stacked_case(rng, cfg, dtype, lengths, lead=(3, 2)):
    """One layer's inputs plus state stacks [*lead, B, ...] that hold other layers' states
    around it."""
    p, _, qkv, z, b_in, a_in, cs, rs, lens, valid = _inputs(rng, cfg, len(lengths), dtype,
                                                            lengths)
    conv_all = jnp.asarray(rng.standard_normal(lead + cs.shape), cs.dtype)
    rec_all = jnp.asarray(rng.standard_normal(lead + rs.shape) * 0.1, jnp.float32)
    return p, qkv, z, b_in, a_in, conv_all, rec_all, lens, valid


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_stacked_states_in_place_are_the_sliced_call(dtype):
    """gdn_decode_fused_stacked at layer (2, 1) of [3, 2] stacks: bit for bit the sliced
    call's output and states; every other layer's states untouched."""
    from engine.kernels.gdn_decode_fused import gdn_decode_fused_stacked

    cfg = preset("tiny")
    p, qkv, z, b_in, a_in, conv_all, rec_all, lens, valid = _stacked_case(
        np.random.default_rng(6), cfg, dtype, [1, 0])
    want = gdn_decode_fused(p, cfg, qkv, z, b_in, a_in, conv_all[2, 1], rec_all[2, 1], lens,
                            valid, "recurrent", PALLAS, dtype, interpret=True)
    before = np.asarray(rec_all)
    out, conv, rec = gdn_decode_fused_stacked(p, cfg, qkv, z, b_in, a_in, conv_all, rec_all,
                                              jnp.int32(2 * 2 + 1), lens, dtype,
                                              interpret=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(conv, np.float32), np.asarray(want[1], np.float32))
    rec = np.array(rec)
    np.testing.assert_array_equal(rec[2, 1], np.asarray(want[2]))
    rec[2, 1] = before[2, 1]
    np.testing.assert_array_equal(rec, before)


@pytest.mark.gpu
def test_stacked_states_in_place_on_gpu_27b_heads():
    from engine.kernels.gdn_decode_fused import gdn_decode_fused_stacked

    assert on_gpu()
    p, qkv, z, b_in, a_in, conv_all, rec_all, lens, valid = _stacked_case(
        np.random.default_rng(9), QWEN38_27B, jnp.bfloat16, [1, 1], lead=(2, 3))
    want = gdn_decode_fused(p, QWEN38_27B, qkv, z, b_in, a_in, conv_all[1, 2], rec_all[1, 2],
                            lens, valid, "recurrent", PALLAS, jnp.bfloat16)
    got = gdn_decode_fused_stacked(p, QWEN38_27B, qkv, z, b_in, a_in, conv_all, rec_all,
                                   jnp.int32(5), lens, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[2][1, 2]), np.asarray(want[2]))


def test_stacked_lowers_to_triton():
    from engine.kernels.gdn_decode_fused import gdn_decode_fused_stacked

    p, qkv, z, b_in, a_in, conv_all, rec_all, lens, _ = _stacked_case(
        np.random.default_rng(10), QWEN38_27B, jnp.bfloat16, [1])
    lowers_for_cuda(lambda p, *a: gdn_decode_fused_stacked(p, QWEN38_27B, *a, jnp.bfloat16,
                                                           interpret=False),
                    p, qkv, z, b_in, a_in, conv_all, rec_all, jnp.int32(3), lens)


@pytest.mark.parametrize("split", [2, 4])
def test_split_heads_match_gdn_core_and_keep_the_other_layers(split):
    """split: each value head's state over `split` programs by its Dv
    columns, the output norm in XLA after the kernel. Against the reference (tiny heads,
    a row without a token keeping its states exactly) and, on stacks, against the one-program
    kernel: the states bit for bit (each column's update does not depend on the others), the
    output within rounding (the norm's sum in another order), other layers untouched."""
    from engine.kernels.gdn_decode_fused import gdn_decode_fused_stacked

    cfg = preset("tiny")
    args = _inputs(np.random.default_rng(11), cfg, 3, jnp.float32, [1, 0, 1])
    (out, conv, rec), _ = _check(args, jnp.float32, interpret=True, split=split)
    assert np.array_equal(np.asarray(rec[1]), np.asarray(args[7][1]))
    assert np.array_equal(np.asarray(conv[1]), np.asarray(args[6][1]))
    p, qkv, z, b_in, a_in, conv_all, rec_all, lens, _ = _stacked_case(
        np.random.default_rng(12), cfg, jnp.bfloat16, [1, 1])
    before = np.asarray(rec_all)
    one, many = (gdn_decode_fused_stacked(p, cfg, qkv, z, b_in, a_in, conv_all, rec_all,
                                          jnp.int32(3), lens, jnp.bfloat16, interpret=True,
                                          split=s) for s in (1, split))
    assert_close(many[0], one[0], jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(many[1], np.float32), np.asarray(one[1], np.float32))
    np.testing.assert_array_equal(np.asarray(many[2]), np.asarray(one[2]))
    rec = np.array(many[2])
    rec[1, 1] = before[1, 1]  # flat layer 3 of [3, 2]
    np.testing.assert_array_equal(rec, before)


def test_split_at_27b_heads_lowers_and_rejects_a_bad_split():
    """The 27B's heads split in 4 (192 programs a row): the reference in the interpreter, the
    Triton lowering for CUDA, the in-place decode path's default split, and a split that does
    not divide Dv is an error."""
    from engine.kernels.gdn_decode_fused import DEFAULT_SPLIT, gdn_decode_fused_stacked

    args = _inputs(np.random.default_rng(13), QWEN38_27B, 1, jnp.float32, [1])
    _check(args, jnp.float32, interpret=True, split=4)
    p, qkv, z, b_in, a_in, conv_all, rec_all, lens, _ = _stacked_case(
        np.random.default_rng(14), QWEN38_27B, jnp.bfloat16, [1])
    lowers_for_cuda(lambda p, *a: gdn_decode_fused_stacked(p, QWEN38_27B, *a, jnp.bfloat16,
                                                           interpret=False, split=4),
                    p, qkv, z, b_in, a_in, conv_all, rec_all, jnp.int32(3), lens)
    assert DEFAULT_SPLIT == 2  # the in-place decode path's split (H200 v24d)
    with pytest.raises(ValueError, match="divide Dv"):
        gdn_decode_fused(*args, "recurrent", PALLAS, jnp.float32, interpret=True, split=3)


def test_model_decode_with_split_heads_matches():
    """The tiny model's in-place decode step (split in DEFAULT_SPLIT = 2 programs a head)
    against the reference path."""
    import engine.model.model as M

    cfg, params, cache, step = _tiny_model_after_prefill(15)
    want, _, wc = M.forward(params, cfg, step, cache, plan=REFERENCE)
    got, _, gc = M.forward(params, cfg, step, jax.tree.map(jnp.copy, cache), plan=PALLAS)
    assert_close(got, want, jnp.float32)
    for g, w in zip(jax.tree.leaves(gc), jax.tree.leaves(wc)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_split_heads_on_gpu_27b_heads():
    """On the GPU: the split kernels (4 programs a head of 8 and 4 warps, 2 of 4 warps: the
    in-place path's default) against the one-program kernel at the 27B's heads, two rows (one
    without a token): the conv state bit for bit, the recurrent state within fp32 rounding
    (Triton may sum a narrower tile's columns in another order), the output within bf16
    rounding."""
    from engine.kernels.gdn_decode_fused import gdn_decode_fused_stacked

    assert on_gpu()
    p, qkv, z, b_in, a_in, conv_all, rec_all, lens, _ = _stacked_case(
        np.random.default_rng(16), QWEN38_27B, jnp.bfloat16, [1, 0], lead=(2, 3))
    one = gdn_decode_fused_stacked(p, QWEN38_27B, qkv, z, b_in, a_in, conv_all,
                                   jnp.copy(rec_all), jnp.int32(4), lens, jnp.bfloat16, split=1)
    for split, warps in ((4, 8), (2, 4), (4, 4)):  # (2, 4): the in-place path's default
        many = gdn_decode_fused_stacked(p, QWEN38_27B, qkv, z, b_in, a_in, conv_all,
                                        jnp.copy(rec_all), jnp.int32(4), lens, jnp.bfloat16,
                                        split=split, num_warps=warps)
        assert_close(many[0], one[0], jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(many[1], np.float32),
                                      np.asarray(one[1], np.float32))
        assert_close(many[2], one[2], jnp.float32)


def _rows_call(cfg, dtype, seed, lengths, *, interpret=True, **kw):
    """gdn_decode_fused_rows at layer (1, 0) of [3, 2] stacks, its parameters stacked."""
    from engine.kernels.gdn_decode_fused import KERNEL_PARAMS, gdn_decode_fused_rows

    p, qkv, z, b_in, a_in, conv_all, rec_all, lens, _ = _stacked_case(
        np.random.default_rng(seed), cfg, dtype, lengths)
    params = {k: jnp.broadcast_to(p[k], (3, 2, *p[k].shape)) for k in KERNEL_PARAMS}
    proj = jnp.concatenate([qkv, z, b_in, a_in], axis=-1)
    return conv_all, lambda **more: gdn_decode_fused_rows(
        params, cfg, proj, conv_all, rec_all, jnp.int32(2), lens, dtype, interpret=interpret,
        **kw, **more)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_conv_state_written_into_a_second_stack(dtype):
    """conv_out: the layer's new conv state lands in its slot of the second stack, bit for bit
    the state the kernel returns alone (a row without a token keeps its window); every other
    slot of that stack keeps what it held; the stack read is untouched."""
    conv_all, call = _rows_call(preset("tiny"), dtype, 12, [1, 0])
    before = np.asarray(conv_all, np.float32)
    out, conv_l, rec, _ = call()
    other = jnp.asarray(np.random.default_rng(13).standard_normal(conv_all.shape),
                        conv_all.dtype)
    other_np = np.asarray(other, np.float32)
    out2, stack, rec2, _ = call(conv_out=other)
    for a, b in ((out, out2), (rec, rec2)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    stack = np.array(stack, np.float32)
    np.testing.assert_array_equal(stack[1, 0], np.asarray(conv_l, np.float32))
    np.testing.assert_array_equal(stack[1, 0, 1], before[1, 0, 1])  # the idle row's window
    stack[1, 0] = other_np[1, 0]
    np.testing.assert_array_equal(stack, other_np)
    np.testing.assert_array_equal(np.asarray(conv_all, np.float32), before)
    with pytest.raises(ValueError, match="conv_out"):
        call(conv_out=other[:2])


def test_conv_out_lowers_to_triton():
    conv_all, call = _rows_call(QWEN38_27B, jnp.bfloat16, 14, [1], interpret=False)
    lowers_for_cuda(lambda c: call(conv_out=c)[1], conv_all)


def test_model_decode_with_the_conv_stacks_swapped_is_the_copy_path():
    """gdn_conv_write "swap": the tiny model's decode step (one row without a token)
    reading the cache's conv stack and writing a second one in place gives the same logits
    and cache, bit for bit, as "copy" (the pallas plan's: a copy into the stack a layer),
    with no dynamic-update-slice of the conv stack left; an unknown setting is an error."""
    import engine.model.model as M

    cfg, params, cache, step = _tiny_model_after_prefill(8)
    lengths = jnp.asarray([1, 0], jnp.int32)
    copy = dataclasses.replace(PALLAS, gdn_conv_write="copy")
    swap = dataclasses.replace(PALLAS, gdn_conv_write="swap")

    def run(plan):
        return M.forward(params, cfg, step, jax.tree.map(jnp.copy, cache), lengths=lengths,
                         plan=plan)

    def hlo(plan):
        return jax.jit(lambda c: M.forward(params, cfg, step, c, lengths=lengths,
                                           plan=plan)).lower(cache).as_text()

    # the copy: one layer's state [1, B, conv_dim, W - 1] into the stack flattened to
    # [layers, B, conv_dim, W - 1] (the interpreter's own updates write other shapes)
    c = cache.conv.shape
    flat = "tensor<" + "x".join(str(d) for d in (int(np.prod(c[:-3])), *c[-3:]))
    one = "tensor<" + "x".join(str(d) for d in (1, *c[-3:]))

    def conv_updates(text):
        return sum("dynamic_update_slice" in line and flat in line and one in line
                   for line in text.splitlines())

    want = run(copy)
    assert conv_updates(hlo(copy)) >= 1
    got = run(swap)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    assert conv_updates(hlo(swap)) == 0
    with pytest.raises(PlanError, match="gdn_conv_write"):
        dataclasses.replace(PALLAS, gdn_conv_write="swapped")


@pytest.mark.gpu
def test_conv_state_into_a_second_stack_on_gpu_27b_heads():
    assert on_gpu()
    conv_all, call = _rows_call(QWEN38_27B, jnp.bfloat16, 15, [1, 0], interpret=None)
    _, conv_l, _, _ = call()
    _, stack, _, _ = call(conv_out=jnp.zeros_like(conv_all))
    np.testing.assert_array_equal(np.asarray(stack[1, 0], np.float32),
                                  np.asarray(conv_l, np.float32))
