"""Weight formats: round-trip error bounds, exact rounding rules, JAX == numpy, pytree behaviour."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from engine.ops import quant
from engine.ops.quant import (ERROR_BOUNDS, FP8_ROW, INT4_G64, INT8_ROW, QUANT_FORMATS, QTensor,
                              QuantError, dequantize, dequantize_np, embedding_lookup,
                              linear_ref, quantize)


def _close(got, want):
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())


def _gauss(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("shape", [(512, 2048), (64, 5120), (1024, 128)])
def test_roundtrip_error_within_documented_bound(fmt, shape):
    w = _gauss(shape, seed=shape[1])
    err = np.linalg.norm(w - dequantize_np(quantize(w, fmt))) / np.linalg.norm(w)
    assert err <= ERROR_BOUNDS[fmt], (fmt, shape, err)
    assert err >= 0.5 * ERROR_BOUNDS[fmt] * (0.5 if fmt == INT8_ROW else 1)  # bound is not slack


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_layout_dtypes_and_determinism(fmt):
    w = _gauss((96, 256), seed=1).astype(ml_dtypes.bfloat16)
    a, b = quantize(w, fmt), quantize(w.copy(), fmt)
    assert a.fmt == fmt and a.shape == (96, 256)
    for part, (dt, shape) in quant.part_layout(fmt, (96, 256)).items():
        arr = a.parts()[part]
        assert arr.dtype == quant.DTYPES[dt] and arr.shape == shape
        assert arr.tobytes() == b.parts()[part].tobytes()


def test_int8_scale_rule_and_round_half_even():
    w = np.array([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0]], np.float32)
    q = quantize(w, INT8_ROW)
    assert q.scale.tolist() == [1.0]  # amax 127 / 127
    assert q.data.tolist() == [[0, 2, 2, 0, -2, -2, 126, 127]]


def test_int4_scale_rule_packing_and_round_half_even():
    row = np.zeros(64, np.float32)
    row[:8] = [0.5, 1.5, 2.5, -2.5, 7.0, -7.0, 3.5, -0.5]
    w = np.stack([row, np.zeros(64, np.float32), 2 * row])
    q = quantize(w, INT4_G64)
    assert q.scale[:, 0].tolist() == [1.0, 1.0, 2.0]  # amax / 7; an all-zero group gets 1
    codes = [0, 2, 2, -2, 7, -7, 4, 0]
    # element 2j in the low nibble of byte j, 2j+1 in the high nibble, offset by +8
    want = [(codes[2 * j] + 8) | ((codes[2 * j + 1] + 8) << 4) for j in range(4)]
    assert q.data[0, :4].tolist() == want
    assert q.data[0, 4:].tolist() == [0x88] * 28
    assert np.array_equal(dequantize_np(q)[1], np.zeros(64, np.float32))


def test_fp8_scale_rule_and_rounding():
    w = np.array([[448.0, 1.0625, 1.1875, -1.0625, 0.0]], np.float32)
    q = quantize(w, FP8_ROW)
    assert q.scale.tolist() == [1.0]
    assert q.data.astype(np.float32).tolist() == [[448.0, 1.0, 1.25, -1.0, 0.0]]


def test_quantize_is_chunk_invariant(monkeypatch):
    w = _gauss((300, 128), seed=2)
    whole = {f: quantize(w, f) for f in QUANT_FORMATS}
    monkeypatch.setattr(quant, "_ROWS_PER_CHUNK_ELEMS", 7 * 128)
    for f in QUANT_FORMATS:
        part = quantize(w, f)
        assert part.data.tobytes() == whole[f].data.tobytes()
        assert part.scale.tobytes() == whole[f].scale.tobytes()


@pytest.mark.parametrize("w, fmt, msg", [
    (np.zeros((4, 4, 64), np.float32), INT8_ROW, "2-D"),
    (np.zeros((4, 96), np.float32), INT4_G64, "divisible by 64"),
    (np.full((4, 64), np.nan, np.float32), INT8_ROW, "inf/nan"),
    (np.zeros((4, 64), np.int32), INT8_ROW, "fp32/bf16/fp16"),
    (np.zeros((4, 64), np.float32), "int3", "unknown quantized format"),
])
def test_quantize_refuses(w, fmt, msg):
    with pytest.raises(QuantError, match=msg):
        quantize(w, fmt)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_jax_dequantize_equals_numpy(fmt):
    q = quantize(_gauss((64, 192), seed=3), fmt)
    assert np.array_equal(np.asarray(dequantize(q)), dequantize_np(q))
    assert dequantize(q, jnp.bfloat16).dtype == jnp.bfloat16


def _int4_every_code(stacked: bool):
    """int4_g64 weights whose codes take all 16 values, scales spread over six decades; with
    `stacked` two layers of one stack."""
    rng = np.random.default_rng(11)
    qs = []
    for _ in range(2 if stacked else 1):
        w = _gauss((40, 256), seed=int(rng.integers(1 << 30)))
        w *= 10.0 ** rng.uniform(-4, 2, size=(40, 1)).astype(np.float32)
        qs.append(quantize(w, INT4_G64))
    q = qs[0]
    data = rng.integers(0, 256, size=q.data.shape, dtype=np.uint8)  # every nibble value
    if stacked:
        return QTensor(np.stack([data, qs[1].data]), np.stack([q.scale, qs[1].scale]),
                       INT4_G64, q.shape)
    return QTensor(data, q.scale, INT4_G64, q.shape)


def _check_int4_16bit(q):
    want32 = dequantize_np(q)
    for dtype in (jnp.bfloat16, jnp.float16):
        want = want32.astype(jnp.dtype(dtype)).view(np.uint16)
        for fn in (dequantize, jax.jit(dequantize, static_argnums=1)):
            got = np.asarray(fn(q, dtype))
            assert got.dtype == jnp.dtype(dtype) and got.shape == want32.shape
            np.testing.assert_array_equal(got.view(np.uint16), want)


@pytest.mark.parametrize("stacked", [False, True])
def test_int4_dequantize_to_16_bits_rounds_the_fp32_values_once(stacked):
    """To bf16 / fp16 the int4 codes are unpacked by one elementwise pass (each byte's two
    values side by side in a uint32): bit for bit code * scale in fp32 rounded once, for every
    code, stacked or not, jitted or not; the lowered program interleaves nothing."""
    q = _int4_every_code(stacked)
    _check_int4_16bit(q)
    hlo = jax.jit(dequantize, static_argnums=1).lower(q, jnp.bfloat16).as_text()
    assert "concatenate" not in hlo and "bitcast_convert" in hlo
    x = jnp.asarray(_gauss((3, 256), seed=12)).astype(jnp.bfloat16)
    if not stacked:  # linear_ref() on bf16 x multiplies by exactly those bf16 weights
        w = jnp.asarray(dequantize_np(q)).astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(linear_ref(x, q)),
                                      np.asarray(jnp.einsum("...i,oi->...o", x, w)))


@pytest.mark.gpu
def test_int4_dequantize_to_16_bits_gpu():
    """The same bits on the GPU (XLA's GPU bitcast of a uint32 into two halves)."""
    assert jax.default_backend() == "gpu"
    for stacked in (False, True):
        _check_int4_16bit(_int4_every_code(stacked))


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_linear_equals_matmul_with_dequantized_weight(fmt):
    q = quantize(_gauss((48, 128), seed=4), fmt)
    x = jnp.asarray(_gauss((2, 5, 128), seed=5))
    # exactly the dense path on the dequantized weight; x @ w.T up to summation order
    np.testing.assert_array_equal(np.asarray(linear_ref(x, q)),
                                  np.asarray(linear_ref(x, dequantize(q))))
    want = x @ dequantize(q).T
    _close(linear_ref(x, q), want)
    got = jax.jit(linear_ref)(x, jax.device_put(q))
    # under jit XLA may fuse the dequantize into the dot and reassociate: equal to rounding
    _close(got, want)


def test_linear_dense_behaviour_unchanged():
    w = _gauss((16, 32), seed=6)
    x = jnp.asarray(_gauss((3, 32), seed=7))
    np.testing.assert_array_equal(np.asarray(linear_ref(x, jnp.asarray(w))),
                                  np.asarray(jnp.einsum("...i,oi->...o", x, w)))
    assert linear_ref(x.astype(jnp.bfloat16), w).dtype == jnp.bfloat16


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_stacked_qtensors_tree_map_and_scan(fmt):
    layers = [quantize(_gauss((32, 64), seed=10 + i), fmt) for i in range(3)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    assert isinstance(stacked, QTensor) and stacked.shape == (32, 64)
    assert stacked.data.shape[0] == 3 and stacked.scale.shape[0] == 3
    # dequantize accepts leading dims
    np.testing.assert_array_equal(np.asarray(dequantize(stacked)[1]), dequantize_np(layers[1]))

    x = jnp.asarray(_gauss((4, 64), seed=20))

    def body(h, w):
        return h, linear_ref(h, w)  # scan slices the leading axis: w is an unstacked QTensor

    _, ys = jax.jit(lambda x, s: jax.lax.scan(body, x, s))(x, stacked)
    for i, q in enumerate(layers):
        _close(ys[i], linear_ref(x, q))
    leaves, treedef = jax.tree.flatten(stacked)
    assert len(leaves) == 2 and jax.tree.unflatten(treedef, leaves).fmt == fmt


@pytest.mark.parametrize("fmt", [INT8_ROW, FP8_ROW])
def test_embedding_lookup_quantized_rows(fmt):
    table = _gauss((50, 64), seed=8)
    q = quantize(table, fmt)
    ids = jnp.array([[3, 0, 49]])
    np.testing.assert_array_equal(np.asarray(embedding_lookup(q, ids)),
                                  dequantize_np(q)[np.asarray(ids)])
    np.testing.assert_array_equal(np.asarray(embedding_lookup(table, ids)), table[np.asarray(ids)])
