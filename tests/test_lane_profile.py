"""Lane profiles: the optional [plan] table (a kernel plan preset and its overrides), its
validation when the profile loads, and the canonical hash."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.plan import CPU, H200, PALLAS, REFERENCE
from lanes.profile import (OPTIONAL_DEFAULTS, PROFILE_DIR, LaneProfile, ProfileError,
                           load_profile)

ROOT = Path(__file__).resolve().parent.parent


def _toml(tmp_path, extra: str = "", drop: str | None = None):
    """The cpu profile without its own plan (and without `drop`), then `extra`."""
    dropped = tuple(f"{k} =" for k in ("plan", drop) if k)
    text = "\n".join(x for x in (PROFILE_DIR / "cpu.toml").read_text().splitlines()
                     if not x.startswith(dropped))
    p = tmp_path / "lane.toml"
    p.write_text(text + "\n" + extra)
    return p


def test_shipped_profile_runs_the_cpu_plan_and_pins_its_hash(tmp_path):
    cpu = load_profile("cpu")
    assert cpu.plan == CPU == dataclasses.replace(REFERENCE, head_rows=True)
    # The reference preset with the field overridden is the same profile: same canonical hash.
    explicit = load_profile(str(_toml(tmp_path, '[plan]\npreset = "reference"\n'
                                                'head_rows = true')))
    assert explicit == cpu and explicit.canonical_hash() == cpu.canonical_hash()
    # Without the table the profile runs the reference plan, and that default stays out of
    # the hash, so plans left existing hashes (and checkpoint fingerprints' profile hash)
    # unchanged: the hash of the cpu lane's fields alone.
    bare = load_profile(str(_toml(tmp_path)))
    assert bare.plan == REFERENCE
    d = {k: v for k, v in bare.to_dict().items()
         if k not in OPTIONAL_DEFAULTS or getattr(bare, k) != OPTIONAL_DEFAULTS[k]}
    assert bare.canonical_hash() == hashlib.sha256(
        json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    # that hash: 31fac853... before kernel plans (the tree at 96a3244, serving embedded:tiny),
    # df7b9596... with the first trained tiny-chat, cc321f8a... once tiny-chat copied from its
    # prompt, this one since tiny-chat acts in OMP's prompt with OMP's read and bash tools (the
    # model's pin and agent_tools are fields)
    assert bare.canonical_hash() == ("83532caefe880400ab40e9bdbeece037"
                                     "0172efb92eb5f69dffc420a3d36a06c4")
    # the shipped lane's, with its plan table (head_rows: its logits a live row at a time)
    assert cpu.canonical_hash() == ("0b493d3b3e7033d1c4c852d0a4e89295"
                                    "4dd053f0a23d3df031ecabd6ff0d85c4")


def test_preset_and_overrides_make_the_plan_and_hash_differently(tmp_path):
    p = load_profile(str(_toml(tmp_path, '[plan]\npreset = "pallas"')))
    assert p.plan == PALLAS
    q = load_profile(str(_toml(tmp_path, '[plan]\npreset = "h200"\nnarrow_decode = true\n'
                                         'cuda_flags = ["-O3", "-std=c++17", "-lineinfo"]')))
    assert q.plan.narrow_decode and q.plan.gemv == "cuda" and q.plan != H200
    assert q.plan.cuda_flags == ("-O3", "-std=c++17", "-lineinfo")
    hashes = {load_profile("cpu").canonical_hash(), p.canonical_hash(), q.canonical_hash()}
    assert len(hashes) == 3
    # overrides alone start from the reference preset
    r = load_profile(str(_toml(tmp_path, '[plan]\nchain_decode = false')))
    assert r.plan.gemv == "xla" and not r.plan.chain_decode


@pytest.mark.parametrize("table,match", [
    ('[plan]\npreset = "h100"', r"\[plan\] preset: unknown kernel plan preset 'h100'; known: "
                                r"\['cpu', 'h200', 'pallas', 'reference'\]"),
    ('[plan]\ngemv = "triton"', r"\[plan\]: plan field 'gemv' must be one of "
                                r"\['xla', 'pallas', 'cuda'\], got 'triton'"),
    ('[plan]\npreset = "pallas"\ngdn_decode = "fast"', r"plan field 'gdn_decode' must be one of"),
    ('[plan]\nwarps = 8', r"\[plan\]: unknown plan field\(s\) \['warps'\]; fields: "),
    ('[plan]\nchain_decode = "yes"', r"plan field 'chain_decode' must be true or false"),
    ('[plan]\nint4_gemm_rows = -1', r"'int4_gemm_rows' must be a non-negative integer"),
    ('[plan]\ngdn_decode = "fused"', r"gdn_decode 'fused' needs block_loop 'views'"),
    ('[plan]\npreset = "pallas"\ngemv = "cuda"', r"needs cuda_arch"),
    ('[plan]\npreset = "h200"\ncuda_arch = "75"', r"'cuda_arch' must be one of"),
    ('plan = "h200"', r"'plan' must be a table"),
    ('kernels = "pallas"', r"'kernels' is replaced by the \[plan\] table"),
])
def test_bad_plan_is_refused_when_the_profile_loads(tmp_path, table, match):
    with pytest.raises(ProfileError, match=match):
        load_profile(str(_toml(tmp_path, table)))


def test_required_fields_still_required_and_unknown_refused(tmp_path):
    with pytest.raises(ProfileError, match=r"missing fields \['prefill_chunk'\]"):
        load_profile(str(_toml(tmp_path, drop="prefill_chunk")))
    with pytest.raises(ProfileError, match=r"unknown fields \['kernel'\]"):
        load_profile(str(_toml(tmp_path, 'kernel = "pallas"')))
    with pytest.raises(ProfileError, match="plan must be a KernelPlan"):
        LaneProfile(**{**load_profile("cpu").__dict__, "plan": "h200"})


@pytest.mark.parametrize("tools", ['["read", "read"]', '["read", 3]', '["read,bash"]', '"read"'])
def test_agent_tools_must_be_distinct_tool_names(tmp_path, tools):
    with pytest.raises(ProfileError, match="agent_tools must be distinct tool names"):
        load_profile(str(_toml(tmp_path, f"agent_tools = {tools}", drop="agent_tools")))
    # left out, the client offers every tool it has
    assert load_profile(str(_toml(tmp_path, drop="agent_tools"))).agent_tools == ()


def _serve(tmp_path, lane: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "NINFER_STATE_DIR": str(tmp_path / "state")}
    return subprocess.run([sys.executable, "-m", "server.cli", "serve", "--lane", str(lane),
                           "--port", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_server_does_not_start_with_a_bad_plan(tmp_path):
    out = _serve(tmp_path, _toml(tmp_path, '[plan]\npreset = "pallas"\nnorms = "fast"'))
    assert out.returncode != 0
    assert "plan field 'norms' must be one of ['xla', 'fused'], got 'fast'" in out.stderr
    assert "listening" not in out.stderr


def test_server_refuses_a_plan_this_machine_cannot_run(tmp_path):
    """The h200 plan on a machine without a GPU backend: refused at start with the reason,
    never served by other kernels (the process exits before the model serves)."""
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("this machine can run the plan")  # the GPU machine: nothing to refuse
    out = _serve(tmp_path, _toml(tmp_path, '[plan]\npreset = "h200"'))
    assert out.returncode != 0
    assert "cannot run here" in out.stderr or "no nvcc" in out.stderr, out.stderr[-2000:]
    assert "ready:" not in out.stderr


def test_engine_refuses_a_plan_that_is_not_a_plan(tiny_model):
    from engine.engine import Engine
    from engine.plan import PlanError

    with pytest.raises(PlanError, match="plan must be a KernelPlan"):
        Engine(tiny_model, context_tokens=256, prefill_chunk=32, plan="pallas")


def _greedy(model, plan, text: str, n: int) -> list[int]:
    from tests.engine_runs import greedy_tokens

    toks, done = greedy_tokens(model, model.tokenizer.encode(text), n, plan=plan)
    assert done.error is None, done
    return toks


def test_engine_pallas_matches_reference_greedy_on_tiny(tiny_model):
    """The engine with the pallas plan (Pallas interpreter on the CPU) produces the same greedy
    tokens as the reference plan for a short prompt (the tiny model's lm_head gives peaked
    logits)."""
    text = "def fibonacci(n):\n    "
    t0 = time.monotonic()
    want = _greedy(tiny_model, REFERENCE, text, 6)
    got = _greedy(tiny_model, PALLAS, text, 6)
    assert got == want, (got, want)
    assert time.monotonic() - t0 < 300
