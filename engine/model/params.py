"""Canonical flat tensors -> the stacked parameter pytree the forward scans over.

Layout (every leaf keeps its canonical orientation; `...` are the per-layer shapes):
    embed_tokens [V, H], norm [H], lm_head [V, H]
    blocks.gdn:  layer dict, each leaf [num_blocks, gdn_per_block, ...]
    blocks.attn: layer dict, each leaf [num_blocks, ...]
    mtp (only when cfg.mtp_layers): fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm,
                 layer (an attention layer dict, unstacked)
A layer dict nests the names below `layers.N.`: {"linear_attn": {"in_proj_qkv": ...}, "mlp": ...}.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.config import ModelConfig


class ParamError(ValueError):
    """A parameter set that does not match the model config's tensor contract."""


def _logical_shape(name: str, leaf) -> tuple[int, ...]:
    shape = getattr(leaf, "shape", None)
    if shape is None:
        raise ParamError(f"tensor {name!r}: a {type(leaf).__name__} has no .shape; quantized "
                         "weights must expose their logical [out, in] shape")
    return tuple(int(d) for d in shape)


def check_params(flat: dict, cfg: ModelConfig) -> None:
    """Raise ParamError naming every missing, unexpected or mis-shaped tensor."""
    specs = cfg.tensor_specs()
    problems = [f"missing tensor {n!r} (expected shape {specs[n]})"
                for n in sorted(set(specs) - set(flat))]
    problems += [f"unexpected tensor {n!r}" for n in sorted(set(flat) - set(specs))]
    for n in sorted(set(specs) & set(flat)):
        got = _logical_shape(n, flat[n])
        if got != specs[n]:
            problems.append(f"tensor {n!r} has shape {got}, expected {specs[n]}")
    if problems:
        raise ParamError(f"parameters do not match model config {cfg.name!r}: "
                         + "; ".join(problems))


def _nest(flat: dict, prefix: str) -> dict:
    """{'prefix.a.b': x} -> {'a': {'b': x}} for the names under `prefix.`."""
    out: dict = {}
    for name, leaf in flat.items():
        if not name.startswith(prefix + "."):
            continue
        *path, last = name[len(prefix) + 1:].split(".")
        d = out
        for part in path:
            d = d.setdefault(part, {})
        d[last] = leaf
    return out


class HostStack:
    """A stack of host arrays (or of HostStacks: the GDN blocks stack twice) not yet copied
    together: `host()` makes the one stacked array with a single copy of every byte, so the
    caller decides when (and on which thread) each leaf is built and moved to the device."""

    def __init__(self, parts: tuple):
        self.parts = parts

    def _first(self) -> np.ndarray:
        p = self.parts[0]
        return p._first() if isinstance(p, HostStack) else p

    def _lead(self) -> tuple[int, ...]:
        p = self.parts[0]
        return (len(self.parts), *(p._lead() if isinstance(p, HostStack) else ()))

    def _fill(self, out: np.ndarray) -> None:
        for i, p in enumerate(self.parts):
            if isinstance(p, HostStack):
                p._fill(out[i])
            else:
                out[i] = p

    def host(self) -> np.ndarray:
        first = self._first()
        out = np.empty(self._lead() + first.shape, first.dtype)
        self._fill(out)
        return out


def host_leaf(x):
    """A leaf of `stack_params(..., put=...)`'s tree as a host array (HostStacks built);
    device arrays and other leaves unchanged."""
    return x.host() if isinstance(x, HostStack) else x


def _stack_leaves(*xs):
    # Host arrays stack on the host (no per-shape XLA compile, one transfer per leaf), and only
    # when the leaf is put: see HostStack.
    if all(isinstance(x, (np.ndarray, HostStack)) for x in xs):
        return HostStack(xs)
    return jnp.stack([jnp.asarray(x) for x in xs])


def _stack(trees: list):
    """Stack matching pytrees leaf-wise along a new leading axis (quantized leaves included)."""
    return jax.tree.map(_stack_leaves, *trees)


def _put_all(leaves: list) -> list:
    return [jnp.asarray(host_leaf(x)) if isinstance(x, (np.ndarray, HostStack)) else x
            for x in leaves]


def stack_params(flat: dict, cfg: ModelConfig, *, put=None) -> dict:
    """flat: canonical name -> array (or opaque weight pytree exposing .shape), exactly the set of
    `cfg.tensor_specs()`. Returns the pytree described in the module docstring. Raises
    ParamError on any missing, unexpected or mis-shaped tensor.

    Host (numpy) tensors are stacked on the host and moved to the device one finished leaf at a
    time, so the device never holds a layer's tensor and its stacked copy at once. `put`
    (optional) takes the list of leaves (host arrays, HostStacks, device arrays) and returns
    them on the device in the same order; the default builds and moves them one by one."""
    check_params(flat, cfg)
    layers = [_nest(flat, f"layers.{i}") for i in range(cfg.num_layers)]
    g = cfg.full_attention_interval
    gdn_blocks = [_stack(layers[blk * g: blk * g + g - 1]) for blk in range(cfg.num_blocks)]
    params = {
        "embed_tokens": flat["embed_tokens"],
        "norm": flat["norm"],
        "lm_head": flat["lm_head"],
        "blocks": {
            "gdn": _stack(gdn_blocks),
            "attn": _stack([layers[blk * g + g - 1] for blk in range(cfg.num_blocks)]),
        },
    }
    if cfg.mtp_layers:
        mtp = _nest(flat, "mtp")
        params["mtp"] = {k: mtp[k] for k in ("fc", "pre_fc_norm_embedding",
                                             "pre_fc_norm_hidden", "norm")}
        params["mtp"]["layer"] = mtp["layers"]["0"]
    leaves, tree = jax.tree.flatten(params)
    return tree.unflatten((put or _put_all)(leaves))


def unstack_layer(params: dict, cfg: ModelConfig, i: int) -> dict:
    """The layer dict of decoder layer i out of the stacked tree (for tests and debugging)."""
    g = cfg.full_attention_interval
    blk, j = divmod(i, g)
    if cfg.is_attention_layer(i):
        return jax.tree.map(lambda x: x[blk], params["blocks"]["attn"])
    return jax.tree.map(lambda x: x[blk, j], params["blocks"]["gdn"])


def random_flat_params(cfg: ModelConfig, seed: int = 0, dtype=np.float32) -> dict:
    """Random canonical weights with sane scales (for tests and benchmarks, never for serving):
    linear weights ~ N(0, 1/in), zero-centred norm weights small, gated-norm weights near 1,
    decay parameters in the range trained models use."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in cfg.tensor_specs().items():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("linear_attn.norm"):
            a = rng.uniform(0.5, 1.5, shape)
        elif leaf.endswith("norm") or leaf.startswith("pre_fc_norm"):
            a = rng.uniform(-0.3, 0.3, shape)
        elif leaf == "A_log":
            a = np.log(rng.uniform(0.5, 8.0, shape))
        elif leaf == "dt_bias":
            a = rng.normal(0.0, 1.0, shape)
        elif leaf == "conv1d":
            a = rng.normal(0.0, shape[-1] ** -0.5, shape)
        elif leaf == "embed_tokens":
            a = rng.normal(0.0, 1.0, shape)
        else:
            a = rng.normal(0.0, shape[-1] ** -0.5, shape)
        out[name] = a.astype(dtype)
    return out
