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


@pytest.mark.gpu
def test_short_piece_matches_the_padded_piece_on_gpu(bf16_model):
    """The h200 plan's short pieces (engine/plan.py short_piece): after a 64-token history,
    a 5-token remainder run 8 wide (the decode GEMV, the recurrent GDN kernel) gives the last
    token's logits, position and GDN states of the same remainder padded to 64 (the prefill
    path), within bf16's bound; and an engine with short pieces starts with the padded
    engine's first token. Later greedy tokens may part: on an H100 the two engines' 16 tokens
    agreed on the first five (two kernel paths' bf16 rounding on the random embedded model)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    import engine.model.model as M
    from engine.kernels import cuda_ops
    from tests.engine_runs import greedy_tokens
    from tests.kernel_checks import assert_close
    from tests.test_engine_padding import _paged_cache

    plan = H200
    assert on_gpu() and plan.short_piece == 8
    cuda_ops.require(plan)
    cfg, params = bf16_model.cfg, bf16_model.params

    ids = bf16_model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)[:69]
    fwd = M.jit_forward()

    def run(width: int):
        _, _, cache = fwd(params, cfg, jnp.asarray([ids[:64]], jnp.int32),
                          _paged_cache(cfg, 1, 4, jnp.bfloat16),
                          lengths=jnp.asarray([64], jnp.int32), last_only=True, plan=plan)
        tok = np.zeros((1, width), np.int32)
        tok[0, :5] = ids[64:]
        logits, _, cache = fwd(params, cfg, jnp.asarray(tok), cache,
                               lengths=jnp.asarray([5], jnp.int32), last_only=True, plan=plan)
        return jax.device_get(logits[0, 0]).astype(np.float32), jax.device_get(cache)

    (short, c8), (padded, c64) = run(8), run(64)
    assert_close(short, padded, jnp.bfloat16)
    assert list(c8.pos) == list(c64.pos) == [69]
    for name in ("conv", "rec"):
        assert_close(np.asarray(getattr(c8, name), np.float32),
                     np.asarray(getattr(c64, name), np.float32), jnp.bfloat16)
    kw = dict(context_tokens=512, prefill_chunk=64, max_concurrency=1)
    with_short, _ = greedy_tokens(bf16_model, ids[:77], 16, plan=plan, **kw)
    without, _ = greedy_tokens(bf16_model, ids[:77], 16,
                               plan=dataclasses.replace(plan, short_piece=0), **kw)
    assert len(with_short) == len(without) == 16 and with_short[0] == without[0]


# What release/build.py does for a GPU lane, in a process of its own: the forwards of an engine of
# the h200 plan exported for "cuda", one file per (rows, width).
_EXPORT_FOR_CUDA = """
import sys
from pathlib import Path

from engine.engine import Engine
from engine.io.loader import load_model
from engine.plan import H200
from engine.runtime.exported import export_forwards

model = load_model(Path(sys.argv[1]), compute_dtype="bfloat16", kv_dtype="bfloat16")
eng = Engine(model, plan=H200, context_tokens=256, prefill_chunk=32, max_concurrency=2,
             max_queue=2)
for (rows, width), blob in export_forwards(eng.runner, eng.mem.cache, "cuda").items():
    (Path(sys.argv[2]) / f"{rows}x{width}.jaxexport").write_bytes(blob)
"""


@pytest.mark.gpu
def test_cuda_exports_give_the_live_tokens_on_gpu(bf16_model, embedded_models_dir, tmp_path):
    """A GPU lane's bundle holds forwards exported for "cuda". Exported in another process,
    loaded here without tracing the model, they give the live-jitted h200 engine's 36 greedy
    tokens. The release exports on a machine with no GPU under the lock's jax 0.10.2, whose
    Triton lowering needs no device; under jax 0.11 it needs one (or an abstract device:
    "No supported GPU devices found"), so there the exporting process sees the GPU."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import jax

    from engine.kernels import cuda_ops
    from tests.engine_runs import exported_and_live

    assert on_gpu()
    cuda_ops.require(H200)

    old = tuple(int(n) for n in jax.__version__.split(".")[:2]) < (0, 11)
    env = dict(os.environ, JAX_PLATFORMS="cpu" if old else "cuda")
    subprocess.run([sys.executable, "-c", _EXPORT_FOR_CUDA,
                    str(embedded_models_dir / "tiny.ninfer"), str(tmp_path)],
                   env=env, cwd=Path(__file__).resolve().parent.parent, check=True,
                   timeout=600)
    blobs = {tuple(int(n) for n in f.stem.split("x")): f.read_bytes()
             for f in tmp_path.glob("*.jaxexport")}
    kw = dict(plan=H200, context_tokens=256, prefill_chunk=32, max_concurrency=2,
              max_queue=2)
    ids = bf16_model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:40]
    got, live, counts, done = exported_and_live(bf16_model, ids, 36, blobs, **kw)
    assert sorted(blobs) and counts["exported"] == len(blobs) and counts["compiled"] == 0
    assert done.finish_reason == "length" and got == live
