"""Lane profiles: the optional `kernels` field, its validation, and the canonical hash."""
from __future__ import annotations

import time

import pytest

from engine.kernels import KERNEL_CHOICES
from lanes.profile import PROFILE_DIR, LaneProfile, ProfileError, load_profile


def _toml(tmp_path, extra: str = "", drop: str | None = None):
    text = (PROFILE_DIR / "cpu.toml").read_text()
    if drop:
        text = "\n".join(x for x in text.splitlines() if not x.startswith(f"{drop} ="))
    p = tmp_path / "lane.toml"
    p.write_text(text + "\n" + extra)
    return p


def test_shipped_profile_defaults_to_xla_and_keeps_its_hash(tmp_path):
    cpu = load_profile("cpu")
    assert cpu.kernels == "xla"
    # Saying kernels = "xla" explicitly is the same profile: same canonical hash.
    explicit = load_profile(str(_toml(tmp_path, 'kernels = "xla"')))
    assert explicit == cpu and explicit.canonical_hash() == cpu.canonical_hash()
    # The default stays out of the hash, so adding the field left existing hashes unchanged.
    import hashlib
    import json

    d = cpu.to_dict()
    del d["kernels"]
    assert cpu.canonical_hash() == hashlib.sha256(
        json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_pallas_profile_is_accepted_and_hashes_differently(tmp_path):
    p = load_profile(str(_toml(tmp_path, 'kernels = "pallas"')))
    assert p.kernels == "pallas"
    assert p.canonical_hash() != load_profile("cpu").canonical_hash()
    assert {"xla", "pallas"} <= set(KERNEL_CHOICES)


def test_bad_kernels_value_is_refused(tmp_path):
    with pytest.raises(ProfileError, match="kernels must be one of"):
        load_profile(str(_toml(tmp_path, 'kernels = "cuda"')))
    with pytest.raises(ProfileError, match="kernels"):
        LaneProfile(**{**load_profile("cpu").to_dict(), "kernels": "triton"})


def test_required_fields_still_required_and_unknown_refused(tmp_path):
    with pytest.raises(ProfileError, match=r"missing fields \['prefill_chunk'\]"):
        load_profile(str(_toml(tmp_path, drop="prefill_chunk")))
    with pytest.raises(ProfileError, match=r"unknown fields \['kernel'\]"):
        load_profile(str(_toml(tmp_path, 'kernel = "pallas"')))


def test_engine_refuses_bad_kernels(tiny_model):
    from engine.engine import Engine

    with pytest.raises(ValueError, match="kernels must be one of"):
        Engine(tiny_model, context_tokens=256, prefill_chunk=32, kernels="cuda")


def _greedy(model, kernels: str, text: str, n: int) -> list[int]:
    from tests.engine_runs import greedy_tokens

    toks, done = greedy_tokens(model, model.tokenizer.encode(text), n, kernels=kernels)
    assert done.error is None, done
    return toks


def test_engine_pallas_matches_xla_greedy_on_tiny(tiny_model):
    """The engine with kernels="pallas" (Pallas interpreter on the CPU) produces the same greedy
    tokens as "xla" for a short prompt (the tiny model's lm_head gives peaked logits)."""
    text = "def fibonacci(n):\n    "
    t0 = time.monotonic()
    want = _greedy(tiny_model, "xla", text, 6)
    got = _greedy(tiny_model, "pallas", text, 6)
    assert got == want, (got, want)
    assert time.monotonic() - t0 < 300
