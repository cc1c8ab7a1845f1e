"""The kernel plan a benchmark runs (engine/plan.py), from its command line.

`--plan NAME` names a preset of `engine.plan.PRESETS` ("reference", "pallas", "h200"); `--set
field=value,...` overrides fields of it; a script that compares settings in one process takes
variants as plan overrides, `NAME:field=value,...` (engine_27b.py, bench_27b.py's --variants).
Values are read by the field's type: true/false for the switches, integers for
`int4_gemm_rows`, strings for the choices (`cuda_arch` "90"; "none" for no arch), and nvcc
flags separated by ";" for `cuda_flags`.

Before JAX starts its backend a script calls `prepare(plans)`: the plans' XLA flags into
XLA_FLAGS (`engine.plan.apply_process_settings`; they are process-wide, so every plan of one
process must agree on them), then the CUDA ops built and registered for the plans that call
them (`engine.kernels.cuda_ops.require`; a forward called directly, outside an Engine, needs
that done first).
"""
from __future__ import annotations

import dataclasses

from engine.plan import PRESETS, KernelPlan, PlanError, preset, with_overrides

_TYPES = {f.name: str(f.type) for f in dataclasses.fields(KernelPlan)}


def add_plan_args(ap, default: str, what: str = "the forward runs") -> None:
    """--plan NAME (default `default`) and --set field=value,... on argparse parser `ap`;
    `what` ends the help's "the kernel plan ..." sentence."""
    ap.add_argument("--plan", default=default, choices=sorted(PRESETS),
                    help=f"the kernel plan {what}: a preset of engine.plan.PRESETS "
                         f"(default {default}; reference: plain JAX everywhere, pallas: the "
                         "Pallas kernels, h200: pallas with the CUDA ops, fused norms, the "
                         "attention prep kernel and XLA's CUDA graphs)")
    ap.add_argument("--set", default="", metavar="FIELD=VALUE,...",
                    help="plan fields over --plan's preset, e.g. 'paged_merge=chain,"
                         "narrow_decode=true' (engine/plan.py names the fields)")


def parse_value(field: str, text):
    """A plan field's value from text, by the field's type (see the module docstring)."""
    if not isinstance(text, str):
        return text  # JSON gave it typed
    kind = _TYPES.get(field, "")
    low = text.strip().lower()
    if kind == "bool":
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise PlanError(f"plan field {field!r} must be true or false, got {text!r}")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise PlanError(f"plan field {field!r} must be an integer, got {text!r}") from None
    if kind.startswith("tuple"):
        return tuple(a for a in text.split(";") if a)
    if "None" in kind and low in ("none", "null", ""):
        return None
    if kind.startswith("str"):
        return text
    # an unknown field: with_overrides names it; guess a type for its message
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text


def parse_overrides(text: str, where: str = "--set") -> dict:
    """'a=1,b=true' -> {"a": 1, "b": True} (typed by the fields); "" -> {}."""
    out = {}
    for kv in filter(None, (s.strip() for s in text.split(","))):
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise SystemExit(f"{where}: {kv!r} is not field=value")
        try:
            out[k] = parse_value(k, v)
        except PlanError as e:
            raise SystemExit(f"{where}: {e}") from None
    return out


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """'base merge:attn_merge=true' -> [("base", {}), ("merge", {"attn_merge": True})]; "" ->
    one unnamed variant with no overrides."""
    out = []
    for item in text.split():
        name, _, sets = item.partition(":")
        if not name or name in [n for n, _ in out]:
            raise SystemExit(f"--variants: {item!r} needs a name of its own")
        out.append((name, parse_overrides(sets, f"--variants {name}")))
    return out or [("", {})]


def make_plan(name: str, overrides: dict | None = None, where: str = "--plan") -> KernelPlan:
    """The preset `name` with `overrides` (a usage error, not a traceback, when they do not
    fit together)."""
    try:
        return with_overrides(preset(name), overrides or {}, where=where)
    except PlanError as e:  # with_overrides's message names `where`
        raise SystemExit(str(e)) from None


def plan_from_args(args) -> KernelPlan:
    """The plan of --plan and --set."""
    sets = getattr(args, "set", "") or ""
    return make_plan(args.plan, parse_overrides(sets),
                     where=f"--plan {args.plan}" + (f" --set {sets!r}" if sets else ""))


def cuda_ops_status(plan: KernelPlan) -> tuple[bool, str]:
    """(whether the CUDA ops run here, why not): built and registered for `plan` (its
    cuda_arch and cuda_flags) by `cuda_ops.require`, for the micro-benchmarks that call the
    ops directly. A plan without them: (False, the reason)."""
    if not plan.uses_cuda:
        return False, (f"the plan ({plan.preset_name() or 'a variant'}) calls no CUDA op "
                       "(gemv and mlp not 'cuda')")
    from engine.kernels import cuda_ops

    try:
        cuda_ops.require(plan)
    except cuda_ops.CudaUnavailable as e:
        return False, str(e)
    return True, ""


def prepare(*plans: KernelPlan) -> None:
    """Before JAX starts its backend: the plans' XLA flags for this process (they must agree:
    the flags are process-wide), then the CUDA ops built and registered for those plans that
    call them (raises SystemExit with the reason where this machine cannot)."""
    plans = [p for p in plans if p is not None]
    if not plans:
        return
    flags = {p.xla_flags() for p in plans}
    if len(flags) > 1:
        raise SystemExit("the plans differ in xla_gpu_graphs, whose XLA flags are set once a "
                         "process: compare them in separate processes")
    from engine.plan import apply_process_settings

    try:
        apply_process_settings(plans[0])
    except PlanError as e:
        raise SystemExit(str(e)) from None
    builds = {(p.cuda_arch, p.cuda_flags) for p in plans if p.uses_cuda}
    if len(builds) > 1:
        raise SystemExit("the plans name different CUDA op builds (cuda_arch, cuda_flags), "
                         "which one process cannot register both of: compare them in "
                         "separate processes")
    for p in plans:
        if p.uses_cuda:
            from engine.kernels import cuda_ops

            try:
                cuda_ops.require(p)
            except cuda_ops.CudaUnavailable as e:
                raise SystemExit(f"the plan's CUDA ops cannot run here: {e}") from None
            break


def label(plan: KernelPlan) -> str:
    """A short name for a log line: the preset's, else "plan-<digest prefix>"."""
    return plan.preset_name() or f"plan-{plan.digest()[:8]}"
