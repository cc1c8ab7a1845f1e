"""Weight formats and the reference matmul.

`linear_ref(x, w)` computes x @ w.T for a weight in HF orientation [out, in], whatever its
storage format: the reference behind the model's `engine.model.linear.linear`, which also sends
shapes to the kernels by the plan. Dense weights are plain arrays (fp32 or bf16); quantized
ones are `QTensor` pytrees.

Formats (all symmetric, no zero point; docs/formats/artifact.md has the byte layout):

| fmt        | data                          | scale                     | bytes / weight |
|------------|-------------------------------|---------------------------|----------------|
| `int8_row` | int8 [out, in]                | fp32 [out]                | 1 + 4/in       |
| `fp8_row`  | float8_e4m3fn [out, in]       | fp32 [out]                | 1 + 4/in       |
| `int4_g64` | uint8 [out, in/2], 2 per byte | fp32 [out, in/64]         | 0.5 + 4/64     |

Scale rule (numpy, float32 throughout, so it is bit-deterministic): `amax` = max |w| over the row
(int8, fp8) or over each group of 64 consecutive input columns (int4); `scale = amax / QMAX` with
QMAX = 127 (int8), 448 (fp8 e4m3fn's largest finite value) or 7 (int4); an all-zero row or group
gets scale 1. Codes: int8 `clip(rint(w / scale), -127, 127)`; int4 the same clipped to [-7, 7] and
stored offset by +8 (nibble 1..15), element 2j in the low nibble of byte j and 2j+1 in the high
one; fp8 `(w / scale)` cast to e4m3fn. np.rint and ml_dtypes' cast both round half to even.
`w ~= code * scale` is the dequantized weight, computed in fp32.

Measured normwise round-trip error ||w - dq(q(w))|| / ||w|| on Gaussian weights ([1024, 4096],
[64, 5120], [4096, 512]): int8 0.0074-0.0087, fp8 0.0263-0.0265, int4 0.1074-0.1077. The bounds
`ERROR_BOUNDS` below (asserted by the tests and the converter's tests) leave ~10% headroom.

A QTensor's `fmt` and logical `shape` ([out, in]) are static pytree metadata; `data` and `scale`
are leaves. Stacking layers with `jax.tree.map(lambda *xs: jnp.stack(xs), *qts)` adds leading dims
to the leaves only; `lax.scan` slices them off again, so `linear_ref` sees [out, in] weights.
`dequantize` accepts leading dims too.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
import ml_dtypes
import numpy as np

DENSE = "dense"
INT8_ROW = "int8_row"
FP8_ROW = "fp8_row"
INT4_G64 = "int4_g64"
QUANT_FORMATS = (INT8_ROW, FP8_ROW, INT4_G64)
FORMATS = (DENSE,) + QUANT_FORMATS
GROUP = 64  # int4 group size along the input dim

ERROR_BOUNDS = {INT8_ROW: 1e-2, FP8_ROW: 3e-2, INT4_G64: 1.2e-1}
_QMAX = {INT8_ROW: 127.0, FP8_ROW: 448.0, INT4_G64: 7.0}
# Numpy dtypes by the names the artifact directory uses.
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
}
DENSE_DTYPES = ("float32", "bfloat16")
_ROWS_PER_CHUNK_ELEMS = 1 << 24  # quantize ~16M weights at a time: bounds the fp32 temporaries


class QuantError(ValueError):
    """A weight that cannot be put in (or read back from) the requested format."""


def dtype_name(dt) -> str:
    dt = np.dtype(dt)
    for name, d in DTYPES.items():
        if d == dt:
            return name
    raise QuantError(f"unsupported dtype {dt}")


def part_layout(fmt: str, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The stored parts of a quantized [out, in] weight: {part: (dtype name, shape)}."""
    if fmt not in QUANT_FORMATS:
        raise QuantError(f"unknown quantized format {fmt!r}; known: {list(QUANT_FORMATS)}")
    if len(shape) != 2:
        raise QuantError(f"format {fmt} needs a 2-D [out, in] weight, got shape {list(shape)}")
    out, inp = shape
    if fmt == INT4_G64:
        if inp % GROUP:
            raise QuantError(f"format {fmt} needs in_features divisible by {GROUP}, got {inp}")
        return {"data": ("uint8", (out, inp // 2)), "scale": ("float32", (out, inp // GROUP))}
    data_dtype = "int8" if fmt == INT8_ROW else "float8_e4m3fn"
    return {"data": (data_dtype, (out, inp)), "scale": ("float32", (out,))}


@dataclass(frozen=True, eq=False)
class QTensor:
    """A quantized weight of logical shape `shape` = (out, in). Leaves may carry leading dims."""
    data: object   # [..., out, in] int8 / float8_e4m3fn, or [..., out, in/2] uint8 (int4)
    scale: object  # [..., out] fp32, or [..., out, in/64] fp32 (int4)
    fmt: str
    shape: tuple[int, int]

    def parts(self) -> dict[str, object]:
        return {"data": self.data, "scale": self.scale}

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + int(self.scale.nbytes)

    def __repr__(self) -> str:
        return (f"QTensor(fmt={self.fmt}, shape={self.shape}, data={_desc(self.data)}, "
                f"scale={_desc(self.scale)})")


def _desc(a) -> str:
    return f"{getattr(a, 'dtype', '?')}{list(getattr(a, 'shape', ()))}"


jax.tree_util.register_dataclass(QTensor, data_fields=["data", "scale"],
                                 meta_fields=["fmt", "shape"])


# ---- quantize (numpy, deterministic) ----------------------------------------------------------
def quantize(w: np.ndarray, fmt: str) -> QTensor:
    """Quantize a 2-D [out, in] numpy weight (fp32, bf16 or fp16) to `fmt` (see module doc)."""
    w = np.asarray(w)
    if w.dtype not in (np.float32, np.float16, DTYPES["bfloat16"]):
        raise QuantError(f"quantize needs an fp32/bf16/fp16 weight, got {w.dtype}")
    shape = tuple(int(d) for d in w.shape)
    layout = part_layout(fmt, shape)
    data = np.empty(layout["data"][1], DTYPES[layout["data"][0]])
    scale = np.empty(layout["scale"][1], np.float32)
    out, inp = shape
    rows = max(1, _ROWS_PER_CHUNK_ELEMS // max(inp, 1))
    for r0 in range(0, out, rows):  # per-row formats: chunking over rows changes no bit
        r1 = min(out, r0 + rows)
        chunk = w[r0:r1].astype(np.float32)
        if not np.isfinite(chunk).all():
            raise QuantError(f"cannot quantize a weight with inf/nan (rows {r0}..{r1})")
        data[r0:r1], scale[r0:r1] = _quantize_rows(chunk, fmt)
    return QTensor(data=data, scale=scale, fmt=fmt, shape=shape)


def _quantize_rows(w: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    qmax = np.float32(_QMAX[fmt])
    if fmt == INT4_G64:
        g = w.reshape(w.shape[0], -1, GROUP)                     # [rows, in/64, 64]
        scale = _scale(np.max(np.abs(g), axis=-1), qmax)          # [rows, in/64]
        q = np.clip(np.rint(g / scale[..., None]), -7, 7).astype(np.int8) + np.int8(8)
        q = q.reshape(w.shape).astype(np.uint8)
        return q[:, 0::2] | (q[:, 1::2] << np.uint8(4)), scale
    scale = _scale(np.max(np.abs(w), axis=-1), qmax)              # [rows]
    x = w / scale[:, None]
    if fmt == INT8_ROW:
        return np.clip(np.rint(x), -127, 127).astype(np.int8), scale
    # |x| <= 448 up to one rounding of the division; clip so no value can overflow to NaN.
    return np.clip(x, -qmax, qmax).astype(ml_dtypes.float8_e4m3fn), scale


def _scale(amax: np.ndarray, qmax: np.float32) -> np.ndarray:
    s = (amax / qmax).astype(np.float32)
    s[amax == 0] = np.float32(1.0)
    return s


# ---- dequantize -------------------------------------------------------------------------------
def dequantize(qt: QTensor, dtype=jnp.float32) -> jax.Array:
    """The JAX reference: [..., out, in] in `dtype`, computed as code * scale in fp32."""
    if qt.fmt == INT4_G64 and jnp.dtype(dtype).itemsize == 2:
        return _dequantize_int4_16bit(qt, jnp.dtype(dtype))
    if qt.fmt == INT4_G64:
        codes = _unpack_int4(jnp.asarray(qt.data))               # [..., out, in] int8
        *lead, out, inp = codes.shape
        g = codes.reshape(*lead, out, inp // GROUP, GROUP).astype(jnp.float32)
        w = (g * jnp.asarray(qt.scale)[..., None]).reshape(*lead, out, inp)
    elif qt.fmt in (INT8_ROW, FP8_ROW):
        w = jnp.asarray(qt.data).astype(jnp.float32) * jnp.asarray(qt.scale)[..., None]
    else:
        raise QuantError(f"unknown quantized format {qt.fmt!r}")
    return w.astype(dtype)


def _dequantize_int4_16bit(qt: QTensor, dtype) -> jax.Array:
    """`dequantize` to a 16-bit float, as one elementwise pass over the packed bytes: each
    byte's two values (code * scale in fp32, rounded once to `dtype`) are put side by side in
    a uint32 that is then read as two `dtype` values, low half first. The same values as
    interleaving the two nibbles' arrays (`_unpack_int4`), which XLA on the GPU runs as a
    concatenate at ~1 TB/s (a 17408 x 5120 weight in 212 us of a prefill); this is a loop
    fusion that reads a byte and writes four."""
    packed = jnp.asarray(qt.data)                                   # [..., out, in/2] uint8
    *lead, out, half = packed.shape
    per = GROUP // 2                                                # bytes a group
    p = packed.reshape(*lead, out, half // per, per)
    sc = jnp.asarray(qt.scale).astype(jnp.float32)[..., None]      # [..., out, in/64, 1]

    def half_bits(codes):  # codes 0..15 -> (code - 8) * scale as dtype's 16 bits
        v = (codes.astype(jnp.int32) - 8).astype(jnp.float32) * sc
        return lax.bitcast_convert_type(v.astype(dtype), jnp.uint16).astype(jnp.uint32)

    word = half_bits(p & 0xF) | (half_bits(p >> 4) << 16)          # lo: input 2j, hi: 2j + 1
    return lax.bitcast_convert_type(word, dtype).reshape(*lead, out, 2 * half)


def _unpack_int4(packed: jax.Array) -> jax.Array:
    lo = (packed & 0xF).astype(jnp.int8) - 8
    hi = (packed >> 4).astype(jnp.int8) - 8
    both = jnp.stack([lo, hi], axis=-1)                           # [..., out, in/2, 2]
    return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_np(qt: QTensor) -> np.ndarray:
    """The same as `dequantize` in numpy fp32 (bit-identical); for tests and the converter."""
    data, scale = np.asarray(qt.data), np.asarray(qt.scale)
    if qt.fmt == INT4_G64:
        lo = (data & 0xF).astype(np.int8) - 8
        hi = (data >> 4).astype(np.int8) - 8
        codes = np.stack([lo, hi], axis=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)
        *lead, out, inp = codes.shape
        g = codes.reshape(*lead, out, inp // GROUP, GROUP).astype(np.float32)
        return (g * scale[..., None]).reshape(*lead, out, inp)
    if qt.fmt in (INT8_ROW, FP8_ROW):
        return data.astype(np.float32) * scale[..., None]
    raise QuantError(f"unknown quantized format {qt.fmt!r}")


# ---- the reference matmul -------------------------------------------------------------------
def linear_ref(x: jax.Array, w) -> jax.Array:
    """x: [..., in] -> [..., out], with w: [out, in] (a dense array or a QTensor): the reference
    matmul, what `engine.model.linear.linear` computes on the reference plan and what the
    kernels (engine/kernels/qgemv.py, qgemm.py) are checked against.

    A QTensor is dequantized to x.dtype first (code * scale in fp32, rounded once to x's
    dtype; fp32 for other x), then multiplied exactly like a dense weight. A layer view of a
    stacked weight (engine/kernels/stacked.py, anything with `materialize`) is materialized
    first.
    """
    if hasattr(w, "materialize"):  # a layer view (block_loop "views") on the reference path
        w = w.materialize()
    if isinstance(w, QTensor):  # code * scale in fp32, rounded once to x's dtype
        w = dequantize(w, x.dtype if jnp.dtype(x.dtype).itemsize == 2 else jnp.float32)
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype))


def embedding_lookup(table, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Rows `ids` ([...] int) of a [vocab, hidden] table (dense, or an int8_row/fp8_row QTensor)."""
    if isinstance(table, QTensor):
        if table.fmt not in (INT8_ROW, FP8_ROW):
            raise QuantError(f"embedding lookup does not support {table.fmt}")
        rows = jnp.take(jnp.asarray(table.data), ids, axis=0).astype(jnp.float32)
        return (rows * jnp.take(jnp.asarray(table.scale), ids, axis=0)[..., None]).astype(dtype)
    return jnp.take(jnp.asarray(table), ids, axis=0).astype(dtype)
