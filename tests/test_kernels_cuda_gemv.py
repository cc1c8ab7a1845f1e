"""The CUDA int4_g64 GEMV (engine/kernels/cuda_ops.py, XLA FFI) against the reference `linear`
(engine/model/linear.py). It runs only on a GPU (-m gpu), built and registered by
`cuda_ops.require` for the h200 plan (engine/plan.py); on the CPU the tests check that it lowers
to its FFI call for CUDA, that `require` refuses this machine, and that `qmatmul` uses the
Pallas kernel unless asked for the CUDA op (a plan's gemv "cuda")."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from engine.kernels import cuda_ops, qgemv
from engine.kernels.stacked import Stacked
from engine.model.linear import linear
from engine.ops.quant import quantize
from engine.plan import H200, PALLAS
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


def test_wide_warps_choice():
    """The wide kernel's warps a tile, 4 or 8 (its builds), by the number of 16-row tiles only
    (the fewer of WIDE_WARPS that still gives WIDE_AUTO_WARPS in all); asking `int4_gemv` for
    warps it is not built for is a ValueError."""
    choices = cuda_ops.WIDE_WARPS
    assert choices == (4, 8)
    for n in (48, 1024, 5120, 14336, 16480, 34816, 248320):
        w = cuda_ops.wide_warps(n)
        tiles = -(-n // 16)
        assert w in choices
        assert tiles * w >= cuda_ops.WIDE_AUTO_WARPS or w == choices[-1]
        assert w == choices[0] or tiles * choices[choices.index(w) - 1] < cuda_ops.WIDE_AUTO_WARPS
    # the step's shapes: many tiles 4 warps, few 8 (the fastest of each on the H200)
    assert [cuda_ops.wide_warps(n) for n in (248320, 34816, 16480, 14336, 6144, 5120)] == \
        [4, 4, 4, 4, 8, 8]
    w = _qtensor(64, 128, 0)
    for bad in (2, 10, 16):
        with pytest.raises(ValueError, match="warps"):
            cuda_ops.int4_gemv(jnp.ones((1, 128), jnp.bfloat16), w, variant="wide", warps=bad)


@pytest.mark.gpu
def test_wide_auto_warps_is_the_explicit_choice_on_gpu():
    """The wide kernel's default warps ("auto") are the warps `wide_warps` names: the same
    bits as asking for them."""
    _require_cuda()
    w = _qtensor(5120, 1024, 7)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 1024)), jnp.bfloat16)
    auto = jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="wide"))(x, w)
    explicit = jax.jit(lambda x, w: cuda_ops.int4_gemv(
        x, w, variant="wide", warps=cuda_ops.wide_warps(5120)))(x, w)
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


MMA_CASES = [  # (M, N, K): from 1 group to 272, N not a multiple of 16, every M
    (1, 37, 64), (1, 4096, 5120), (2, 4096, 5120), (3, 1000, 17408), (4, 999, 6144),
    (5, 517, 192), (8, 2048, 5120), (7, 300, 1024), (2, 1000, 17408), (3, 37, 64),
    (8, 517, 192), (1, 2048, 8 * 64 * 5 + 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", MMA_CASES)
def test_tensor_core_variant_matches_reference_on_gpu(m, n, k):
    _require_cuda()
    w = _qtensor(n, k, m * n + k)
    x = jnp.asarray(np.random.default_rng(k + m).standard_normal((m, k)) + 0.5, jnp.bfloat16)
    got = jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="mma"))(x, w)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    with jax.default_matmul_precision("highest"):
        ref = linear(x.astype(jnp.float32), w)  # exact products of the same bf16 x and codes
    from tests.kernel_checks import rel_err

    assert rel_err(got, ref) < 4e-3  # the bf16 rounding of the output, not of the products


WIDE_CASES = [  # (M, N, K): K multiples of 128; N not of 16 too
    (1, 37, 128), (1, 4096, 5120), (2, 4096, 5120), (3, 1000, 17408), (4, 999, 6144),
    (1, 248, 384)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", WIDE_CASES)
def test_wide_tensor_core_variant_matches_reference_on_gpu(m, n, k):
    """The wide kernel (16-byte loads, two groups per MMA kept apart by B's columns, x
    permuted in registers, the codes' offset taken off with group sums of x) against the fp32
    reference, at its default warps a tile and at each of 4 and 8; x is bf16, as the tensor
    cores take it."""
    _require_cuda()
    w = _qtensor(n, k, k + n)
    x = jnp.asarray(np.random.default_rng(m + n).standard_normal((m, k)), jnp.bfloat16)
    got = jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="wide"))(x, w)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    with jax.default_matmul_precision("highest"):
        want = linear(x.astype(jnp.float32), w)
    assert_close(got, want, jnp.bfloat16)
    # each warps setting to a tile: other partial sums, the same result within bf16
    for warps in cuda_ops.WIDE_WARPS:
        other_w = jax.jit(lambda x, w, wp=warps: cuda_ops.int4_gemv(
            x, w, variant="wide", warps=wp))(x, w)
        assert_close(other_w, want, jnp.bfloat16)


GPU_CASES = [  # (M, N, K, x dtype): the FMA kernel, 2 rows a warp up to M = 4, else 1
    (1, 37, 64, jnp.float32), (1, 4096, 5120, jnp.bfloat16), (2, 4096, 5120, jnp.bfloat16),
    (1, 1000, 17408, jnp.float32), (2, 999, 6144, jnp.float32), (3, 517, 192, jnp.bfloat16),
    (4, 2048, 5120, jnp.float32), (5, 300, 1024, jnp.bfloat16), (8, 256, 5120, jnp.float32)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,dtype", GPU_CASES)
def test_matches_reference_on_gpu(m, n, k, dtype):
    _require_cuda()
    w = _qtensor(n, k, m + n + k)
    x = jnp.asarray(np.random.default_rng(k).standard_normal((m, k)), dtype)
    got = jax.jit(lambda x, w: cuda_ops.int4_gemv(x, w, variant="fma"))(x, w)
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
    four = np.asarray(cuda_ops.int4_gemv(jnp.concatenate([x2, x2[::-1]]), w, variant=variant),
                      np.float32)
    assert np.array_equal(one[0], two[0]) and np.array_equal(two, again)
    assert np.array_equal(four[0], two[0]) and np.array_equal(four[3], two[0])


@pytest.mark.gpu
def test_attributes_of_no_build_are_an_error_on_gpu(monkeypatch):
    """The handlers take the attributes of the kernels built and nothing else: another value
    is an FFI error naming the build, not another kernel."""
    _require_cuda()
    w = _qtensor(64, 128, 11)
    monkeypatch.setattr(cuda_ops, "default_rows_per_warp", lambda m: 4)
    with pytest.raises(Exception, match="int4_gemv: built for"):
        jax.block_until_ready(cuda_ops.int4_gemv(jnp.ones((8, 128), jnp.float32), w))
    monkeypatch.setitem(cuda_ops._MMA_BUILD, "stages", 3)
    with pytest.raises(Exception, match="int4_gemv_mma: built for"):
        jax.block_until_ready(cuda_ops.int4_gemv(jnp.ones((1, 128), jnp.bfloat16), w,
                                                 variant="mma"))
    monkeypatch.setitem(cuda_ops._WIDE_BUILD, "occupancy", 0)
    with pytest.raises(Exception, match="int4_gemv_wide: built for"):
        jax.block_until_ready(cuda_ops.int4_gemv(jnp.ones((1, 128), jnp.bfloat16), w,
                                                 variant="wide"))
    x, h, (gate, up, down) = _mlp_case(1)
    monkeypatch.setitem(cuda_ops._MLP_BUILD, "launches", 1)
    with pytest.raises(Exception, match="int4_mlp: built for"):
        jax.block_until_ready(cuda_ops.int4_mlp(x, h, gate, up, down, jnp.array([1], jnp.int32)))


def test_multi_lowers_to_one_call_and_cpu_keeps_separate_linears():
    """A layer's projections of one x: one FFI call with a (codes, scales) pair per weight for
    CUDA; with the pallas plan (no CUDA op) `linear_multi` is exactly the separate `linear`
    calls."""
    from engine.model.linear import linear_multi

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


def test_wide_call_takes_x_as_it_is_and_concat_returns_one_array():
    """The wide kernel's call, lowered for CUDA: x goes in unpermuted (no transpose before the
    call) with its group sums, the attributes name the build (registers capped for 32 warps an
    SM, the offset by group sums, x permuted in the kernel), and concat=True gives the
    projections side by side in one array; with the pallas plan `linear_multi(concat=True)`
    is the separate linears' concatenation."""
    from engine.model.linear import linear_multi

    ws = [_qtensor(n, 256, n, lead=(2,)) for n in (64, 48)]
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 256)), jnp.bfloat16)
    idx = jnp.array([1], jnp.int32)
    exp = export.export(
        jax.jit(lambda x, a, b, i: cuda_ops.int4_gemv_multi(x, [a, b], i, variant="wide",
                                                            concat=True)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(cuda_ops.INT4_WIDE_TARGET)])(
        x, *ws, idx)
    text = exp.mlir_module()
    assert text.count(f"@{cuda_ops.INT4_WIDE_TARGET}(") == 1
    assert "stablehlo.transpose" not in text
    assert "tensor<2x0xf32>" not in text and "tensor<2x4xf32>" in text  # corr [M, K/64]
    assert "occupancy = 32 : i64" in text and "bias = 0 : i64" in text
    assert "xperm = 0 : i64" in text
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


def _mlp_case(m, k1=512, n1=1024, n2=1000, lead=(2,)):
    """x, h [m, ...] bf16 and stacked int4 gate / up [*lead, n1, k1], down [*lead, n2, n1]."""
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, k1)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((m, n2)), jnp.bfloat16)
    return x, h, [_qtensor(n, k, 40 + n + k, lead) for n, k in ((n1, k1), (n1, k1), (n2, n1))]


def _mlp_reference(x, h, gate, up, down, index):
    """h + down(silu(gate(x)) * up(x)), the layer's matrices dequantized, fp32 throughout."""
    from engine.ops.quant import dequantize

    def mat(w):
        layer = type(w)(w.data[index], w.scale[index], w.fmt, w.shape[-2:])
        return dequantize(layer, jnp.float32)

    with jax.default_matmul_precision("highest"):
        xf = x.astype(jnp.float32)
        a = jax.nn.silu(xf @ mat(gate).T) * (xf @ mat(up).T)
        return h.astype(jnp.float32) + a @ mat(down).T


def test_mlp_lowers_to_one_call_and_checks_its_shapes():
    """int4_mlp lowers for CUDA to one call of the op (three results: the output and the
    launches' two scratch arrays, of which the output alone is used), its attributes naming
    the build (two launches, 8 warps a tile, registers for 32 an SM), and rejects shapes the
    kernels do not take, with a clear error."""
    x, h, (gate, up, down) = _mlp_case(2)
    idx = jnp.array([1], jnp.int32)
    exp = export.export(
        jax.jit(lambda x, h, g, u, d, i: cuda_ops.int4_mlp(x, h, g, u, d, i)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(cuda_ops.INT4_MLP_TARGET)])(
        x, h, gate, up, down, idx)
    text = exp.mlir_module()
    assert text.count(f"@{cuda_ops.INT4_MLP_TARGET}(") == 1
    assert "launches = 2 : i64" in text
    assert "warps = 8 : i64" in text and "occupancy = 32 : i64" in text
    assert [a.shape for a in exp.out_avals] == [(2, 1000)]
    with pytest.raises(ValueError, match="rows"):
        cuda_ops.int4_mlp(jnp.zeros((5, 512), jnp.bfloat16), jnp.zeros((5, 1000), jnp.bfloat16),
                          gate, up, down, idx)
    with pytest.raises(ValueError, match="gate and up"):
        cuda_ops.int4_mlp(x, h, gate, down, down, idx)
    with pytest.raises(ValueError, match="h must be"):
        cuda_ops.int4_mlp(x, h[:, :999], gate, up, down, idx)
    with pytest.raises(ValueError, match="bf16"):
        cuda_ops.int4_mlp(x.astype(jnp.float32), h, gate, up, down, idx)


@pytest.mark.gpu
def test_mlp_matches_reference_on_gpu():
    """The MLP op (two launches chained by programmatic dependent launch) against the fp32
    reference (bf16 tolerance: its GEMV outputs and activations are rounded to bf16 as the
    separate calls round them) and against the separate calls (wide GEMVs, XLA's SwiGLU and
    residual add); a row's result the same bits whatever the other rows (batch invariant);
    repeated launches the same bits (down waits for gate|up)."""
    _require_cuda()
    idx = jnp.array([1], jnp.int32)
    fused = jax.jit(lambda x, h, g, u, d, i: cuda_ops.int4_mlp(x, h, g, u, d, i))

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
def test_mlp_at_27b_shapes_on_gpu():
    """The 27B's MLP shapes (gate|up 17408 x 5120 each, down 5120 x 17408), one and two rows:
    against the separate calls within bf16 tolerance."""
    _require_cuda()
    for m in (1, 2):
        x, h, (gate, up, down) = _mlp_case(m, k1=5120, n1=17408, n2=5120, lead=())
        gate_o, up_o = cuda_ops.int4_gemv_multi(x, [gate, up])
        want = h + cuda_ops.int4_gemv(jax.nn.silu(gate_o) * up_o, down)
        got = jax.jit(cuda_ops.int4_mlp)(x, h, gate, up, down)
        assert_close(got, want.astype(jnp.float32), jnp.bfloat16)


def test_mlp_takes_decode_rows_of_int4_stacks_only():
    """`mlp_shape_error`, the model's test for the MLP op (None: it takes the operands): bf16
    rows of a decode step over int4 stacks whose K1 and N1 are multiples of 128, and nothing
    else; the model's `mlp_residual` with the pallas plan (mlp "separate") is h + mlp exactly,
    and with the h200 plan's mlp "cuda" it lowers for CUDA to one call of the op (two
    launches)."""
    from engine.kernels.stacked import Stacked
    from engine.model.layers import mlp, mlp_residual

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
