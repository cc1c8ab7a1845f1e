"""Kernel plans (engine/plan.py): the presets, their identity, the only source of what runs.

- No product package reads an environment variable outside the README's operator table, and
  no plan field is read from the environment anywhere (an AST scan, imports inside functions
  included).
- The h200 preset's decode steps and each prefill width, lowered for CUDA on this machine,
  hold exactly the custom calls and kernel names of the golden list taken from the tree before
  plans existed (tests/golden/h200_lowering.json; tests/lowering_inventory.py made it).
- The reference and pallas presets' outputs on the CPU are bit-identical to that tree's
  (tests/golden/cpu_outputs.json holds its runs per CPU kind; tests/plan_outputs.py makes them).
- A checkpoint written under another plan is refused, the fingerprint's `plan` field named.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest

from engine.plan import (CHOICES, H200, PALLAS, PRESETS, REFERENCE, KernelPlan, PlanError,
                         from_dict, machine_problems, preset, with_overrides)

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
PRODUCT = ("engine", "server", "lanes", "release", "sbom")


# ---- the plan itself ---------------------------------------------------------------------

def test_presets_are_frozen_hashable_and_distinct():
    assert set(PRESETS) >= {"reference", "pallas", "h200"}
    assert len({hash(p) for p in PRESETS.values()}) == len(PRESETS)
    assert len({p.digest() for p in PRESETS.values()}) == len(PRESETS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        H200.gemv = "xla"
    assert preset("h200") is H200 and H200.preset_name() == "h200"
    variant = dataclasses.replace(H200, narrow_decode=True)
    assert variant.preset_name() is None and variant.digest() != H200.digest()
    assert from_dict(variant.describe()) == variant  # a report reads back as the same plan


def test_reference_runs_no_kernel_and_h200_needs_the_gpu():
    assert not REFERENCE.uses_pallas and not REFERENCE.uses_cuda and REFERENCE.xla_flags() == ()
    assert PALLAS.uses_pallas and not PALLAS.uses_cuda
    assert H200.uses_cuda and H200.cuda_arch == "90" and H200.xla_flags()
    assert machine_problems(REFERENCE, "cpu") == []
    assert machine_problems(PALLAS, "cpu", serving=False) == []  # the interpreter, for tests
    assert any("Pallas" in p for p in machine_problems(PALLAS, "cpu"))
    assert any("CUDA ops" in p for p in machine_problems(H200, "cpu"))
    assert machine_problems(H200, "gpu") == []


@pytest.mark.parametrize("field", sorted(CHOICES))
def test_every_choice_field_refuses_an_unknown_value_naming_the_allowed_ones(field):
    with pytest.raises(PlanError, match=re.escape(f"plan field {field!r} must be one of "
                                                  f"{list(CHOICES[field])}")):
        dataclasses.replace(REFERENCE, **{field: "nonsense"})


def test_overrides_name_the_unknown_field_and_preset():
    with pytest.raises(PlanError, match=r"lane\.toml: unknown plan field\(s\) \['gemv_form'\]"):
        with_overrides(REFERENCE, {"gemv_form": "cuda"}, where="lane.toml")
    with pytest.raises(PlanError, match=r"unknown kernel plan preset 'b200'; known: "):
        preset("b200")


# ---- the environment is not a source --------------------------------------------------------

def _operator_variables() -> set[str]:
    """The names in the README's operator settings table (`| `NAME` | ...`)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Operator settings", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([A-Z_][A-Z0-9_]*)` \|", section, re.M))


def _env_reads(path: Path):
    """(line, name or None) of every read of the environment in a module: os.environ.get(X),
    os.environ[X], os.getenv(X), X in os.environ, and whole-environment reads (items, keys,
    values, copy, dict(os.environ), iteration) with name None."""
    tree = ast.parse(path.read_text(), str(path))

    def is_environ(n):
        return (isinstance(n, ast.Attribute) and n.attr == "environ"
                and isinstance(n.value, ast.Name) and n.value.id == "os") or (
                isinstance(n, ast.Name) and n.id == "environ")

    def literal(n):
        return n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None

    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os":
                yield node.lineno, literal(node.args[0]) if node.args else None
            elif is_environ(f.value) and f.attr in ("get", "pop", "setdefault"):
                yield node.lineno, literal(node.args[0]) if node.args else None
            elif is_environ(f.value) and f.attr in ("items", "keys", "values", "copy"):
                yield node.lineno, None
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            if isinstance(node.ctx, ast.Load):
                yield node.lineno, literal(node.slice)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            yield node.lineno, literal(node.left)
        elif is_environ(node):
            parent = parents.get(node)
            used = (isinstance(parent, ast.Attribute)  # os.environ.<method>: handled above
                    or (isinstance(parent, ast.Subscript) and parent.value is node)
                    or isinstance(parent, ast.Compare))
            if not used:  # passed whole: dict(os.environ), {**os.environ}, for k in os.environ
                yield node.lineno, None


def test_product_reads_only_the_operator_settings():
    allowed = _operator_variables()
    assert {"NINFER_STATE_DIR", "XLA_FLAGS"} <= allowed  # the table parsed
    bad = []
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else []:
            for line, name in _env_reads(path):
                if name not in allowed:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: "
                               f"{name or 'the whole environment'}")
    assert not bad, "environment reads outside the README's operator table:\n" + "\n".join(bad)


def test_no_plan_field_is_read_from_the_environment_anywhere():
    fields = [f.name.upper() for f in dataclasses.fields(KernelPlan)]
    assert not any(f in name for name in _operator_variables() for f in fields)
    # the old switches' names, in any Python file of the repository (bench and tests too)
    old = re.compile(r"NINFER_(INT4|GDN|PAGED|MLP|NORM|ATTN|OVERLAP|NARROW|XLA_GRAPHS|GEMV|"
                     r"PREFILL_ATTN)\w*")
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}"
            for top in (*PRODUCT, "bench", "tests") if (ROOT / top).is_dir()
            for p in sorted((ROOT / top).rglob("*.py"))
            for m in old.finditer(p.read_text())]
    assert not hits, "\n".join(hits)


def test_the_scan_sees_reads_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    import os as _\n    return os.environ.get('A'), "
                   "os.environ['B'], os.getenv('C'), 'D' in os.environ, dict(os.environ)\n"
                   "os.environ['E'] = '1'\n")
    assert sorted(_env_reads(src), key=str) == sorted(
        [(5, "A"), (5, "B"), (5, "C"), (5, "D"), (5, None)], key=str)


# ---- what a plan runs ----------------------------------------------------------------------

def test_h200_lowering_matches_the_golden_list():
    """The h200 preset as the tree before plans ran it: fields it has changed since at their
    old values (int4_gemm_rows 64 from 2026-12-06 and gemm "cuda" from 2026-12-07: the test
    below pins what they change; short_piece adds a width this list does not hold)."""
    from tests.lowering_inventory import inventory

    want = json.loads((GOLDEN / "h200_lowering.json").read_text())
    got = inventory({"plan": dataclasses.replace(H200, int4_gemm_rows=0, gemm="pallas")})
    assert got == want


def test_h200_short_pieces_take_the_gemv_and_64_wide_ones_the_int4_gemm():
    """A short new turn (at most 2 x the plan's short_piece tokens) runs in 8-wide pieces whose
    projections are the CUDA GEMV's calls and whose GDN step is the recurrent kernel: no
    dequantized weight copy and no matmul over one. The 64-wide piece's projections (the
    plan's int4_gemm_rows 64) are the CUDA int4 GEMM's calls (gemm "cuda"), a layer's
    projections of one input in one call, reading the codes in place; the Pallas GEMM is not
    used."""
    import jax
    import jax.numpy as jnp

    import engine.model.model as M
    from engine.model.config import QWEN38_27B as cfg
    from engine.runtime.scheduler import piece, piece_widths
    from tests import lowering_inventory as inv
    from tests.kernel_checks import cuda_module_text

    assert H200.short_piece == 8 and REFERENCE.short_piece == PALLAS.short_piece == 0
    assert piece(4, 8192, H200.short_piece) == (4, 8) and piece(13, 8192, 8) == (8, 8)
    assert piece(17, 8192, 8) == (17, 64)
    assert piece(4, 8192) == (4, 64) and piece_widths(8192, 8)[-2:] == [64, 8]
    params, cache = inv._abstract_params(cfg), inv._abstract_cache(cfg, inv.BATCH)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    fn = lambda p, t, c, n, r: M.forward_rows(p, cfg, t, c, r, lengths=n, plan=H200)  # noqa
    real = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        texts = {w: cuda_module_text(fn, params, i32(1, w), cache, i32(1), i32(1))
                 for w in (8, 64)}
    finally:
        jax.default_backend = real
    short, wide = (inv.summarize(texts[w]) for w in (8, 64))
    gemv = lambda calls: sum(n for k, n in calls.items() if k.startswith("ninfer_int4_gemv"))  # noqa
    assert gemv(short) >= 8 and gemv(wide) == 1  # every layer's projections / lm_head alone
    assert "__gpu$xla.gpu.triton gdn_recurrent" in short
    assert not any("gdn_chunk" in k for k in short) and "stablehlo.dot_general" not in texts[8]
    assert H200.int4_gemm_rows == 64 and H200.gemm == "cuda"
    gemm = sum(n for k, n in wide.items() if k.split()[0] == "ninfer_int4_gemm")
    assert gemm >= 4 and not any("qgemm" in k for k in wide), wide


def test_reference_and_pallas_outputs_are_bit_identical_to_the_tree_before_plans():
    """Equal to the before-plans tree's run recorded for a machine of this kind; on a kind not
    recorded yet, to that tree's outputs computed here from the clone's history."""
    from tests.plan_outputs import before_plans_outputs, machine, outputs, recorded

    got = outputs({"plan": REFERENCE}, {"plan": PALLAS})
    runs = recorded(GOLDEN / "cpu_outputs.json")
    if any(r["outputs"] == got for r in runs):
        return
    try:
        want = before_plans_outputs()
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"{machine()}: outputs match none of the {len(runs)} recorded runs, and the "
                    f"tree before plans could not be run here ({e}); see tests/plan_outputs.py")
    assert got == want, machine()


def test_a_checkpoint_written_under_another_plan_is_refused_naming_the_plan(tiny_model,
                                                                           tmp_path):
    """Within one engine build: the fingerprints of two engines that differ only by their
    plan, a state saved under one and loaded under the other."""
    from engine.engine import Engine
    from lanes.profile import load_profile
    from server.checkpoints.fingerprint import runtime_fingerprint
    from server.checkpoints.checkpoint_store import CheckpointStore
    from tests.test_checkpoint_store import make_input, prompt_after

    profile = load_profile("cpu")
    kw = dict(context_tokens=256, prefill_chunk=32)
    fp_ref = runtime_fingerprint(tiny_model, profile, Engine(tiny_model, plan=REFERENCE, **kw))
    fp_pal = runtime_fingerprint(tiny_model, profile, Engine(tiny_model, plan=PALLAS, **kw))
    assert fp_ref["plan"] == REFERENCE.to_dict() and fp_pal["plan"] == PALLAS.to_dict()
    store = CheckpointStore(tmp_path / "ck", quota_bytes=1 << 30)
    inp = make_input(300, seed=1)
    assert store.save("alice", "s", inp, fp_ref).status == "saved"
    got = store.load("alice", "s", fp_pal, prompt_after(inp))
    assert (got.state, got.reason, got.differs) == ("incompatible", "fingerprint_mismatch",
                                                    ["plan"])
    assert store.load("alice", "s", fp_ref, prompt_after(inp)).state == "available"


def test_the_block_loop_form_alone_changes_no_bit():
    """block_loop "views" with the references everywhere (the layer views materialized where
    no kernel reads them in place) computes what "slices" computes, bit for bit."""
    import jax.numpy as jnp
    import numpy as np

    import engine.model.model as M
    from engine.model.cache import init_paged_cache
    from engine.model.config import TEST_SMALL as cfg
    from engine.model.params import random_flat_params, stack_params
    from engine.ops import paged_kv as pk

    params = stack_params(random_flat_params(cfg, seed=1), cfg)
    toks = jnp.asarray(np.arange(12)[None] % 500, jnp.int32)
    outs = []
    for plan in (REFERENCE, dataclasses.replace(REFERENCE, block_loop="views")):
        pool = pk.init_kv_pool(cfg, 4, pk.PAGE_SIZE, jnp.float32)
        c = init_paged_cache(cfg, pool, np.arange(4, dtype=np.int32)[None], jnp.float32)
        prefill, _, c = M.forward(params, cfg, toks, c, plan=plan)
        step, _, c = M.forward(params, cfg, toks[:, :1], c, plan=plan)
        outs.append((np.asarray(prefill), np.asarray(step)))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_head_rows_gives_each_live_row_its_own_product_and_an_idle_row_zeros():
    """head_rows (the cpu lane's plan): the last positions' logits a live row at a time. They
    equal the one product over every row within f32 rounding; a row's logits are the same
    bits whatever the other row holds and whether it is live; an idle row (length 0) gets
    zeros; logits at every position (last_only off) are the one product, unchanged."""
    import jax.numpy as jnp
    import numpy as np

    import engine.model.model as M
    from engine.model.config import TEST_SMALL as cfg
    from engine.model.params import random_flat_params, stack_params

    params = stack_params(random_flat_params(cfg, seed=7), cfg)
    rows = dataclasses.replace(REFERENCE, head_rows=True)
    rng = np.random.default_rng(3)
    a, b = (jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 12)), jnp.int32) for _ in range(2))

    def logits(tokens, lengths, plan, last_only=True):
        out, _, _ = M.forward(params, cfg, tokens, M.init_cache(cfg, 2, 32),
                              lengths=jnp.asarray(lengths, jnp.int32), last_only=last_only,
                              plan=plan)
        return np.asarray(out)

    pair = jnp.concatenate([a, b])
    each, batched = logits(pair, [12, 9], rows), logits(pair, [12, 9], REFERENCE)
    assert each.shape == batched.shape == (2, 1, cfg.vocab_size)
    np.testing.assert_allclose(each, batched, rtol=1e-5, atol=1e-5)
    other = logits(jnp.concatenate([a, b[:, ::-1]]), [12, 12], rows)
    idle = logits(pair, [12, 0], rows)
    np.testing.assert_array_equal(each[0], other[0])
    np.testing.assert_array_equal(each[0], idle[0])
    assert not idle[1].any()
    np.testing.assert_array_equal(logits(pair, [12, 9], rows, last_only=False),
                                  logits(pair, [12, 9], REFERENCE, last_only=False))


@pytest.mark.slow
def test_the_h200_plans_cuda_ops_build_with_its_flags(tmp_path, monkeypatch):
    """The CUDA ops' source builds with the plan's nvcc flags for its architecture (nvcc on
    this machine, no GPU needed), into a library named by the digest of what went in."""
    from engine.kernels import cuda_ops

    nvcc = cuda_ops._nvcc()
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    monkeypatch.setenv("NINFER_CUDA_CACHE", str(tmp_path))
    path = cuda_ops.build(cuda_ops.INT4_SOURCE, H200.cuda_arch, nvcc, H200.cuda_flags)
    assert path.is_file() and path.parent == tmp_path and f"-sm{H200.cuda_arch}-" in path.name
    other = dataclasses.replace(H200, cuda_flags=("-O2", "-std=c++17"))
    assert cuda_ops.library_path(cuda_ops.INT4_SOURCE, other.cuda_arch, nvcc,
                                 other.cuda_flags) != path
