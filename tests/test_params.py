"""stack_params: the loud loader between canonical flat tensors and the scanned pytree."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from engine.model.config import TEST_SMALL
from engine.model.params import ParamError, random_flat_params, stack_params, unstack_layer

CFG = dataclasses.replace(TEST_SMALL, name="p", num_layers=8, full_attention_interval=4,
                          mtp_layers=1)


@pytest.fixture(scope="module")
def flat():
    return random_flat_params(CFG, seed=0)


def test_stacked_layout(flat):
    params = stack_params(flat, CFG)
    gdn, attn = params["blocks"]["gdn"], params["blocks"]["attn"]
    assert gdn["linear_attn"]["in_proj_qkv"].shape == (2, 3, CFG.conv_dim, CFG.hidden_size)
    assert gdn["linear_attn"]["conv1d"].shape == (2, 3, CFG.conv_dim, CFG.linear_conv_kernel)
    assert attn["self_attn"]["q_proj"].shape == (2, 2 * CFG.num_heads * CFG.head_dim,
                                                  CFG.hidden_size)
    assert params["mtp"]["layer"]["self_attn"]["k_norm"].shape == (CFG.head_dim,)
    # Layer 6 is block 1, GDN slot 2; layer 7 is block 1's attention layer.
    np.testing.assert_array_equal(unstack_layer(params, CFG, 6)["mlp"]["up_proj"],
                                  flat["layers.6.mlp.up_proj"])
    np.testing.assert_array_equal(unstack_layer(params, CFG, 7)["self_attn"]["o_proj"],
                                  flat["layers.7.self_attn.o_proj"])
    n = sum(x.size for x in jax.tree.leaves(params))
    assert n == CFG.param_count()


@pytest.mark.parametrize("edit, message", [
    (lambda f: f.pop("layers.5.linear_attn.A_log"), "missing tensor 'layers.5.linear_attn.A_log'"),
    (lambda f: f.update({"layers.9.mlp.up_proj": f["layers.1.mlp.up_proj"]}),
     "unexpected tensor 'layers.9.mlp.up_proj'"),
    (lambda f: f.update({"mtp.fc": f["mtp.fc"].T}),
     r"tensor 'mtp.fc' has shape \(128, 64\), expected \(64, 128\)"),
    (lambda f: f.update({"norm": [0.0] * 64}), "tensor 'norm': a list has no .shape"),
])
def test_bad_tensor_sets_fail_loudly(flat, edit, message):
    bad = dict(flat)
    edit(bad)
    with pytest.raises(ParamError, match=message):
        stack_params(bad, CFG)


def test_opaque_weight_pytrees_are_stacked_leafwise(flat):
    """Quantized weights arrive as pytrees exposing a logical .shape; stacking maps over their
    leaves."""

    @jax.tree_util.register_pytree_node_class
    class Packed:
        def __init__(self, q, scale):
            self.q, self.scale = q, scale

        @property
        def shape(self):
            return self.q.shape

        def tree_flatten(self):
            return (self.q, self.scale), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    f = dict(flat)
    for i in range(CFG.num_layers):
        name = f"layers.{i}.mlp.down_proj"
        f[name] = Packed(f[name].astype(np.int8), np.ones(f[name].shape[0], np.float32))
    down = stack_params(f, CFG)["blocks"]["gdn"]["mlp"]["down_proj"]
    assert isinstance(down, Packed)
    assert down.q.shape == (2, 3, CFG.hidden_size, CFG.intermediate_size)
    assert down.scale.shape == (2, 3, CFG.hidden_size)


def test_put_gets_each_leaf_once_and_builds_the_same_tree(flat):
    """With `put`, host tensors arrive as HostStacks (built with one copy of each byte, the GDN
    blocks' double stack included) and plain host arrays; the tree is the default one."""
    from engine.model.params import HostStack, host_leaf

    seen = []

    def put(leaves):
        seen.extend(type(x) for x in leaves)
        return [jax.device_put(host_leaf(x)) for x in leaves]

    got, want = stack_params(flat, CFG, put=put), stack_params(flat, CFG)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and np.array_equal(np.asarray(g), np.asarray(w))
    assert HostStack in seen and np.ndarray in seen
    assert len(seen) == len(jax.tree.leaves(want))
    nested = HostStack((HostStack((np.zeros(2), np.ones(2))), HostStack((np.full(2, 2.0),
                                                                         np.full(2, 3.0)))))
    assert np.array_equal(nested.host(), np.arange(4.0).repeat(2).reshape(2, 2, 2))
