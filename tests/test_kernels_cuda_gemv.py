"""The CUDA int4_g64 GEMV (engine/kernels/cuda_ops.py, XLA FFI) against the reference
`quant.linear`. It runs only on a GPU (-m gpu), built and registered by `cuda_ops.require`
for the h200 plan (engine/plan.py); on the CPU the tests check that it lowers to its FFI call
for CUDA, that `require` refuses this machine, and that `qmatmul` uses the Pallas kernel
unless asked for the CUDA op (a plan's gemv "cuda")."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from engine.kernels import cuda_ops, qgemv
from engine.kernels.stacked import Stacked
from engine.plan import H200, PALLAS
from engine.quant import linear, quantize
from tests.kernel_checks import assert_close, on_gpu


def _require_cuda():
    """On the GPU: the CUDA ops built and registered as the h200 plan builds them (a failed
    build fails the test with its reason)."""
    assert on_gpu()
    cuda_ops.require(H200)


def _qtensor(n, k, seed, lead=()):
    rng = np.random.default_rng(seed)
    mats = [quantize((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), "int4_g64")
            for _ in range(int(np.prod(lead, dtype=np.int64)))]
    data = np.stack([q.data for q in mats]).reshape(*lead, n, k // 2)
    scale = np.stack([q.scale for q in mats]).reshape(*lead, n, k // 64)
    return type(mats[0])(jnp.asarray(data), jnp.asarray(scale), "int4_g64", (n, k))


@pytest.mark.parametrize("variant,target", [("mma", cuda_ops.INT4_MMA_TARGET),
                                            ("wide", cuda_ops.INT4_WIDE_TARGET),
                                            ("fma", cuda_ops.INT4_TARGET)])
def test_lowers_to_its_ffi_call_for_cuda(variant, target):
    w = _qtensor(64, 128, 0, lead=(2,))
    x = jnp.ones((1, 128), jnp.bfloat16)
    exp = export.export(
        jax.jit(lambda x, w, i: cuda_ops.int4_gemv(x, w, i, variant=variant)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(
        x, w, jnp.array([1], jnp.int32))
    assert target in exp.mlir_module()
    assert exp.out_avals[0].shape == (1, 64) and exp.out_avals[0].dtype == jnp.bfloat16


def test_wide_falls_back_where_k_is_not_a_multiple_of_128():
    """The default for bf16 x is the wide kernel; K = 192 (3 groups) cannot pair its groups:
    one row of x takes the fma kernel, three the mma one."""
    w = _qtensor(64, 192, 0)
    for m, target in ((1, cuda_ops.INT4_TARGET), (3, cuda_ops.INT4_MMA_TARGET),
                      (4, cuda_ops.INT4_MMA_TARGET)):
        exp = export.export(jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w)), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(
            jnp.ones((m, 192), jnp.bfloat16), w)
        assert target in exp.mlir_module() and cuda_ops.INT4_WIDE_TARGET not in exp.mlir_module()


def test_unknown_variant_is_a_clear_error():
    """A kernel name the op does not have (a typo, or one since removed such as "tma") is a
    ValueError naming the choices, not a silent fall back to another kernel."""
    w = _qtensor(64, 128, 0)
    x = jnp.ones((1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="must be one of"):
        cuda_ops.int4_gemv(x, w, variant="tma")


def test_variant_choice():
    one, two = jnp.ones((1, 128), jnp.bfloat16), jnp.ones((2, 128), jnp.bfloat16)
    five = jnp.ones((5, 128), jnp.bfloat16)
    assert cuda_ops.default_variant(one) == "wide" and cuda_ops.default_variant(two) == "wide"
    assert cuda_ops.default_variant(five) == "mma"
    assert cuda_ops.default_variant(two.astype(jnp.float32)) == "fma"
    assert not cuda_ops.worthwhile([_qtensor(64, 128, 0)]) and cuda_ops.MIN_ROWS > 64
    assert cuda_ops.worthwhile([_qtensor(64, 128, 0)] * (cuda_ops.MIN_ROWS // 64))


def test_wide_warps_setting_and_auto_choice():
    """The wide kernel's warps a tile: a setting of 2, 4, 8, 10 or 16, or "auto", by the number
    of 16-row tiles only (the fewer of WIDE_AUTO_CHOICES that still gives WIDE_AUTO_WARPS in
    all), or "auto:a,b" from the choices it names."""
    assert [cuda_ops.wide_warps(34816, s) for s in ("2", "4", "8", "10", "16")] == \
        [2, 4, 8, 10, 16]
    for bad in ("3", "auto:4,6"):
        with pytest.raises(ValueError, match="warps"):
            cuda_ops.wide_warps(34816, bad)
    assert [cuda_ops.wide_warps(n, "auto:10,4") for n in (34816, 16480, 6144, 5120)] == \
        [4, 4, 10, 10]
    choices = cuda_ops.WIDE_AUTO_CHOICES
    for n in (48, 1024, 5120, 14336, 16480, 34816, 248320):
        w = cuda_ops.wide_warps(n, "auto")
        tiles = -(-n // 16)
        assert w in choices and set(choices) <= set(cuda_ops.WIDE_WARPS)
        assert tiles * w >= cuda_ops.WIDE_AUTO_WARPS or w == choices[-1]
        assert w == choices[0] or tiles * choices[choices.index(w) - 1] < cuda_ops.WIDE_AUTO_WARPS
    # the step's shapes: many tiles 4 warps, few 8 (the fastest of each, H200 v12)
    assert [cuda_ops.wide_warps(n) for n in (248320, 34816, 16480, 14336, 6144, 5120)] == \
        [4, 4, 4, 4, 8, 8]


@pytest.mark.gpu
def test_wide_auto_warps_is_the_explicit_choice_on_gpu():
    """The wide kernel's default warps ("auto") are the warps `wide_warps` names: the same
    bits as asking for them."""
    _require_cuda()
    w = _qtensor(5120, 1024, 7)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 1024)), jnp.bfloat16)
    auto = jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="wide"))(x, w)
    explicit = jax.jit(lambda x, w: cuda_ops.int4_gemv(
        x, w, variant="wide", warps=cuda_ops.wide_warps(5120, "auto")))(x, w)
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(explicit, np.float32))


def test_cpu_uses_the_pallas_kernel():
    """Here `require` refuses a plan with the CUDA ops, saying why (no fallback to another
    kernel), and `qmatmul` (the pallas plan's GEMV) runs the Pallas kernel."""
    if on_gpu():
        pytest.skip("CPU behaviour")
    with pytest.raises(cuda_ops.CudaUnavailable, match="no GPU"):
        cuda_ops.require(H200)
    assert cuda_ops.library_digest(H200) is None
    w = _qtensor(32, 128, 1)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 128)), jnp.float32)
    assert_close(qgemv.qmatmul(x, w), linear(x, w), jnp.float32)


def test_supported_shapes():
    w = _qtensor(32, 128, 3)
    assert cuda_ops.supported(jnp.ones((1, 128)), w)
    assert cuda_ops.supported(jnp.ones((2, 4, 128)), w)      # M = 8
    assert not cuda_ops.supported(jnp.ones((9, 128)), w)     # M > 8
    assert not cuda_ops.supported(jnp.ones((1, 128)), w, lead=1)


MMA_CASES = [  # (M, N, K, copy stages)
    (1, 37, 64, 4), (1, 4096, 5120, 6), (2, 4096, 5120, 12), (3, 1000, 17408, 8),
    (4, 999, 6144, 4), (5, 517, 192, 6), (8, 2048, 5120, 6), (7, 300, 1024, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,stages", MMA_CASES)
def test_tensor_core_variant_matches_reference_on_gpu(m, n, k, stages):
    _require_cuda()
    w = _qtensor(n, k, m * n + k)
    x = jnp.asarray(np.random.default_rng(k + m).standard_normal((m, k)) + 0.5, jnp.bfloat16)
    got = jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="mma", stages=stages))(x, w)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    with jax.default_matmul_precision("highest"):
        ref = linear(x.astype(jnp.float32), w)  # exact products of the same bf16 x and codes
    from tests.kernel_checks import rel_err

    assert rel_err(got, ref) < 4e-3  # the bf16 rounding of the output, not of the products


WIDE_CASES = [  # (M, N, K, prefetch pairs): K multiples of 128; N not of 16 too
    (1, 37, 128, 2), (1, 4096, 5120, 2), (1, 4096, 5120, 4), (2, 4096, 5120, 2),
    (3, 1000, 17408, 4), (4, 999, 6144, 2), (1, 248, 384, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,prefetch", WIDE_CASES)
def test_wide_tensor_core_variant_matches_reference_on_gpu(m, n, k, prefetch):
    """The wide kernel (16-byte loads, two groups per MMA kept apart by B's columns, x
    permuted in registers) against the fp32 reference, with the codes' offset taken off by
    group sums of x (the default) and by MMAs; x is bf16, as the tensor cores take it."""
    _require_cuda()
    w = _qtensor(n, k, k + n)
    x = jnp.asarray(np.random.default_rng(m + n).standard_normal((m, k)), jnp.bfloat16)
    got = jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="wide", prefetch=prefetch))(
        x, w)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    with jax.default_matmul_precision("highest"):
        want = linear(x.astype(jnp.float32), w)
    assert_close(got, want, jnp.bfloat16)
    # the prefetch depth changes when codes load, not what is summed: the same bits
    other = jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="wide",
                                                    prefetch=6 - prefetch))(x, w)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(other, np.float32))
    # every warps setting (2 .. 16) to a tile: other partial sums, the same result within
    # bf16; with registers capped for 32 warps an SM (prefetch 2 only): the same bits
    for warps in cuda_ops.WIDE_WARPS:
        other_w = jax.jit(lambda x, w, wp=warps: cuda_ops.int4_gemv(
            x, w, variant="wide", prefetch=prefetch, warps=wp))(x, w)
        assert_close(other_w, want, jnp.bfloat16)
        if prefetch == 2:
            capped = jax.jit(lambda x, w, wp=warps: cuda_ops.int4_gemv(
                x, w, variant="wide", prefetch=2, warps=wp, occupancy=32))(x, w)
            np.testing.assert_array_equal(np.asarray(capped, np.float32),
                                          np.asarray(other_w, np.float32))
        if prefetch == 2 and warps in cuda_ops.WIDE_XPERM_WARPS:
            # x permuted by the caller: the same B registers, the same bits
            permuted = jax.jit(lambda x, w, wp=warps: cuda_ops.int4_gemv(
                x, w, variant="wide", prefetch=2, warps=wp, occupancy=32, xperm=True))(x, w)
            np.testing.assert_array_equal(np.asarray(permuted, np.float32),
                                          np.asarray(capped, np.float32))
        # the shared-memory ring: the same pairs per warp in the same order, the same bits
        for stages in ((4, 8) if warps in (4, 8) else ()):
            ring = jax.jit(lambda x, w, wp=warps, st=stages: cuda_ops.int4_gemv(
                x, w, variant="wide", warps=wp, stages=st))(x, w)
            np.testing.assert_array_equal(np.asarray(ring, np.float32),
                                          np.asarray(other_w, np.float32))
    # the codes' offset taken off by MMAs inside the kernel in place of XLA's group sums
    mmas = jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="wide", prefetch=prefetch,
                                                   bias=1))(x, w)
    assert_close(mmas, want, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [2, 4, 8])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 5120), (2, 1000, 17408), (3, 37, 64),
                                   (8, 517, 192), (1, 2048, 8 * 64 * 5 + 64)])
def test_register_prefetch_kernel_is_bitwise_the_ring_on_gpu(prefetch, m, n, k):
    """The tensor-core kernel that loads codes and scales into registers `prefetch` groups
    ahead gives the copy-ring kernel's sums bit for bit (same groups per warp in the same
    order, same MMAs, same reduction), for group counts per warp below, at and past P, N not
    a multiple of 16, every M, and a layer of a stack."""
    _require_cuda()
    w = _qtensor(n, k, 7 * m + n + k)
    x = jnp.asarray(np.random.default_rng(m + k).standard_normal((m, k)) + 0.25, jnp.bfloat16)
    ring = jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="mma", prefetch=0))(x, w)
    got = jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="mma", prefetch=prefetch))(
        x, w)
    assert np.array_equal(np.asarray(got, np.float32), np.asarray(ring, np.float32))
    with jax.default_matmul_precision("highest"):
        ref = linear(x.astype(jnp.float32), w)
    from tests.kernel_checks import rel_err

    assert rel_err(got, ref) < 4e-3
    stack = jax.tree.map(lambda a: jnp.stack([a[::-1], a]), w)  # layer 1 is w itself
    got1 = jax.jit(lambda x, s, i: cuda_ops.int4_gemv(x, s, i, variant="mma",
                                                      prefetch=prefetch))(
        x, stack, jnp.array([1], jnp.int32))
    assert np.array_equal(np.asarray(got1, np.float32), np.asarray(ring, np.float32))


GPU_CASES = [  # (M, N, K, x dtype, rows per warp)
    (1, 37, 64, jnp.float32, 1), (1, 4096, 5120, jnp.bfloat16, 2), (2, 4096, 5120,
                                                                     jnp.bfloat16, 2),
    (1, 1000, 17408, jnp.float32, 4), (2, 999, 6144, jnp.float32, 4),
    (3, 517, 192, jnp.bfloat16, 2), (4, 2048, 5120, jnp.float32, 2),
    (5, 300, 1024, jnp.bfloat16, 1), (8, 256, 5120, jnp.float32, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,dtype,rpw", GPU_CASES)
def test_matches_reference_on_gpu(m, n, k, dtype, rpw):
    _require_cuda()
    w = _qtensor(n, k, m + n + k)
    x = jnp.asarray(np.random.default_rng(k).standard_normal((m, k)), dtype)
    got = jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, rows_per_warp=rpw, variant="fma"))(
        x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    with jax.default_matmul_precision("highest"):  # no TF32 in the fp32 reference
        ref = linear(x.astype(jnp.float32), w)  # the kernel dequantizes exactly
    assert_close(got, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["mma", "wide", "fma"])
@pytest.mark.parametrize("lead,index", [((3,), (2,)), ((2, 3), (1, 2))])
def test_reads_a_layer_of_a_stack_on_gpu(lead, index, variant):
    _require_cuda()
    w = _qtensor(512, 1024, 7, lead=lead)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((2, 1024)), jnp.bfloat16)
    idx = jnp.asarray(index, jnp.int32)
    got = jax.jit(lambda x, w, i: cuda_ops.int4_gemv(x, w, i, variant=variant))(x, w, idx)
    with jax.default_matmul_precision("highest"):
        want = linear(x.astype(jnp.float32), Stacked(w, idx).materialize())
    assert_close(got, want, jnp.bfloat16)


@pytest.mark.gpu
def test_qmatmul_sends_large_int4_matrices_to_cuda_on_gpu(monkeypatch):
    """qmatmul's dispatch with cuda=True (a plan's gemv "cuda"): N >= MIN_ROWS goes to the
    CUDA op, smaller N to Pallas."""
    _require_cuda()
    calls = []
    real = cuda_ops.int4_gemv
    monkeypatch.setattr(cuda_ops, "int4_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = jnp.asarray(np.random.default_rng(9).standard_normal((1, 1024)), jnp.bfloat16)
    big = _qtensor(cuda_ops.MIN_ROWS, 1024, 12, lead=(2,))
    idx = jnp.array([1], jnp.int32)
    got = qgemv.qmatmul(x, big, idx, cuda=True)
    assert calls == [1]
    with jax.default_matmul_precision("highest"):
        want = linear(x.astype(jnp.float32), Stacked(big, idx).materialize())
    assert_close(got, want, jnp.bfloat16)
    qgemv.qmatmul(x, _qtensor(64, 1024, 13), cuda=True)
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("variant,k", [("mma", 5120), ("wide", 5120), ("fma", 5120),
                                       ("wide", 17408), ("wide", 23040)])
def test_batch_invariant_and_deterministic_on_gpu(variant, k):
    """A row's result is bitwise the same whatever the other rows of x and however many. For
    the wide kernel one row stages x in shared memory (K up to 20480: 5120, and down's 17408)
    where more rows read it through L1, so this is also that the two paths' B registers
    agree; past that K (23040) both read it through L1."""
    _require_cuda()
    w = _qtensor(3000, k, 9)
    rng = np.random.default_rng(10)
    x2 = jnp.asarray(rng.standard_normal((2, k)), jnp.bfloat16)
    one = np.asarray(cuda_ops.int4_gemv(x2[:1], w, variant=variant), np.float32)
    two = np.asarray(cuda_ops.int4_gemv(x2, w, variant=variant), np.float32)
    again = np.asarray(cuda_ops.int4_gemv(x2, w, variant=variant), np.float32)
    four = np.asarray(cuda_ops.int4_gemv(jnp.concatenate([x2, x2[::-1]]), w, variant=variant,
                                         rows_per_warp=1), np.float32)
    assert np.array_equal(one[0], two[0]) and np.array_equal(two, again)
    assert np.array_equal(four[0], two[0]) and np.array_equal(four[3], two[0])


@pytest.mark.gpu
def test_bad_rows_per_warp_is_an_error_on_gpu():
    _require_cuda()
    w = _qtensor(64, 128, 11)
    with pytest.raises(Exception, match="invalid argument|int4_gemv"):
        jax.block_until_ready(cuda_ops.int4_gemv(jnp.ones((8, 128), jnp.float32), w,
                                                 rows_per_warp=4))
    with pytest.raises(Exception, match="invalid argument|int4_gemv"):
        jax.block_until_ready(cuda_ops.int4_gemv(jnp.ones((1, 128), jnp.bfloat16), w,
                                                 variant="mma", stages=3))


def test_multi_lowers_to_one_call_and_cpu_keeps_separate_linears():
    """A layer's projections of one x: one FFI call with a (codes, scales) pair per weight for
    CUDA; with the pallas plan (no CUDA op) `linear_multi` is exactly the separate `linear`
    calls."""
    from engine.quant import linear_multi

    ws = [_qtensor(n, 128, n, lead=(2,)) for n in (64, 48, 32)]
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 128)), jnp.bfloat16)
    idx = jnp.array([1], jnp.int32)
    exp = export.export(
        jax.jit(lambda x, a, b, c, i: cuda_ops.int4_gemv_multi(x, [a, b, c], i,
                                                               variant="fma")),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(cuda_ops.INT4_TARGET)])(
        x, *ws, idx)
    text = exp.mlir_module()
    assert text.count(f"@{cuda_ops.INT4_TARGET}(") == 1
    assert [a.shape for a in exp.out_avals] == [(2, 64), (2, 48), (2, 32)]
    views = [Stacked(w, idx) for w in ws]
    got = linear_multi(x, views, PALLAS)
    for g, w in zip(got, ws):
        np.testing.assert_array_equal(np.asarray(g, np.float32),
                                      np.asarray(qgemv.qmatmul(x, w, idx), np.float32))
    with pytest.raises(ValueError, match="1..4"):
        cuda_ops.int4_gemv_multi(x, ws + ws, idx)


@pytest.mark.parametrize("bias", [0, 1])
def test_wide_call_takes_x_as_it_is_and_concat_returns_one_array(bias):
    """The wide kernel's call, lowered for CUDA: x goes in unpermuted (no transpose before the
    call), the group sums of x only with bias = 0 ([M, 0] with the bias MMAs), and concat=True
    gives the projections side by side in one array; with the pallas plan
    `linear_multi(concat=True)` is the separate linears' concatenation."""
    from engine.quant import linear_multi

    ws = [_qtensor(n, 256, n, lead=(2,)) for n in (64, 48)]
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 256)), jnp.bfloat16)
    idx = jnp.array([1], jnp.int32)
    exp = export.export(
        jax.jit(lambda x, a, b, i: cuda_ops.int4_gemv_multi(x, [a, b], i, variant="wide",
                                                            bias=bias, concat=True)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(cuda_ops.INT4_WIDE_TARGET)])(
        x, *ws, idx)
    text = exp.mlir_module()
    assert text.count(f"@{cuda_ops.INT4_WIDE_TARGET}(") == 1
    assert "stablehlo.transpose" not in text
    assert ("tensor<2x0xf32>" in text) == bool(bias)
    # registers capped for 32 warps an SM by default, where that kernel is built (bias 0)
    assert f"occupancy = {0 if bias else 32} : i64" in text
    assert "xperm = 0 : i64" in text  # x as it is unless the caller asks for xperm=True
    assert [a.shape for a in exp.out_avals] == [(2, 112)]
    views = [Stacked(w, idx) for w in ws]
    got = linear_multi(x, views, PALLAS, concat=True)
    want = jnp.concatenate([qgemv.qmatmul(x, w, idx) for w in ws], axis=-1)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fma", "mma", "wide"])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_multi_is_bitwise_the_separate_calls_on_gpu(variant, m):
    """qkv/z/b/a-like: four weights of one stack, different N (one not a multiple of 16),
    one launch; each output is bit for bit the single-weight call's."""
    _require_cuda()
    ws = [_qtensor(n, 1024, 20 + n, lead=(2, 3)) for n in (1040, 600, 48, 8)]
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 1024)), jnp.bfloat16)
    idx = jnp.array([1, 2], jnp.int32)
    got = jax.jit(lambda x, ws, i: cuda_ops.int4_gemv_multi(x, ws, i, variant=variant))(
        x, ws, idx)
    for g, w in zip(got, ws):
        one = cuda_ops.int4_gemv(x, w, idx, variant=variant)
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(one, np.float32))
        with jax.default_matmul_precision("highest"):
            want = linear(x.astype(jnp.float32), Stacked(w, idx).materialize())
        assert_close(g, want, jnp.bfloat16)


def _byte_perm(a, b, sel):
    """CUDA's __byte_perm(a, b, sel) on uint32 arrays: result byte i is byte (sel >> 4 i) & 7
    of the 8 bytes b:a (a's bytes 0-3, b's 4-7)."""
    src = np.stack([(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF
                                                               for i in range(4)])
    return sum(src[(sel >> 4 * i) & 7].astype(np.uint32) << np.uint32(8 * i) for i in range(4))


def test_x_perm_words_are_the_kernels_b_registers():
    """x_perm's 32-bit words are what the wide kernel's byte permutations make of x (inputs
    0..7 -> pairs (0, 4), (1, 5), (2, 6), (3, 7) for each 16 bytes' two uint4 halves), so the
    kernel taking x_perm reads the same B registers; the group sums do not change; with
    xperm=True the lowered call takes the permuted x and says so, by default neither."""
    x = jnp.asarray(np.random.default_rng(9).standard_normal((2, 256)), jnp.bfloat16)
    words = np.asarray(x).view(np.uint16).astype(np.uint32)
    words = (words[:, 0::2] | (words[:, 1::2] << 16)).reshape(2, -1, 4)  # uint4s of x
    xx, xy, xz, xw = (words[..., i] for i in range(4))
    want = np.stack([_byte_perm(xx, xz, 0x5410), _byte_perm(xx, xz, 0x7632),
                     _byte_perm(xy, xw, 0x5410), _byte_perm(xy, xw, 0x7632)], -1)
    got = np.asarray(cuda_ops.x_perm(x)).view(np.uint16).astype(np.uint32)
    got = (got[:, 0::2] | (got[:, 1::2] << 16)).reshape(2, -1, 4)
    np.testing.assert_array_equal(got, want)
    sums = lambda a: np.asarray(a, np.float32).reshape(2, -1, 64).sum(-1)  # noqa: E731
    np.testing.assert_allclose(sums(cuda_ops.x_perm(x)), sums(x), rtol=1e-6)

    w = _qtensor(64, 256, 5)
    for kwargs, on in (({"xperm": True}, True), ({}, False)):
        text = export.export(
            jax.jit(lambda x, w, kw=kwargs: cuda_ops.int4_gemv(x, w, variant="wide", **kw)),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(
                cuda_ops.INT4_WIDE_TARGET)])(x, w).mlir_module()
        assert f"xperm = {int(on)} : i64" in text
        assert ("stablehlo.transpose" in text) == on


def _mlp_case(m, k1=512, n1=1024, n2=1000, lead=(2,)):
    """x, h [m, ...] bf16 and stacked int4 gate / up [*lead, n1, k1], down [*lead, n2, n1]."""
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, k1)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((m, n2)), jnp.bfloat16)
    return x, h, [_qtensor(n, k, 40 + n + k, lead) for n, k in ((n1, k1), (n1, k1), (n2, n1))]


def _mlp_reference(x, h, gate, up, down, index):
    """h + down(silu(gate(x)) * up(x)), the layer's matrices dequantized, fp32 throughout."""
    from engine.quant import dequantize

    def mat(w):
        layer = type(w)(w.data[index], w.scale[index], w.fmt, w.shape[-2:])
        return dequantize(layer, jnp.float32)

    with jax.default_matmul_precision("highest"):
        xf = x.astype(jnp.float32)
        a = jax.nn.silu(xf @ mat(gate).T) * (xf @ mat(up).T)
        return h.astype(jnp.float32) + a @ mat(down).T


def test_persistent_mlp_lowers_to_one_call_and_checks_its_shapes():
    """int4_mlp lowers for CUDA to one call of the persistent kernel (three results: the
    output and the launch's two scratch arrays, of which the output alone is used) and rejects
    shapes the kernel does not take, with a clear error."""
    x, h, (gate, up, down) = _mlp_case(2)
    idx = jnp.array([1], jnp.int32)
    exp = export.export(
        jax.jit(lambda x, h, g, u, d, i: cuda_ops.int4_mlp(x, h, g, u, d, i, launches=1)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(cuda_ops.INT4_MLP_TARGET)])(
        x, h, gate, up, down, idx)
    text = exp.mlir_module()
    assert text.count(f"@{cuda_ops.INT4_MLP_TARGET}(") == 1
    assert "warps = 8 : i64" in text and "occupancy = 24 : i64" in text
    assert "launches = 1 : i64" in text
    assert [a.shape for a in exp.out_avals] == [(2, 1000)]
    # two launches: the same one call, with its own defaults (8 warps a tile, 32 an SM)
    text2 = export.export(
        jax.jit(lambda x, h, g, u, d, i: cuda_ops.int4_mlp(x, h, g, u, d, i, launches=2)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(cuda_ops.INT4_MLP_TARGET)])(
        x, h, gate, up, down, idx).mlir_module()
    assert text2.count(f"@{cuda_ops.INT4_MLP_TARGET}(") == 1
    assert "launches = 2 : i64" in text2
    assert "warps = 8 : i64" in text2 and "occupancy = 32 : i64" in text2
    with pytest.raises(ValueError, match="launches"):
        cuda_ops.int4_mlp(x, h, gate, up, down, idx, launches=4)
    with pytest.raises(ValueError, match="rows"):
        cuda_ops.int4_mlp(jnp.zeros((5, 512), jnp.bfloat16), jnp.zeros((5, 1000), jnp.bfloat16),
                          gate, up, down, idx)
    with pytest.raises(ValueError, match="gate and up"):
        cuda_ops.int4_mlp(x, h, gate, down, down, idx)
    with pytest.raises(ValueError, match="h must be"):
        cuda_ops.int4_mlp(x, h[:, :999], gate, up, down, idx)
    with pytest.raises(ValueError, match="warps"):
        cuda_ops.int4_mlp(x, h, gate, up, down, idx, warps=16)
    with pytest.raises(ValueError, match="bf16"):
        cuda_ops.int4_mlp(x.astype(jnp.float32), h, gate, up, down, idx)


@pytest.mark.gpu
@pytest.mark.parametrize("launches,warps,occupancy", [
    (1, 8, 24), (1, 8, 32), (1, 4, 24), (1, 4, 32), (2, 8, 32), (2, 4, 32), (2, 8, 24),
    (3, 8, 32)])
def test_persistent_mlp_matches_reference_on_gpu(launches, warps, occupancy):
    """The MLP op (the persistent kernel, or the two launches with and without programmatic
    dependent launch) against the fp32 reference (bf16 tolerance: its GEMV outputs and
    activations are rounded to bf16 as the separate calls round them) and against the
    separate calls (wide GEMVs, XLA's SwiGLU and residual add); a row's result the same bits
    whatever the other rows (batch invariant); repeated launches the same bits (the grid
    barrier resets itself; down waits for gate|up)."""
    _require_cuda()
    idx = jnp.array([1], jnp.int32)
    fused = jax.jit(lambda x, h, g, u, d, i: cuda_ops.int4_mlp(
        x, h, g, u, d, i, warps=warps, occupancy=occupancy, launches=launches))

    def separate(x, h, g, u, d, i):
        gate, up = cuda_ops.int4_gemv_multi(x, [g, u], i)
        return h + cuda_ops.int4_gemv(jax.nn.silu(gate) * up, d, i)

    outs = {}
    for m in (1, 2, 3):
        x, h, (gate, up, down) = _mlp_case(m)
        got = fused(x, h, gate, up, down, idx)
        assert got.shape == (m, 1000) and got.dtype == jnp.bfloat16
        assert_close(got, _mlp_reference(x, h, gate, up, down, 1), jnp.bfloat16)
        assert_close(got, jax.jit(separate)(x, h, gate, up, down, idx).astype(jnp.float32),
                     jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(fused(x, h, gate, up, down, idx), np.float32),
                                      np.asarray(got, np.float32))
        outs[m] = (x, h, got)
    # row 0 of a 3-row call alone: the same bits
    x3, h3, got3 = outs[3]
    _, _, (gate, up, down) = _mlp_case(3)
    alone = fused(x3[:1], h3[:1], gate, up, down, idx)
    np.testing.assert_array_equal(np.asarray(alone, np.float32), np.asarray(got3[:1], np.float32))


@pytest.mark.gpu
def test_mlp_two_launches_are_the_persistent_kernels_bits_on_gpu():
    """With 8 warps a tile for gate|up, the two launches (chained by programmatic dependent
    launch or in stream order) compute what the persistent kernel computes, in the same
    order: the same bits, at the test shapes and the 27B's. A down launch that read act before
    gate|up had written it would not."""
    _require_cuda()
    for kw in ({}, dict(k1=5120, n1=17408, n2=5120, lead=())):
        for m in (1, 2):
            x, h, (gate, up, down) = _mlp_case(m, **kw)
            idx = jnp.array([1], jnp.int32) if kw == {} else None
            outs = [np.asarray(jax.jit(lambda x, h, g, u, d, i, n=n: cuda_ops.int4_mlp(
                x, h, g, u, d, i, warps=8, occupancy=24, launches=n))(
                    x, h, gate, up, down, idx), np.float32) for n in (1, 2, 3)]
            for other in outs[1:]:
                np.testing.assert_array_equal(other, outs[0])


@pytest.mark.gpu
def test_persistent_mlp_at_27b_shapes_on_gpu():
    """The 27B's MLP shapes (gate|up 17408 x 5120 each, down 5120 x 17408), one and two rows:
    against the separate calls within bf16 tolerance."""
    _require_cuda()
    for m in (1, 2):
        x, h, (gate, up, down) = _mlp_case(m, k1=5120, n1=17408, n2=5120, lead=())
        gate_o, up_o = cuda_ops.int4_gemv_multi(x, [gate, up])
        want = h + cuda_ops.int4_gemv(jax.nn.silu(gate_o) * up_o, down)
        for launches in cuda_ops.MLP_LAUNCHES:
            got = jax.jit(lambda *a, n=launches: cuda_ops.int4_mlp(*a, launches=n))(
                x, h, gate, up, down)
            assert_close(got, want.astype(jnp.float32), jnp.bfloat16)


def test_mlp_takes_decode_rows_of_int4_stacks_only():
    """`mlp_shape_error`, the model's test for the MLP op (None: it takes the operands): bf16
    rows of a decode step over int4 stacks whose K1 and N1 are multiples of 128, and nothing
    else; the model's `mlp_residual` with the pallas plan (mlp "separate") is h + mlp exactly,
    and with the h200 plan's mlp "cuda" it lowers for CUDA to one call of the op (two
    launches)."""
    from engine.kernels.stacked import Stacked
    from engine.layers import mlp, mlp_residual

    def takes(*a):
        return cuda_ops.mlp_shape_error(*a) is None

    x, h, (gate, up, down) = _mlp_case(2)
    assert takes(x, h, gate, up, down)
    assert not takes(jnp.zeros((5, 512), jnp.bfloat16), jnp.zeros((5, 1000), jnp.bfloat16),
                     gate, up, down)
    assert not takes(x.astype(jnp.float32), h, gate, up, down)
    assert not takes(x, h[:, :999], gate, up, down)
    assert not takes(x, h, gate, up, up)  # down's K is not gate's N
    _, _, (_, _, one_down) = _mlp_case(2, lead=())  # down of another stack's dims
    assert not takes(x, h, gate, up, one_down)
    x3, h3, ws3 = _mlp_case(1, k1=320, n1=1024)  # K1 not a multiple of 128
    assert not takes(x3, h3, *ws3)

    idx = jnp.array([1], jnp.int32)
    p = {name: Stacked(w, idx) for name, w in zip(("gate_proj", "up_proj", "down_proj"),
                                                  (gate, up, down))}
    want = h[:, None] + mlp(p, x[:, None], PALLAS)
    got = mlp_residual(p, x[:, None], h[:, None], PALLAS)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    text = export.export(
        jax.jit(lambda x, h: mlp_residual(p, x, h, H200)), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(cuda_ops.INT4_MLP_TARGET)])(
        x[:, None], h[:, None]).mlir_module()
    assert text.count(f"@{cuda_ops.INT4_MLP_TARGET}(") == 1 and "launches = 2 : i64" in text


def test_wide_call_takes_the_callers_group_sums():
    """Given the group sums (`corr=`, the fused norms'), the wide call makes none itself: its
    own sums are a reduction over x in the module, the caller's an argument."""
    w = _qtensor(64, 256, 3, lead=(2,))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 256)), jnp.bfloat16)
    idx = jnp.array([1], jnp.int32)

    def text(sums=False):
        return export.export(
            jax.jit(lambda x, w, i, c: cuda_ops.int4_gemv(x, w, i, variant="wide",
                                                          corr=c if sums else None)),
            platforms=["cuda"], disabled_checks=[
                export.DisabledSafetyCheck.custom_call(cuda_ops.INT4_WIDE_TARGET)])(
            x, w, idx, cuda_ops.group_sums(x)).mlir_module()
    assert "stablehlo.reduce" in text() and "stablehlo.reduce" not in text(sums=True)
