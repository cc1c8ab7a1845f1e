"""The engine on the GPU (-m gpu): the embedded model in bf16 with the Pallas/CUDA kernels.

The product's batch invariance: a sequence's greedy tokens are the same whether it runs alone
or beside another one (the engine always steps its fixed batch, one prefill row at a time, and
every kernel's row result is independent of the other rows)."""
from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.plan import H200, REFERENCE
from engine.runtime.sampling import SamplingParams
from tests.kernel_checks import on_gpu
from tests.test_engine_batching import alone_and_together


@pytest.fixture(scope="module")
def bf16_model(embedded_models_dir):
    from engine.io.loader import load_model

    return load_model(embedded_models_dir / "tiny.ninfer", compute_dtype="bfloat16",
                      kv_dtype="bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [H200, REFERENCE], ids=["h200", "reference"])
def test_two_sequences_together_equal_each_alone_on_gpu(bf16_model, plan):
    assert on_gpu()
    if plan.uses_cuda:
        from engine.kernels import cuda_ops

        cuda_ops.require(plan)
    eng = Engine(bf16_model, context_tokens=4096, prefill_chunk=256, max_concurrency=2,
                 max_queue=4, plan=plan)
    eng.start()
    try:
        alone, together = alone_and_together(bf16_model, eng, SamplingParams(temperature=0.0))
        assert together == alone
        for toks in alone:
            assert len(toks) == 64 and len(set(toks)) >= 8  # not a collapsed continuation
    finally:
        eng.stop()
