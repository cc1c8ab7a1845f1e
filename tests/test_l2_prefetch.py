"""The L2 prefetch of a decode step's next weights (engine/kernels/l2_prefetch.py and its CUDA
op): the setting's grammar, the rows a budget covers, that it changes nothing where it does
not run (CPU, the references, prefill rows), and on the GPU (-m gpu) that the op passes its
input through bit for bit and a 27B-wide decode step gives the same logits and cache with
every point on as with none."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from engine.kernels import cuda_ops, l2_prefetch as l2
from engine.kernels.stacked import Stacked
from engine.quant import QTensor
from tests.kernel_checks import on_gpu


def _stack(layers, n, k, seed=0):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (layers, n, k // 2), dtype=np.uint8)
    scale = rng.uniform(0.5, 1.5, (layers, n, k // 64)).astype(np.float32)
    return QTensor(jnp.asarray(data), jnp.asarray(scale), "int4_g64", (n, k))


def test_plan_grammar():
    assert l2.parse_plan(None) is None and l2.parse_plan("") is None
    assert l2.parse_plan("off") is None
    p = l2.parse_plan("out=all, mlp=24.5")
    assert p.budget("out") == (True, None) and p.budget("mlp") == (True, 24.5)
    assert p.budget("in") == (False, None)
    assert (p.mode, p.step, p.blocks) == (2, 128, 132)
    assert l2.parse_plan("in=8", mode="3").step == 16384
    q = l2.parse_plan("in=8", mode="1", step="32", blocks="264")
    assert (q.mode, q.step, q.blocks) == (1, 32, 264)
    for bad in ("out", "down=4", "out=all,out=4", "mlp=-1", "mlp=0", "mlp=lots", "=3"):
        with pytest.raises(ValueError, match="NINFER_L2_PREFETCH"):
            l2.parse_plan(bad)
    for kw in ({"mode": "4"}, {"mode": "x"}, {"step": "64"}, {"mode": "3", "step": "24"},
               {"blocks": "0"}, {"blocks": "5000"}):
        with pytest.raises(ValueError, match="NINFER_L2_PREFETCH_"):
            l2.parse_plan("out=all", **kw)


def test_rows_a_budget_covers():
    a, b = _stack(1, 1000, 512), _stack(1, 300, 512)
    row = 512 // 2 + (512 // 64) * 4  # codes and fp32 scales of one row: 288 bytes
    assert l2.rows_for([a, b], None, "concat") == [-1, -1]
    # concat: the first matrix's rows first, the rest of the budget to the next
    assert l2.rows_for([a, b], 1000 * row / 1e6, "concat") == [1000, 0]
    assert l2.rows_for([a, b], 1100.5 * row / 1e6, "concat") == [1000, 100]
    assert l2.rows_for([a, b], 1e3, "concat") == [1000, 300]
    # parallel: the same first rows of each (the MLP's tile u reads rows 16u.. of gate and up)
    assert l2.rows_for([a, b], 200 * 2 * row / 1e6, "parallel") == [200, 200]
    assert l2.rows_for([a, b], 1e3, "parallel") == [1000, 300]


def test_passes_x_through_where_it_does_not_run(monkeypatch):
    """On this CPU (no CUDA op), for the references and for prefill-sized rows the point is x
    itself, whatever the setting; an unknown point is an error, not silence."""
    monkeypatch.setenv("NINFER_L2_PREFETCH", "in=all,out=all,mlp=all")
    views = [Stacked(_stack(2, 64, 128), jnp.array([1], jnp.int32))]
    x = jnp.ones((1, 1, 128), jnp.bfloat16)
    for kernels in ("xla", "pallas"):
        assert l2.at_point(x, "out", views, kernels) is x
    monkeypatch.setattr(cuda_ops, "available", lambda: True)
    big = jnp.ones((1, 8, 128), jnp.bfloat16)
    assert l2.at_point(big, "out", views, "pallas") is big  # 8 rows: a prefill chunk
    assert l2.at_point(x, "out", [_stack(2, 64, 128)], "pallas") is x  # not a layer view
    with pytest.raises(ValueError, match="point must be one of"):
        l2.at_point(x, "down", views, "pallas")
    monkeypatch.setenv("NINFER_L2_PREFETCH", "sideways=1")
    with pytest.raises(ValueError, match="NINFER_L2_PREFETCH"):
        l2.at_point(x, "out", views, "pallas")


def test_lowers_to_one_aliased_call_for_cuda(monkeypatch):
    """With the op available, a point is one call of the FFI target taking x, the index and
    each matrix's codes and scales, its output aliasing x, the rows in its attributes."""
    monkeypatch.setattr(cuda_ops, "available", lambda: True)
    plan = l2.parse_plan("mlp=all")
    views = [Stacked(_stack(3, 64, 128), jnp.array([2], jnp.int32)),
             Stacked(_stack(3, 64, 128, seed=1), jnp.array([2], jnp.int32))]
    exp = export.export(
        jax.jit(lambda x: l2.at_point(x, "mlp", views, "pallas", plan) * 2),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(cuda_ops.L2_TARGET)])(
        jnp.ones((2, 1, 128), jnp.bfloat16))
    text = exp.mlir_module()
    assert text.count(cuda_ops.L2_TARGET) == 1
    assert "output_operand_aliases" in text
    assert "rows = dense<-1> : tensor<4xi64>" in text


@pytest.mark.gpu
@pytest.mark.parametrize("mode,step", [(1, 32), (1, 128), (2, 128), (3, 4096), (3, 16384)])
def test_passes_x_through_bitwise_on_gpu(mode, step):
    assert on_gpu() and cuda_ops.available()
    w = _stack(4, 5120, 6144)
    idx = jnp.array([3], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (2, 1, 6144), jnp.bfloat16)
    plan = l2.parse_plan("out=all,mlp=7.5", mode=str(mode), step=str(step))
    for point in ("out", "mlp"):
        f = jax.jit(lambda x: l2.at_point(x, point, [Stacked(w, idx)], "pallas", plan))
        np.testing.assert_array_equal(np.asarray(f(x), np.float32), np.asarray(x, np.float32))

    # x used again after the call: XLA cannot alias them, the op copies x
    def both(x):
        y = l2.at_point(x, "out", [Stacked(w, idx)], "pallas", plan)
        return y + 1, x * 2
    y, x2 = jax.jit(both)(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x + 1))
    np.testing.assert_array_equal(np.asarray(x2), np.asarray(x * 2))


@pytest.mark.gpu
def test_decode_step_is_bitwise_the_same_with_every_point_on_gpu(monkeypatch):
    """Two blocks of the 27B's widths, int4_g64 (every GEMV and the MLP op on the CUDA path):
    a paged decode step for two rows gives the same logits and cache with each mode's
    prefetches at every point as without any."""
    assert on_gpu() and cuda_ops.available()
    from bench.bench_27b import random_paged_cache, random_params
    from engine import model as M
    from engine.config import QWEN38_27B

    cfg = dataclasses.replace(QWEN38_27B, name="27b-2blocks", num_layers=8, vocab_size=32768,
                              mtp_layers=0)
    params = random_params(cfg, jnp.bfloat16, "int4_g64")
    tok = jnp.array([[5], [9]], jnp.int32)

    def step():
        fwd = jax.jit(lambda p, t, c: M.forward(p, cfg, t, c, last_only=True,
                                                kernels="pallas"), donate_argnums=(2,))
        cache = random_paged_cache(cfg, 300, jnp.bfloat16, batch=2)
        logits, _, cache = fwd(params, tok, cache)
        return np.asarray(logits), np.asarray(cache.rec), np.asarray(cache.pool.k, np.float32)

    monkeypatch.delenv("NINFER_L2_PREFETCH", raising=False)
    want = step()
    for mode in ("1", "2", "3"):
        monkeypatch.setenv("NINFER_L2_PREFETCH", "in=all,out=all,mlp=24")
        monkeypatch.setenv("NINFER_L2_PREFETCH_MODE", mode)
        got = step()
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
