"""HF `config.json` (Qwen3.5 / Qwen3-Next text models) <-> our ModelConfig."""
from __future__ import annotations

from engine.model.config import ConfigError, ModelConfig

_SUPPORTED = {"qwen3_5_text": "qwen3_5", "qwen3_5": "qwen3_5", "qwen3_next": "qwen3_next"}


def _text_part(d: dict) -> dict:
    """The text model's fields: VL checkpoints (Qwen3_5ForConditionalGeneration) nest them."""
    if "text_config" in d:
        return {**d["text_config"], "model_type": d["text_config"].get("model_type",
                                                                        d.get("model_type"))}
    return d


def _interval(t: dict, name: str) -> int:
    """full_attention_interval, checked against layer_types when both are present."""
    n = t["num_hidden_layers"]
    types = t.get("layer_types")
    interval = t.get("full_attention_interval")
    if interval is None:
        if not types or "full_attention" not in types:
            raise ConfigError(f"{name}: neither full_attention_interval nor usable layer_types")
        interval = types.index("full_attention") + 1
    if types is not None:
        want = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(n)]
        if list(types) != want:
            raise ConfigError(f"{name}: layer_types do not follow the [linear_attention] * "
                              f"{interval - 1} + [full_attention] pattern this engine runs")
    return int(interval)


def _rope(t: dict, name: str) -> tuple[float, float]:
    rp = t.get("rope_parameters") or t.get("rope_scaling") or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{name}: rope_type {rope_type!r} is not supported (only default)")
    theta = rp.get("rope_theta", t.get("rope_theta"))
    factor = rp.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
    if theta is None:
        raise ConfigError(f"{name}: rope_theta missing")
    return float(theta), float(factor)


def _refuse_unsupported(t: dict, name: str) -> None:
    if t.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{name}: hidden_act {t['hidden_act']!r} is not supported (silu)")
    if t.get("attention_bias"):
        raise ConfigError(f"{name}: attention_bias is not supported")
    if t.get("num_experts", 0):
        raise ConfigError(f"{name}: mixture-of-experts MLPs are not supported (dense only)")


def model_config_from_hf(hf_config_dict: dict, name: str) -> ModelConfig:
    """Map an HF config dict to ModelConfig; raises ConfigError on anything we cannot run.

    `tie_word_embeddings` has no place in ModelConfig: a tied checkpoint must get an explicit
    `lm_head` copy of `embed_tokens` from the converter.
    """
    t = _text_part(hf_config_dict)
    layout = _SUPPORTED.get(t.get("model_type", "qwen3_5_text"))
    if layout is None:
        raise ConfigError(f"{name}: model_type {t.get('model_type')!r} is not a Qwen3.5/3-Next "
                          "text model")
    _refuse_unsupported(t, name)
    try:
        theta, factor = _rope(t, name)
        return ModelConfig(
            name=name, vocab_size=t["vocab_size"], hidden_size=t["hidden_size"],
            intermediate_size=t["intermediate_size"], num_layers=t["num_hidden_layers"],
            full_attention_interval=_interval(t, name), num_heads=t["num_attention_heads"],
            num_kv_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
            partial_rotary_factor=factor, rope_theta=theta,
            linear_num_key_heads=t["linear_num_key_heads"],
            linear_num_value_heads=t["linear_num_value_heads"],
            linear_key_head_dim=t["linear_key_head_dim"],
            linear_value_head_dim=t["linear_value_head_dim"],
            linear_conv_kernel=t.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            mtp_layers=int(t.get("mtp_num_hidden_layers", t.get("num_nextn_predict_layers", 0))),
            max_position=int(t.get("max_position_embeddings", 262144)),
            source_layout=layout,
        )
    except KeyError as e:
        raise ConfigError(f"{name}: HF config lacks field {e.args[0]!r}") from None


def hf_text_config_dict(cfg: ModelConfig) -> dict:
    """The Qwen3_5TextConfig keyword arguments describing `cfg` (tests build HF models from it).
    MTP is not represented: HF has no MTP module."""
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        layer_types=cfg.layer_types, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor},
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position, tie_word_embeddings=False,
        hidden_act="silu", attention_bias=False,
    )
