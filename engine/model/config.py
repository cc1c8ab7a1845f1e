"""Model configuration: one frozen, validated type for the Qwen3.5/3.8 hybrid family.

The layer pattern is [GDN] * (interval - 1) + [attention], repeated `num_blocks` times. The forward
pass scans over blocks, so a 64-layer model compiles like one block.

Canonical tensor names (the contract between the converter, the artifact and the model) mirror the
Hugging Face names without the `model.` prefix and the `.weight` suffix, e.g.
`layers.3.self_attn.q_proj`, `layers.0.linear_attn.in_proj_qkv`, `embed_tokens`, `lm_head`,
`mtp.fc`. Linear weights keep the HF orientation [out_features, in_features].
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass


class ConfigError(ValueError):
    """A model configuration whose shapes do not fit together."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    full_attention_interval: int
    # gated full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel: int
    # misc
    rms_norm_eps: float = 1e-6
    mtp_layers: int = 0
    max_position: int = 262144
    # Qwen3-Next checkpoints fuse the GDN input projections; the converter splits them.
    source_layout: str = "qwen3_5"

    def __post_init__(self):
        self.validate()

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.num_layers // self.full_attention_interval

    @property
    def gdn_per_block(self) -> int:
        return self.full_attention_interval - 1

    @property
    def rotary_dim(self) -> int:
        return int(round(self.head_dim * self.partial_rotary_factor))

    @property
    def key_dim(self) -> int:  # GDN q and k width
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:  # GDN v and z width
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # channels of the depthwise conv over [q | k | v]
        return 2 * self.key_dim + self.value_dim

    def is_attention_layer(self, i: int) -> bool:
        return (i + 1) % self.full_attention_interval == 0

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if self.is_attention_layer(i) else "linear_attention"
                for i in range(self.num_layers)]

    # ---- validation -----------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"model config {self.name!r}: {msg}")

        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "full_attention_interval", "num_heads", "num_kv_heads", "head_dim",
                  "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_conv_kernel"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                 f"{f} must be a positive integer, got {v!r}")
        need(self.full_attention_interval >= 2,
             "full_attention_interval must be >= 2 (at least one GDN layer per block)")
        need(self.num_layers % self.full_attention_interval == 0,
             f"num_layers {self.num_layers} is not a multiple of full_attention_interval "
             f"{self.full_attention_interval}")
        need(self.num_heads % self.num_kv_heads == 0,
             f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
             f"linear_num_key_heads {self.linear_num_key_heads}")
        need(0.0 < self.partial_rotary_factor <= 1.0, "partial_rotary_factor must be in (0, 1]")
        need(self.rotary_dim % 2 == 0 and abs(self.rotary_dim - self.head_dim *
             self.partial_rotary_factor) < 1e-9,
             f"head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} "
             "must be an even integer")
        need(self.rope_theta > 0, "rope_theta must be positive")
        need(0 < self.rms_norm_eps < 1, "rms_norm_eps must be in (0, 1)")
        need(self.mtp_layers in (0, 1), "mtp_layers must be 0 or 1")
        need(self.source_layout in ("qwen3_5", "qwen3_next"),
             f"unknown source_layout {self.source_layout!r}")

    # ---- identity -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ConfigError(f"unknown model config fields: {sorted(unknown)}")
        missing = {f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING} - set(d)
        if missing:
            raise ConfigError(f"missing model config fields: {sorted(missing)}")
        return cls(**d)

    def canonical_hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    # ---- tensor contract ------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a complete model has, by canonical name, with its logical shape."""
        H = self.hidden_size
        specs: dict[str, tuple[int, ...]] = {
            "embed_tokens": (self.vocab_size, H),
            "norm": (H,),
            "lm_head": (self.vocab_size, H),
        }
        for i in range(self.num_layers):
            specs.update(self._layer_specs(f"layers.{i}", attention=self.is_attention_layer(i)))
        if self.mtp_layers:
            specs.update({
                "mtp.fc": (H, 2 * H),
                "mtp.pre_fc_norm_embedding": (H,),
                "mtp.pre_fc_norm_hidden": (H,),
                "mtp.norm": (H,),
            })
            specs.update(self._layer_specs("mtp.layers.0", attention=True))
        return specs

    def _layer_specs(self, p: str, attention: bool) -> dict[str, tuple[int, ...]]:
        H, I = self.hidden_size, self.intermediate_size
        s = {
            f"{p}.input_layernorm": (H,),
            f"{p}.post_attention_layernorm": (H,),
            f"{p}.mlp.gate_proj": (I, H),
            f"{p}.mlp.up_proj": (I, H),
            f"{p}.mlp.down_proj": (H, I),
        }
        if attention:
            qd, kvd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            s.update({
                f"{p}.self_attn.q_proj": (2 * qd, H),  # per head: [q | gate]
                f"{p}.self_attn.k_proj": (kvd, H),
                f"{p}.self_attn.v_proj": (kvd, H),
                f"{p}.self_attn.o_proj": (H, qd),
                f"{p}.self_attn.q_norm": (self.head_dim,),
                f"{p}.self_attn.k_norm": (self.head_dim,),
            })
        else:
            hv = self.linear_num_value_heads
            s.update({
                f"{p}.linear_attn.in_proj_qkv": (self.conv_dim, H),
                f"{p}.linear_attn.in_proj_z": (self.value_dim, H),
                f"{p}.linear_attn.in_proj_b": (hv, H),
                f"{p}.linear_attn.in_proj_a": (hv, H),
                f"{p}.linear_attn.conv1d": (self.conv_dim, self.linear_conv_kernel),
                f"{p}.linear_attn.A_log": (hv,),
                f"{p}.linear_attn.dt_bias": (hv,),
                f"{p}.linear_attn.norm": (self.linear_value_head_dim,),
                f"{p}.linear_attn.out_proj": (H, self.value_dim),
            })
        return s

    def param_count(self) -> int:
        n = 0
        for shape in self.tensor_specs().values():
            k = 1
            for d in shape:
                k *= d
            n += k
        return n


# Named presets. Variants come from dataclasses.replace(preset, ...).
QWEN38_27B = ModelConfig(
    name="qwen3.8-27b", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
    num_layers=64, full_attention_interval=4, num_heads=24, num_kv_heads=4, head_dim=256,
    partial_rotary_factor=0.25, rope_theta=1e7, linear_num_key_heads=16,
    linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel=4, rms_norm_eps=1e-6, mtp_layers=1,
)

# The embedded default: the same architecture at toy width, with the real Qwen3.5 vocabulary.
TINY = ModelConfig(
    name="tiny", vocab_size=248320, hidden_size=256, intermediate_size=512,
    num_layers=8, full_attention_interval=4, num_heads=4, num_kv_heads=2, head_dim=64,
    partial_rotary_factor=0.25, rope_theta=1e7, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel=4, rms_norm_eps=1e-6, mtp_layers=1,
)

# Test sizes: fast to compile and to compare with transformers.
TEST_SMALL = ModelConfig(
    name="test-small", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_layers=4, full_attention_interval=2, num_heads=4, num_kv_heads=2, head_dim=32,
    partial_rotary_factor=0.25, rope_theta=1e7, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel=4, rms_norm_eps=1e-6, mtp_layers=0,
)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (QWEN38_27B, TINY, TEST_SMALL)}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
