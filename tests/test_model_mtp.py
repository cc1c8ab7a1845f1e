"""The MTP draft head (no HF oracle exists) and forward options, on random weights."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.model.config import TEST_SMALL, ConfigError
from engine.model.model import init_cache, jit_forward, jit_mtp_forward, mtp_forward
from engine.model.params import random_flat_params, stack_params
from engine.ops.quant import INT8_ROW, QTensor, dequantize_np, quantize

CFG = dataclasses.replace(TEST_SMALL, name="test-small-mtp", mtp_layers=1)
TOL = 1e-5
MAX_LEN = 64
FWD, MTP = jit_forward(), jit_mtp_forward()


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def setup():
    flat = random_flat_params(CFG, seed=0)
    params = stack_params(flat, CFG)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CFG.vocab_size, (2, 17)).astype(np.int32)
    _, hidden, _ = FWD(params, CFG, jnp.asarray(tokens[:, :16]), init_cache(CFG, 2, MAX_LEN))
    # Entry t pairs h_t with x_{t+1}.
    return flat, params, np.asarray(hidden), tokens[:, 1:]


def run_mtp(params, hidden, nxt, pieces):
    cache = init_cache(CFG, hidden.shape[0], MAX_LEN)
    logits, hs, start = [], [], 0
    for n in pieces:
        lg, h, cache = MTP(params, CFG, jnp.asarray(hidden[:, start:start + n]),
                           jnp.asarray(nxt[:, start:start + n]), cache)
        logits.append(np.asarray(lg))
        hs.append(np.asarray(h))
        start += n
    assert np.asarray(cache.mtp_pos).tolist() == [start] * hidden.shape[0]
    assert np.asarray(cache.pos).tolist() == [0] * hidden.shape[0]  # main model untouched
    return np.concatenate(logits, 1), np.concatenate(hs, 1)


def test_mtp_incremental_equals_full(setup):
    _, params, hidden, nxt = setup
    full, h_full = run_mtp(params, hidden, nxt, [16])
    assert full.shape == (2, 16, CFG.vocab_size) and h_full.shape == (2, 16, CFG.hidden_size)
    inc, h_inc = run_mtp(params, hidden, nxt, [10, 1, 1, 1, 1, 1, 1])
    assert rel_err(inc, full) <= TOL and rel_err(h_inc, h_full) <= TOL


def test_mtp_is_causal_and_uses_both_inputs(setup):
    _, params, hidden, nxt = setup
    base, _ = run_mtp(params, hidden, nxt, [16])
    h2 = hidden.copy()
    h2[:, 12] += 1.0
    changed_h, _ = run_mtp(params, h2, nxt, [16])
    n2 = nxt.copy()
    n2[:, 12] = (n2[:, 12] + 1) % CFG.vocab_size
    changed_x, _ = run_mtp(params, hidden, n2, [16])
    for changed in (changed_h, changed_x):
        np.testing.assert_array_equal(changed[:, :12], base[:, :12])
        assert np.abs(changed[:, 12:] - base[:, 12:]).max(axis=-1).min() > 1e-3


def _rms(x, w, eps=CFG.rms_norm_eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1.0 + w)


def test_mtp_first_entry_matches_numpy_wiring(setup):
    """At MTP position 0 attention sees one key, so softmax is 1 and RoPE cancels: the layer
    reduces to o_proj(v * sigmoid(gate)). This checks fc's input order [embedding | hidden],
    the norms and the shared lm_head independently of the attention code."""
    flat, params, hidden, nxt = setup
    f = {k: np.asarray(v, np.float64) for k, v in flat.items()}
    sig = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    e = _rms(f["embed_tokens"][nxt[0, 0]], f["mtp.pre_fc_norm_embedding"])
    h = _rms(hidden[0, 0].astype(np.float64), f["mtp.pre_fc_norm_hidden"])
    x = f["mtp.fc"] @ np.concatenate([e, h])
    p = "mtp.layers.0."
    a = _rms(x, f[p + "input_layernorm"])
    hd, nh, kvh = CFG.head_dim, CFG.num_heads, CFG.num_kv_heads
    gate = (f[p + "self_attn.q_proj"] @ a).reshape(nh, 2 * hd)[:, hd:]
    v = (f[p + "self_attn.v_proj"] @ a).reshape(kvh, hd)
    v = np.repeat(v, nh // kvh, axis=0)
    x = x + f[p + "self_attn.o_proj"] @ (v * sig(gate)).reshape(-1)
    m = _rms(x, f[p + "post_attention_layernorm"])
    silu = lambda z: z * sig(z)  # noqa: E731
    x = x + f[p + "mlp.down_proj"] @ (silu(f[p + "mlp.gate_proj"] @ m) * (f[p + "mlp.up_proj"] @ m))
    ref = f["lm_head"] @ _rms(x, f["mtp.norm"])
    ours, _ = run_mtp(params, hidden, nxt, [16])
    assert rel_err(ours[0, 0], ref) <= 1e-4


def test_mtp_requires_mtp_config():
    params = stack_params(random_flat_params(TEST_SMALL), TEST_SMALL)
    with pytest.raises(ConfigError, match="no MTP"):
        mtp_forward(params, TEST_SMALL, jnp.zeros((1, 1, 64)), jnp.zeros((1, 1), jnp.int32),
                    init_cache(TEST_SMALL, 1, 8))


def test_last_only_logits_pick_each_rows_last_valid_token(setup):
    _, params, _, _ = setup
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 16)),
                         jnp.int32)
    lengths = jnp.asarray([16, 9], jnp.int32)
    # Causality: position 8 of an unpadded run is what a 9-token row ends on.
    full, _, _ = FWD(params, CFG, tokens, init_cache(CFG, 2, MAX_LEN))
    last, _, cache = FWD(params, CFG, tokens, init_cache(CFG, 2, MAX_LEN), lengths=lengths,
                         last_only=True)
    assert last.shape == (2, 1, CFG.vocab_size)
    np.testing.assert_allclose(last[:, 0], np.asarray(full)[[0, 1], [15, 8]], rtol=0, atol=1e-6)
    assert np.asarray(cache.pos).tolist() == [16, 9]


def test_forward_rejects_unknown_gdn_mode(setup):
    _, params, _, _ = setup
    with pytest.raises(ValueError, match="gdn_mode"):
        jax.eval_shape(lambda p, c: FWD(p, CFG, jnp.zeros((1, 1), jnp.int32), c,
                                        gdn_mode="fast"), params, init_cache(CFG, 1, 8))


def test_quantized_weights_run_like_their_dequantized_dense_copy(setup):
    """QTensor leaves go through stack_params, the block scan and `linear` / the embedding
    lookup; the result equals the dense model built from the dequantized weights."""
    flat, _, _, _ = setup
    # Every 2-D weight but the depthwise conv (not a matmul weight) is quantized.
    q = {n: quantize(w, INT8_ROW) if w.ndim == 2 and not n.endswith("conv1d") else w
         for n, w in flat.items()}
    dense = {n: dequantize_np(w) if isinstance(w, QTensor) else w for n, w in q.items()}
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 16)), jnp.int32)
    lq, _, _ = FWD(stack_params(q, CFG), CFG, tokens, init_cache(CFG, 2, MAX_LEN))
    ld, _, _ = FWD(stack_params(dense, CFG), CFG, tokens, init_cache(CFG, 2, MAX_LEN))
    assert rel_err(lq, ld) <= TOL
