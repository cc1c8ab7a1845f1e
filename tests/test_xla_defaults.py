"""A kernel plan's process-wide settings (engine/plan.py `apply_process_settings`): its XLA
flags go into XLA_FLAGS before JAX starts its backend, in a fresh interpreter each (the
variable is read once per process)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.plan import GPU_GRAPH_FLAGS

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import os, sys, jax; from engine.plan import preset, apply_process_settings; "
         "apply_process_settings(preset(sys.argv[1])); jax.numpy.ones(2).block_until_ready(); "
         "print(os.environ.get('XLA_FLAGS', ''))")


def _flags(plan: str, **env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", PROBE, plan], cwd=ROOT, env={**base, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def test_the_h200_plan_adds_its_graph_flags_to_the_callers_flags():
    graphs = " ".join(GPU_GRAPH_FLAGS)
    assert _flags("h200") == graphs
    got = _flags("h200", XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert got == f"--xla_cpu_enable_fast_math=false {graphs}"


def test_the_reference_plan_sets_no_flags():
    assert _flags("reference") == ""
    assert _flags("reference", XLA_FLAGS="--xla_cpu_enable_fast_math=false") == \
        "--xla_cpu_enable_fast_math=false"


def test_callers_command_buffer_choice_wins():
    env = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer= --xla_gpu_graph_min_graph_size=5"}
    assert _flags("h200", **env) == env["XLA_FLAGS"]


def test_flags_after_the_backend_started_are_refused():
    code = ("import jax; jax.numpy.ones(2).block_until_ready(); "
            "from engine.plan import H200, PlanError, apply_process_settings\n"
            "try:\n    apply_process_settings(H200)\nexcept PlanError as e:\n    print('refused', e)")
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=base, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("refused") and "before JAX starts" in out.stdout


@pytest.mark.parametrize("plan", ["reference", "pallas"])
def test_cpu_plans_need_no_flags(plan):
    from engine.plan import preset

    assert preset(plan).xla_flags() == ()
