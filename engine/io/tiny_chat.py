"""The trained embedded model `tiny-chat`: TINY's shapes, weights trained on synthetic chat data
(engine/train/train_tiny_chat.py) and shipped in the repository as a small safetensors file,
pinned here by its sha256.

The file holds what training changed, int8 per row (`engine.ops.quant`'s int8_row rule) where a
tensor is a matrix, fp32 where it is a vector:
- every weight of the eight decoder layers and the final norm;
- `embed_rows` / `lm_head_rows`: the embedding and output rows of the `vocab` token ids
  training covered (every id below 40,960 in the shipped file), and `lm_head_background`, the
  one output row every other token shares.
The rest comes from rules: the other embedding rows and the MTP head are the `tiny` generator's
(engine/io/tiny.py; nothing was trained there), and every untrained token's output row is the
background row, which training pushed below the trained tokens' logits (its logit was counted
once per untrained token), so those tokens are practically never sampled.

Loading (`trained_tensors`) checks the file's sha256 first and refuses a file that differs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from engine.model.config import TINY

WEIGHTS = Path(__file__).parent / "weights" / "tiny_chat.safetensors"
WEIGHTS_SHA256 = "f6f7eb58d072897cc0caf8592255d7f8b6d2e7e6b0ae34d90f29a9c0f5576eda"
TINY_CHAT = dataclasses.replace(TINY, name="tiny-chat")


class TrainedWeightsError(ValueError):
    """The shipped trained tensors are missing or are not the pinned file."""


def _q8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from engine.ops.quant import INT8_ROW, quantize

    qt = quantize(np.ascontiguousarray(w, np.float32), INT8_ROW)
    return np.asarray(qt.data), np.asarray(qt.scale, np.float32)


def save_trained(out: Path, params: dict, vocab: np.ndarray, meta: dict) -> str:
    """Write the trained tree (`stack_params` layout over the compact vocabulary: the `vocab`
    rows, then the background row) as the shipped file; returns its sha256."""
    from safetensors.numpy import save_file

    from engine.model.params import unstack_layer

    flat: dict[str, np.ndarray] = {"norm": np.asarray(params["norm"], np.float32)}
    for i in range(TINY.num_layers):
        layer = unstack_layer(params, TINY, i)

        def walk(d, prefix):
            for k, v in d.items():
                if isinstance(v, dict):
                    walk(v, f"{prefix}.{k}")
                else:
                    flat[f"{prefix}.{k}"] = np.asarray(v, np.float32)
        walk(layer, f"layers.{i}")
    emb = np.asarray(params["embed_tokens"], np.float32)
    head = np.asarray(params["lm_head"], np.float32)
    flat["embed_rows"], flat["lm_head_rows"] = emb[:-1], head[:-1]
    flat["lm_head_background"] = head[-1]
    tensors = {"vocab": np.asarray(vocab, np.int32)}
    for name, a in sorted(flat.items()):
        if a.ndim == 2:
            tensors[name + ".q"], tensors[name + ".scale"] = _q8(a)
        else:
            tensors[name] = a
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"ninfer": json.dumps(meta, sort_keys=True)})
    return hashlib.sha256(out.read_bytes()).hexdigest()


def load_trained(path: Path = WEIGHTS, sha256: str = WEIGHTS_SHA256) -> dict[str, np.ndarray]:
    """The shipped tensors, dequantized to fp32 (name -> array, plus "vocab"), after checking
    the file's sha256 against the pin."""
    from safetensors.numpy import load

    try:
        blob = Path(path).read_bytes()
    except OSError as e:
        raise TrainedWeightsError(f"the trained weights of tiny-chat are missing: {e}") from None
    got = hashlib.sha256(blob).hexdigest()
    if got != sha256:
        raise TrainedWeightsError(f"{path}: sha256 is {got}, but engine/io/tiny_chat.py pins "
                                  f"{sha256}; the trained tensors were altered")
    raw = load(blob)
    out = {"vocab": raw.pop("vocab").astype(np.int64)}
    for name in sorted(raw):
        if name.endswith(".scale"):
            continue
        if name.endswith(".q"):
            base = name[:-2]
            out[base] = raw[name].astype(np.float32) * raw[base + ".scale"][:, None]
        else:
            out[name] = raw[name].astype(np.float32)
    return out


def trained_tensors(generated: Iterator[tuple[str, np.ndarray]], path: Path = WEIGHTS,
                    sha256: str = WEIGHTS_SHA256) -> Iterator[tuple[str, np.ndarray]]:
    """(canonical name, bf16 array) for every tensor of tiny-chat, in sorted name order:
    `generated` is the random tiny model's (engine/io/tiny.py `tiny_tensors(TINY)`, passed in
    so that this module needs nothing of that one), with the trained tensors and rows put in."""
    t = load_trained(path, sha256)
    vocab = t["vocab"]
    for name, gen in generated:
        if name == "embed_tokens":
            # as in training, where every untrained id shares one zero row: the generator's
            # random rows would put noise into a prompt wherever such an id occurs
            arr = np.zeros(gen.shape, np.float32)
            arr[vocab] = t["embed_rows"]
        elif name == "lm_head":
            arr = np.broadcast_to(t["lm_head_background"], gen.shape).copy()
            arr[vocab] = t["lm_head_rows"]
        elif name in t:
            arr = t[name]
        else:  # the MTP head: untrained, the generator's
            yield name, gen
            continue
        yield name, arr.reshape(gen.shape).astype(ml_dtypes.bfloat16)
