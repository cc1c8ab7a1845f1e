"""Layer views of stacked weights, so a Pallas kernel reads a layer's matrix in place.

The block scan stacks each weight as [num_blocks, (gdn_per_block,) out, in]. Slicing one
layer's matrix out of that stack with a traced index makes XLA copy it before a custom call can
read it (a fused XLA matmul can read the slice in place; a Pallas call cannot), which would
triple a decode step's weight traffic. With kernels="pallas" the scan therefore hands `linear`
a `Stacked` view (the whole stack plus the layer's leading indices); the GEMV kernel indexes
the stack itself, and any other consumer calls `materialize()` to get the plain slice.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from engine.ops.quant import QTensor


@dataclass(frozen=True, eq=False)
class Stacked:
    """w: an array or QTensor with leading stack dims; index: int32 [len(leading dims)]."""
    w: object
    index: object

    def materialize(self):
        """The selected layer's weight (a dynamic slice: XLA copies it)."""
        idx = tuple(self.index[d] for d in range(self.index.shape[0]))

        def take(a):
            start = idx + (0,) * (a.ndim - len(idx))
            size = (1,) * len(idx) + a.shape[len(idx):]
            return lax.dynamic_slice(a, start, size).reshape(a.shape[len(idx):])
        if isinstance(self.w, QTensor):
            return QTensor(take(self.w.data), take(self.w.scale), self.w.fmt, self.w.shape)
        return take(self.w)


jax.tree_util.register_dataclass(Stacked, data_fields=["w", "index"], meta_fields=[])


def plain(w):
    """A layer weight as an array: a `Stacked` view materialized, anything else as it is."""
    return w.materialize() if isinstance(w, Stacked) else w


# The layer matrices `linear` consumes (the canonical tensor names' last parts).
MATRICES = frozenset({"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                      "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj"})


# The layer norms' weights, also handed out as views: the decode step's fused norm kernels
# (engine/kernels/norm_sums.py, attn_prep.py) read them from the stack too; `plain`
# materializes them for every other consumer.
NORMS = frozenset({"input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"})


def _is_matrix(path, leaf) -> bool:
    return bool(path) and str(getattr(path[-1], "key", "")) in MATRICES | NORMS


def select_layer(tree, index, lead: int):
    """The params of one layer of a stacked tree: matrices and layer norms as `Stacked` views
    at `index` (int32 [lead]), everything else sliced. lead: how many leading stack dims the tree has."""
    index = jnp.asarray(index, jnp.int32).reshape(lead)

    def pick(path, leaf):
        if _is_matrix(path, leaf):
            return Stacked(leaf, index)
        out = leaf
        for d in range(lead):
            out = out[index[d]]
        return out
    return jax.tree_util.tree_map_with_path(pick, tree,
                                            is_leaf=lambda x: isinstance(x, QTensor))


def sub_layer(tree, j):
    """Within a tree from select_layer(.., lead=1) of stacked sub-layers ([blocks, n, ...]),
    select sub-layer j: views get a second index, plain leaves are sliced."""
    def pick(leaf):
        if isinstance(leaf, Stacked):
            return Stacked(leaf.w, jnp.concatenate([leaf.index,
                                                    jnp.asarray(j, jnp.int32).reshape(1)]))
        return leaf[j]
    return jax.tree.map(pick, tree, is_leaf=lambda x: isinstance(x, Stacked))


def flatten_stack(tree, lead: int):
    """Every leaf's `lead` leading stack dims as one ([blocks, n, ...] -> [blocks * n, ...], a
    free reshape), so that one flat layer index selects a layer (select_layer(.., lead=1))."""
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[lead:]), tree)
