"""Tiny random transformers models with a ModelConfig's shapes, and the helpers that compare our
forward with them (shared by test_model_hf.py and test_convert_e2e.py).

Randomisation: norm weights, A_log and dt_bias default to constants that hide norm and decay bugs,
so they are drawn at random; every other weight is scaled up so greedy continuations are peaked and
varied rather than near-ties or loops.
"""
from __future__ import annotations

import numpy as np
import torch
import transformers

from engine.io.hf_config import hf_text_config_dict
from engine.model.config import ModelConfig

WEIGHT_SCALE = 3.0
ARCHS = ("qwen3_5", "qwen3_next")  # Qwen3_5ForCausalLM, dense Qwen3NextForCausalLM


def _hf_model_class(cfg: ModelConfig, arch: str):
    kwargs = hf_text_config_dict(cfg)
    if arch == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**kwargs), transformers.Qwen3_5ForCausalLM
    if arch == "qwen3_next":
        # Dense Qwen3-Next: every layer in mlp_only_layers; HF still wants an expert count.
        hcfg = transformers.Qwen3NextConfig(**kwargs, num_experts=4, num_experts_per_tok=2,
                                            mlp_only_layers=list(range(cfg.num_layers)))
        return hcfg, transformers.Qwen3NextForCausalLM
    raise ValueError(f"unknown arch {arch!r}; known: {ARCHS}")


def build_hf(cfg: ModelConfig, seed: int = 0, arch: str = "qwen3_5",
             weight_scale: float = WEIGHT_SCALE):
    """A random fp32 HF causal LM with cfg's shapes (eager attention, eval mode)."""
    torch.manual_seed(seed)
    hcfg, cls = _hf_model_class(cfg, arch)
    hcfg._attn_implementation = "eager"
    model = cls(hcfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:  # gated norm: plain weight around 1
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight"):  # zero-centred norms: 1 + w
                p.uniform_(-0.5, 0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 8.0)))
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 1.0)
            else:
                p.mul_(weight_scale)
    return model


def canonical_weights(model) -> dict[str, np.ndarray]:
    """Qwen3_5ForCausalLM state dict -> canonical names (no `model.` prefix / `.weight` suffix,
    conv squeezed)."""
    flat = {}
    for name, t in model.state_dict().items():
        name = name.removeprefix("model.").removesuffix(".weight")
        a = t.detach().numpy()
        flat[name] = a[:, 0, :] if name.endswith("conv1d") else a
    return flat


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """HF full-forward logits [B, T, V] fp32 for tokens [B, T]."""
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def rel_err(ours, ref) -> float:
    """max|ours - ref| / max|ref|, in float64."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())
