"""Compile time and throughput of the reference forward on random weights.

    .venv/bin/python -m engine.bench --config tiny --prompt 256 --steps 32

Prints jit compile seconds for a prefill step (T = --prompt, last-token logits) and a decode
step (T = 1), then prefill and decode tokens/s. Dev tooling only; not imported by the engine.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import preset
from engine.model import FORWARD_STATIC, forward, init_cache
from engine.params import random_flat_params, stack_params


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gdn-mode", default="chunk", choices=["chunk", "recurrent"])
    args = ap.parse_args(argv)
    cfg = preset(args.config)
    params, t_init = _timed(lambda: stack_params(random_flat_params(cfg), cfg))
    print(f"{cfg.name}: {cfg.param_count() / 1e6:.1f}M params, random init {t_init:.1f}s, "
          f"backend {jax.default_backend()}")
    max_len = args.prompt + args.steps
    cache = init_cache(cfg, args.batch, max_len)
    fwd = jax.jit(forward, static_argnames=FORWARD_STATIC, donate_argnames=("cache",))
    prompt = jnp.asarray(np.random.default_rng(0).integers(
        0, cfg.vocab_size, (args.batch, args.prompt)), jnp.int32)
    step_tok = jnp.zeros((args.batch, 1), jnp.int32)
    kw = dict(gdn_mode=args.gdn_mode)
    prefill, t_cp = _timed(lambda: fwd.lower(params, cfg, prompt, cache, last_only=True,
                                             **kw).compile())
    decode, t_cd = _timed(lambda: fwd.lower(params, cfg, step_tok, cache, **kw).compile())
    print(f"compile: prefill T={args.prompt} {t_cp:.2f}s, decode T=1 {t_cd:.2f}s")
    _timed(lambda: prefill(params, prompt, init_cache(cfg, args.batch, max_len)))  # warm-up
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
