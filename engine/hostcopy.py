"""Host-to-device copies of large host arrays (a model's weights, a restored session's pages).

On the H200 a plain `jax.device_put` of a pageable numpy array moves ~6 GB/s, and eight at
once no more (the runtime stages pageable memory through one path), while a copy from pinned
host memory reaches ~51 GB/s and the copy of a numpy array into pinned host memory ~8 GB/s a
thread (bench/startup_micro.py, docs/benchmarks/README.md section v19). So on a GPU `put`
first copies the array into pinned host memory on the calling thread, then moves it: callers
that copy on several threads get the host copies in parallel and the bus nearly to themselves.

NINFER_H2D selects the path: `pinned` (the default on a GPU), `direct` (jax.device_put of the
array as it is; what a CPU backend always does, where there is nothing to pin).
"""
from __future__ import annotations

import os

import jax
import numpy as np

H2D_CHOICES = ("pinned", "direct")


def h2d_mode() -> str:
    mode = os.environ.get("NINFER_H2D", "pinned")
    if mode not in H2D_CHOICES:
        raise ValueError(f"NINFER_H2D must be one of {H2D_CHOICES}, got {mode!r}")
    return mode if jax.default_backend() == "gpu" else "direct"


def put(host: np.ndarray, device=None) -> jax.Array:
    """`host` on `device` (the default device when None), through pinned host memory on a
    GPU unless NINFER_H2D=direct. Asynchronous like jax.device_put: block on the result."""
    if h2d_mode() == "direct":
        return jax.device_put(host, device)
    from jax.sharding import SingleDeviceSharding

    dev = device or jax.devices()[0]
    pinned = jax.device_put(host, SingleDeviceSharding(dev, memory_kind="pinned_host"))
    return jax.device_put(pinned, SingleDeviceSharding(dev, memory_kind="device"))
