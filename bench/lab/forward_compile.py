"""Compile time and throughput of the reference forward on random weights.

    .venv/bin/python bench/lab/forward_compile.py --config tiny --prompt 256 --steps 32
    python bench/lab/forward_compile.py --config qwen3.8-27b --layers 8 --dtype bfloat16 \
        --device-init  # GPU

Prints jit compile seconds for a prefill step (T = --prompt, last-token logits) and a decode
step (T = 1), then prefill and decode tokens/s. Dev tooling only; not imported by the engine.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.model.config import preset  # noqa: E402
from engine.model.model import FORWARD_STATIC, forward, init_cache  # noqa: E402
from engine.model.params import random_flat_params, stack_params  # noqa: E402
from engine.plan import REFERENCE  # noqa: E402


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def _device_random(cfg, dtype):
    """Random weights drawn on the default device (never materialised on the host): for timing
    real widths on a GPU. Scales as in random_flat_params, decay parameters simplified."""
    key = jax.random.PRNGKey(0)
    flat = {}
    for i, (name, shape) in enumerate(cfg.tensor_specs().items()):
        k = jax.random.fold_in(key, i)
        std = 1.0 if name == "embed_tokens" else shape[-1] ** -0.5 if len(shape) == 2 else 0.1
        flat[name] = (jax.random.normal(k, shape, jnp.float32) * std).astype(dtype)
    return stack_params(flat, cfg)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gdn-mode", default="chunk", choices=["chunk", "recurrent"])
    ap.add_argument("--layers", type=int, help="override num_layers (keeps the widths)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--unroll", action="store_true", help="unroll the block scan")
    ap.add_argument("--device-init", action="store_true", help="draw weights on the device")
    args = ap.parse_args(argv)
    cfg = preset(args.config)
    if args.layers:
        cfg = dataclasses.replace(cfg, name=f"{cfg.name}-{args.layers}l", num_layers=args.layers)
    dtype = jnp.dtype(args.dtype)
    if args.device_init:
        params, t_init = _timed(lambda: _device_random(cfg, dtype))
    else:
        params, t_init = _timed(lambda: jax.tree.map(
            lambda x: jnp.asarray(x, dtype), stack_params(random_flat_params(cfg), cfg)))
    print(f"{cfg.name}: {cfg.param_count() / 1e6:.1f}M params, random init {t_init:.1f}s, "
          f"{args.dtype}, backend {jax.default_backend()}")
    max_len = args.prompt + args.steps
    cache = init_cache(cfg, args.batch, max_len, dtype)
    fwd = jax.jit(forward, static_argnames=FORWARD_STATIC, donate_argnames=("cache",))
    prompt = jnp.asarray(np.random.default_rng(0).integers(
        0, cfg.vocab_size, (args.batch, args.prompt)), jnp.int32)
    step_tok = jnp.zeros((args.batch, 1), jnp.int32)
    kw = dict(gdn_mode=args.gdn_mode,
              plan=dataclasses.replace(REFERENCE, unroll_blocks=args.unroll))
    prefill, t_cp = _timed(lambda: fwd.lower(params, cfg, prompt, cache, last_only=True,
                                             **kw).compile())
    decode, t_cd = _timed(lambda: fwd.lower(params, cfg, step_tok, cache, **kw).compile())
    print(f"compile: prefill T={args.prompt} {t_cp:.2f}s, decode T=1 {t_cd:.2f}s")
    _timed(lambda: prefill(params, prompt, init_cache(cfg, args.batch, max_len, dtype)))  # warm-up
    (logits, _, cache), t_p = _timed(lambda: prefill(params, prompt, cache))
    tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
    t0 = time.perf_counter()
    for _ in range(args.steps):
        logits, _, cache = decode(params, tok, cache)
        tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
    jax.block_until_ready(tok)
    t_d = time.perf_counter() - t0
    n = args.batch
    print(f"prefill: {n * args.prompt / t_p:.0f} tok/s ({t_p:.3f}s for {n}x{args.prompt}); "
          f"decode: {n * args.steps / t_d:.1f} tok/s ({1e3 * t_d / args.steps:.1f} ms/step, "
          f"batch {n})")


if __name__ == "__main__":
    main()
