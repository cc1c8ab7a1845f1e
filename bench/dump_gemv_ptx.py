"""Compile the GEMV kernel variants once each at a 27B shape (run with XLA_FLAGS=--xla_dump_to=DIR
so XLA writes the PTX, Triton kernels included), for reading the instructions per weight.

  XLA_FLAGS=--xla_dump_to=/tmp/dump python3 bench/dump_gemv_ptx.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.bench_27b import _random_qtensor  # noqa: E402
from engine.kernels import qgemv  # noqa: E402

N, K = 17408, 5120
VARIANTS = {
    "int4_fma_m1": ("int4_g64", 1, qgemv.GemvConfig()),
    "int4_fma_m2": ("int4_g64", 2, qgemv.GemvConfig()),
    "int8_dot_m1": ("int8_row", 1, qgemv._BEST[("row8", 1)]),
    "bf16_fma_m1": ("bf16", 1, qgemv._BEST[("dense", 1)]),
}


def main():
    for name, (fmt, rows, cfg) in VARIANTS.items():
        if fmt == "bf16":
            w = jax.random.normal(jax.random.key(0), (N, K), jnp.bfloat16)
        else:
            w = _random_qtensor(jax.random.key(0), (N, K), fmt)
        x = jax.random.normal(jax.random.key(1), (rows, K), jnp.bfloat16)
        f = jax.jit(lambda x, w, cfg=cfg: qgemv.qmatmul(x, w, config=cfg))
        f.__name__ = name
        jax.block_until_ready(f(x, w))
        print("compiled", name, flush=True)


if __name__ == "__main__":
    main()
