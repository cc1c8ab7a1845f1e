"""The engine's XLA defaults (engine/__init__.py): set when the engine is imported, before JAX
starts its backend, in a fresh interpreter each (the variable is read once per process)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import os, engine, jax; jax.numpy.ones(2).block_until_ready(); "
         "print(os.environ['XLA_FLAGS'])")


def _flags(**env) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NINFER_XLA_GRAPHS")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**base, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_command_buffer_flags_are_added_to_the_callers_flags():
    from engine import GPU_GRAPH_FLAGS

    assert _flags() == GPU_GRAPH_FLAGS
    got = _flags(XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert got == f"--xla_cpu_enable_fast_math=false {GPU_GRAPH_FLAGS}"


@pytest.mark.parametrize("env", [
    {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false", "NINFER_XLA_GRAPHS": "xla"}])
def test_callers_command_buffer_choice_wins(env):
    assert _flags(**env) == env["XLA_FLAGS"]
