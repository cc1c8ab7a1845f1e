"""The embedded models: deterministic weights from integers, identical on every machine.

`tiny` is the random model the tests run on; `tiny-chat` (engine/io/tiny_chat.py) is the same
architecture with trained weights, the CPU lane's default; `tiny-tools` is a test-only variant of it that starts tool calls often
(see `tool_happy_tensors`), so that tests of tool_choice "none"/"required" mean something on a
random model.

Every weight is k * 2**-e with k an integer in [-128, 127] drawn from a counter-based hash
(splitmix64 of a per-tensor seed and the element index) and e a per-tensor exponent. Such values
are exact in bf16 and fp32, so the artifact's bytes (and its sha256) depend on nothing but this
file: no float RNG whose output could change between library versions.
"""
from __future__ import annotations

import hashlib
import math
import dataclasses
from typing import Iterator

import ml_dtypes
import numpy as np

from engine.io.tiny_chat import TINY_CHAT, trained_tensors
from engine.model.config import TINY, ModelConfig

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_CHUNK = 1 << 22  # elements hashed at a time: bounds peak memory to ~100 MB


def _splitmix64(counter: np.ndarray, seed: np.uint64) -> np.ndarray:
    # uint64 arithmetic wraps modulo 2**64, which is what splitmix64 wants.
    z = seed + (counter + np.uint64(1)) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _tensor_seed(name: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.sha256(b"ninfer-tiny/" + name.encode()).digest()[:8],
                                    "little"))


def hashed_ints(name: str, n: int) -> np.ndarray:
    """n integers in [-128, 127] (int16) for tensor `name`, from the top 8 bits of splitmix64."""
    seed = _tensor_seed(name)
    out = np.empty(n, dtype=np.int16)
    with np.errstate(over="ignore"):
        for start in range(0, n, _CHUNK):
            stop = min(n, start + _CHUNK)
            z = _splitmix64(np.arange(start, stop, dtype=np.uint64), seed)
            out[start:stop] = (z >> np.uint64(56)).astype(np.int16) - 128
    return out


def _exponent_for_std(std: float) -> int:
    # A uniform integer on [-128, 127] has standard deviation ~73.9.
    return int(round(math.log2(73.9 / std)))


def _weight_std(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[float, float]:
    """(offset, std) for a tensor: the rules that make the tiny model generate varied text."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("A_log",):
        return 0.0, 0.5
    if leaf == "dt_bias":
        return 0.0, 0.5
    if leaf == "conv1d":
        return 0.0, 0.5
    if name == "embed_tokens":
        return 0.0, 1.0
    if name == "lm_head":
        # Peaked logits: greedy continuations are far from ties, so token-identity checks mean
        # something.
        return 0.0, 4.0 / math.sqrt(cfg.hidden_size)
    if len(shape) == 1:  # zero-centred norm weights: (1 + w) with small w
        return 0.0, 0.125
    return 0.0, 1.0 / math.sqrt(shape[-1])


def tiny_tensors(cfg: ModelConfig = TINY) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (canonical name, bf16 array) for every tensor of `cfg`, in sorted name order."""
    specs = cfg.tensor_specs()
    for name in sorted(specs):
        shape = specs[name]
        n = int(np.prod(shape))
        _, std = _weight_std(name, shape, cfg)
        scale = np.float32(2.0 ** -_exponent_for_std(std))
        vals = hashed_ints(name, n).astype(np.float32) * scale  # exact: 8-bit integer x 2**-e
        yield name, vals.reshape(shape).astype(ml_dtypes.bfloat16)


# ---- the tool-happy variant ------------------------------------------------------------------

TOOL_CALL_ID = 248058   # <tool_call>
TOOL_FEATURE = 0        # the hidden dimension that carries the constant feature
TOOL_FEATURE_EMBED = 8.0    # that dimension of every token embedding
TOOL_CALL_WEIGHT = 4.0      # that dimension's weight in the <tool_call> row of lm_head
TINY_TOOLS = dataclasses.replace(TINY, name="tiny-tools")
EMBEDDED = {"tiny": TINY, "tiny-tools": TINY_TOOLS, "tiny-chat": TINY_CHAT}
# sha256 of each embedded model's .ninfer artifact (a lane profile pins its own model too)
EMBEDDED_SHA256 = {
    "tiny": "26c34d35bd3da7440bc410de28004d05509c57c57b1f20d9ef7eff275696b19c",
    "tiny-tools": "7cfa6f7150a0bb60872cfcbef87a0e1904edf3cb38d201fc7c15bf52229f886f",
    "tiny-chat": "a9549f70d15ba2e1be2e5fd82d1376275b3326f4e075871bd405fdde071b6449",
}


# An embedded model's sampling defaults (the artifact's `extra.generation`): what a request
# that names no temperature or top_p samples with. tiny-chat was trained and evaluated greedy
# (engine/train/evaluate.py); sampled at temperature 1 its copy of a path into a tool call
# goes wrong in about half of OMP's turns (docs/benchmarks/trained_tiny.json).
GENERATION = {"tiny-chat": {"temperature": 0.0}}


def embedded_config(name: str) -> ModelConfig:
    """The config of an embedded model by name ("tiny", "tiny-tools"); KeyError if unknown."""
    return EMBEDDED[name]


def embedded_tensors(cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors of an embedded model: `tiny_tensors`, plus the tool boost for tiny-tools, or
    the shipped trained tensors for tiny-chat."""
    if cfg.name == TINY_CHAT.name:
        return trained_tensors(tiny_tensors(TINY))
    return tool_happy_tensors(cfg) if cfg.name == TINY_TOOLS.name else tiny_tensors(cfg)


def tool_happy_tensors(cfg: ModelConfig = TINY_TOOLS) -> Iterator[tuple[str, np.ndarray]]:
    """`tiny` with a constant feature that raises the `<tool_call>` logit at every position.

    Every token embedding is 8 in hidden dimension 0, so the residual stream carries a large,
    slowly varying component there; after the final norm it is still large, and the lm_head row
    of `<tool_call>` weighs it by 4. The call token then competes with the best ordinary
    tokens: sampled at temperature 1 it comes within a few tokens in most turns, but rarely
    first. Values stay exact in bf16 (small multiples of powers of two)."""
    for name, arr in tiny_tensors(cfg):
        if name == "embed_tokens":
            arr = arr.copy()
            arr[:, TOOL_FEATURE] = ml_dtypes.bfloat16(TOOL_FEATURE_EMBED)
        elif name == "lm_head":
            arr = arr.copy()
            arr[TOOL_CALL_ID, TOOL_FEATURE] = ml_dtypes.bfloat16(TOOL_CALL_WEIGHT)
        yield name, arr
