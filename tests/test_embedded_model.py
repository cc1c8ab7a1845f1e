"""The embedded models are the same bytes on every machine: their sha256 is pinned."""
from __future__ import annotations

import numpy as np

from engine.io.artifact import open_artifact
from engine.io.loader import build_embedded, embedded_pin
from engine.io.tiny import EMBEDDED_SHA256, hashed_ints, tiny_tensors
from engine.model.config import TINY


def test_embedded_tiny_matches_the_pin(tmp_path):
    sha = build_embedded("tiny", tmp_path / "tiny.ninfer")
    assert sha == embedded_pin("tiny") == EMBEDDED_SHA256["tiny"]


def test_weights_come_from_integers():
    # Known values of the counter-based hash: a change here changes every pinned artifact.
    assert hashed_ints("probe", 6).tolist() == [-50, 48, 70, -59, 61, -39]
    for name, arr in tiny_tensors(TINY):
        x = arr.astype(np.float32).ravel()[:4096]
        # every value is an 8-bit integer times a power of two
        nz = x[x != 0]
        mant, _ = np.frexp(np.abs(nz))
        assert np.all((mant * 256) == np.round(mant * 256)), name
        if name == "layers.0.linear_attn.A_log":
            break


def test_artifact_is_complete_and_tokenizer_is_real(shared_state_dir):
    from engine.io.loader import ensure_embedded

    path = ensure_embedded(shared_state_dir, "tiny", embedded_pin("tiny"))
    art = open_artifact(path)
    assert set(art.tensor_names) == set(TINY.tensor_specs())
    assert art.config == TINY
    assert '"<|im_start|>"' in art.tokenizer_json and "<tool_call>" in art.chat_template

