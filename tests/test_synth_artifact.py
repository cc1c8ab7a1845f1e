"""bench/synth_artifact.py: a real .ninfer artifact with random weights that loads and generates."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.synth_artifact import expected_bytes, synth_artifact  # noqa: E402
from engine.io.artifact import open_artifact  # noqa: E402
from engine.ops.quant import INT4_G64, QTensor  # noqa: E402


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "tiny-int4.ninfer"
    return synth_artifact(out, "tiny", "int4_g64", seed=3)


def test_layout_identity_and_determinism(tiny_int4, tmp_path):
    path = Path(tiny_int4["path"])
    with open_artifact(path, expected_sha256=tiny_int4["sha256"], verify=True) as art:
        cfg = art.config
        assert cfg.name == "tiny" and art.tokenizer_json and art.chat_template
        assert art.extra["synthetic"] is True
        lm, emb = art.load("lm_head"), art.load("embed_tokens")
        assert isinstance(lm, QTensor) and lm.fmt == INT4_G64
        assert str(emb.dtype) == "bfloat16"
        assert art.load("norm").dtype == np.float32
        assert art.load("layers.0.linear_attn.conv1d").dtype == np.float32
        assert np.count_nonzero(np.asarray(lm.data)) > lm.data.size // 2
        assert np.count_nonzero(np.asarray(emb, np.float32)) > emb.size // 2
        payload = sum(p["bytes"] for e in art.directory["tensors"].values()
                      for p in e["parts"].values())
        assert payload == expected_bytes(cfg, "int4_g64")
    # Same seed, same bytes, whichever writer: the parallel one (the fixture's, the default)
    # writes exactly what engine.io.artifact.write_artifact writes.
    assert tiny_int4["writer"] == "parallel"
    again = synth_artifact(tmp_path / "again.ninfer", "tiny", "int4_g64", seed=3,
                           writer="engine")
    assert again["sha256"] == tiny_int4["sha256"]
    assert (tmp_path / "again.ninfer").read_bytes() == path.read_bytes()


def test_bf16_format(tmp_path):
    r = synth_artifact(tmp_path / "ts.ninfer", "test-small", "bf16", seed=1)
    with open_artifact(r["path"], verify=True) as art:
        assert str(art.load("lm_head").dtype) == "bfloat16"
        assert str(art.load("layers.0.mlp.up_proj").dtype) == "bfloat16"


def test_loads_with_the_loader_and_generates(tiny_int4):
    from engine.io.loader import load_model

    model = load_model(Path(tiny_int4["path"]), expected_sha256=tiny_int4["sha256"])
    assert model.sha256 == tiny_int4["sha256"] and model.model_id == "tiny"
    from tests.engine_runs import greedy_tokens

    toks, ev = greedy_tokens(model, model.tokenizer.encode("Hello there, how are you?"), 4,
                             prefill_chunk=32)
    assert ev.finish_reason == "length" and ev.error is None
    assert len(toks) == 4 and all(0 <= t < model.tokenizer.vocab_size for t in toks)


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_loader_puts_every_layer_exactly(tiny_int4, compute):
    """The loader stacks on the host while it copies: every layer of the loaded tree is the
    artifact's tensor, int4 codes and scales bit for bit, dense ones in the compute dtype."""
    import jax

    from engine.io.loader import load_model
    from engine.model.params import unstack_layer

    path = Path(tiny_int4["path"])
    model = load_model(path, compute_dtype=compute)
    dt = model.compute_dtype
    with open_artifact(path, verify=False) as art:
        cfg = art.config
        for i in range(cfg.num_layers):
            layer = unstack_layer(model.params, cfg, i)
            for name in art.tensor_names:
                if not name.startswith(f"layers.{i}."):
                    continue
                got = layer
                for part in name.split(".")[2:]:
                    got = got[part]
                want = art.load(name)
                if isinstance(want, QTensor):
                    assert np.array_equal(np.asarray(got.data), want.data), name
                    assert np.array_equal(np.asarray(got.scale), want.scale), name
                else:
                    assert got.dtype == dt, name
                    assert np.array_equal(np.asarray(got, np.float32),
                                          np.asarray(want, np.float32).astype(dt)
                                          .astype(np.float32)), name
        assert isinstance(jax.tree.leaves(model.params)[0], jax.Array)
