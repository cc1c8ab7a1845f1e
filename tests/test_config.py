"""ModelConfig validation, presets, and the HF config mapping."""
from __future__ import annotations

import dataclasses

import pytest

from engine.io.hf_config import hf_text_config_dict, model_config_from_hf
from engine.model.config import PRESETS, QWEN38_27B, TEST_SMALL, ConfigError, ModelConfig, preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_and_roundtrip(name):
    cfg = preset(name)
    cfg.validate()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.num_blocks * cfg.full_attention_interval == cfg.num_layers
    assert hash(cfg) == hash(dataclasses.replace(cfg))  # usable as a jit static argument


def test_27b_shapes_and_param_count():
    cfg = QWEN38_27B
    assert (cfg.num_blocks, cfg.gdn_per_block, cfg.rotary_dim, cfg.conv_dim) == (16, 3, 64, 10240)
    # 26.9e9 in the HF model (no MTP) plus the MTP layer and fc.
    assert 27.2e9 < cfg.param_count() < 27.4e9
    no_mtp = dataclasses.replace(cfg, mtp_layers=0).param_count()
    assert 26.8e9 < no_mtp < 27.0e9


@pytest.mark.parametrize("change, message", [
    (dict(num_layers=6, full_attention_interval=4), "not a multiple of full_attention_interval"),
    (dict(num_heads=5), "num_heads 5 is not a multiple of num_kv_heads 2"),
    (dict(linear_num_value_heads=5), "linear_num_value_heads 5 is not a multiple"),
    (dict(full_attention_interval=1, num_layers=4), "at least one GDN layer"),
    (dict(partial_rotary_factor=0.3), "must be an even integer"),
    (dict(hidden_size=0), "hidden_size must be a positive integer"),
    (dict(head_dim=32.0), "head_dim must be a positive integer"),
    (dict(mtp_layers=2), "mtp_layers must be 0 or 1"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(source_layout="llama"), "unknown source_layout"),
])
def test_inconsistent_configs_raise(change, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(TEST_SMALL, **change)


def test_from_dict_rejects_unknown_and_missing_fields():
    d = TEST_SMALL.to_dict()
    with pytest.raises(ConfigError, match="unknown model config fields"):
        ModelConfig.from_dict({**d, "rope_scaling": None})
    d.pop("vocab_size")
    with pytest.raises(ConfigError, match="missing model config fields.*vocab_size"):
        ModelConfig.from_dict(d)
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("nope")


def _hf_27b_dict() -> dict:
    """The shape of the public Qwen3.5-27B VL config.json (text part nested, mrope sections)."""
    text = hf_text_config_dict(QWEN38_27B)
    text.update(model_type="qwen3_5_text", full_attention_interval=4, mtp_num_hidden_layers=1,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                 "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                 "mrope_section": [11, 11, 10]})
    return {"model_type": "qwen3_5", "text_config": text, "vision_config": {}}


def test_hf_config_mapping():
    assert model_config_from_hf(_hf_27b_dict(), "qwen3.8-27b") == QWEN38_27B
    flat = dict(hf_text_config_dict(TEST_SMALL), model_type="qwen3_5_text")
    del flat["rope_parameters"]
    flat.update(rope_theta=1e7, partial_rotary_factor=0.25)  # older top-level rope fields
    assert model_config_from_hf(flat, "test-small") == TEST_SMALL


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update(layer_types=["full_attention"] + t["layer_types"][1:]),
     "layer_types do not follow"),
    (lambda t: t.update(full_attention_interval=2), "layer_types do not follow"),
    (lambda t: t.pop("hidden_size"), "lacks field 'hidden_size'"),
    (lambda t: t.update(num_experts=512), "mixture-of-experts"),
    (lambda t: t.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e7}),
     "rope_type 'yarn'"),
    (lambda t: t.update(model_type="llama"), "not a Qwen3.5"),
])
def test_hf_config_refusals(edit, message):
    d = _hf_27b_dict()
    edit(d["text_config"])
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(d, "bad")
