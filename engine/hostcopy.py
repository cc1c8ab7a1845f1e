"""A restore's host-to-device copies through pinned host memory (opt-in, not yet measured).

What the H200 showed (bench/startup_micro.py, docs/benchmarks/README.md section v19):
`jax.device_put` of a pageable numpy array moves 6.2-6.4 GB/s, and eight at once no more
(the runtime stages pageable memory through one path), so a 128K session's 8.7 GB of pages
need ~1.4 s of bus whatever the threads; from pinned host memory a copy moves ~51 GB/s, and a
numpy array goes into pinned memory at ~8 GB/s a thread. Pinning new memory is slow (the
weights' copy through fresh pinned memory took 14 s against 9 s direct), but memory the
runtime pinned once and freed is reused (the same copy right after: 1.55 s).

So with NINFER_RESTORE_H2D=pinned a restore's page runs go through pinned host memory, each
on the thread that verified the run's last page, and `warm_pinned` (run once the server
serves, beside `prepare_restore`) makes the runtime pin that memory before any restore needs
it. NINFER_RESTORE_H2D=direct (the default) keeps `jax.device_put`.
"""
from __future__ import annotations

import os
import time

import jax
import numpy as np

H2D_CHOICES = ("direct", "pinned")
WARM_BUFFERS = 8  # warm_pinned: buffers (a run is one a pool array) found already pinned


def mode() -> str:
    """NINFER_RESTORE_H2D, checked."""
    value = os.environ.get("NINFER_RESTORE_H2D", "direct")
    if value not in H2D_CHOICES:
        raise ValueError(f"NINFER_RESTORE_H2D must be one of {H2D_CHOICES}, got {value!r}")
    return value


def _kinds(device):
    from jax.sharding import SingleDeviceSharding

    dev = device or jax.devices()[0]
    return (SingleDeviceSharding(dev, memory_kind="pinned_host"),
            SingleDeviceSharding(dev, memory_kind="device"))


def put(host: np.ndarray, device=None) -> jax.Array:
    """`host` on the device (the default one when None): through pinned host memory when
    NINFER_RESTORE_H2D=pinned, else jax.device_put. Asynchronous: block on the result."""
    if mode() == "direct":
        return jax.device_put(host, device)
    pinned, on_device = _kinds(device)
    return jax.device_put(jax.device_put(host, pinned), on_device)


def warm_pinned(buffer_bytes: int, buffers: int = WARM_BUFFERS, device=None) -> float:
    """Have the runtime pin `buffers` host buffers of `buffer_bytes` each at once, then free
    them, so that later pinned copies of up to that size reuse memory already pinned; returns
    seconds. Nothing to do (0.0) unless NINFER_RESTORE_H2D=pinned."""
    if mode() != "pinned" or buffer_bytes <= 0:
        return 0.0
    t = time.monotonic()
    pinned, _ = _kinds(device)
    zeros = np.zeros(buffer_bytes, np.uint8)
    held = [jax.device_put(zeros, pinned) for _ in range(buffers)]
    jax.block_until_ready(held)
    del held
    return time.monotonic() - t
