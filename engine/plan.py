"""Kernel plans: what exactly runs in the forward, as data.

A `KernelPlan` has one field for each choice the engine makes between implementations of the
same math (the reference in plain JAX, a Pallas kernel, a CUDA op through the XLA FFI) and for
the process-wide settings those need (XLA's flags, the CUDA op's build). It is frozen and
hashable: the forward takes it as a static argument, so two plans are two traces, and its
`digest()` names it in the executable store's key, the checkpoint fingerprint and
`GET /v1/ninfer/status`. Shapes a chosen kernel cannot tile still take the reference (a
property of the shapes, the same on every machine); a machine that cannot run what a plan
names refuses it (`machine_problems`), it never runs something else.

Named presets (`PRESETS`), variants by `dataclasses.replace` or `with_overrides` (what a lane
profile's `[plan]` table gives):
- `reference`: the plain-JAX references everywhere (the tests' oracle path).
- `cpu`: the CPU lane's: `reference` with the logits a live row at a time (`head_rows`).
- `pallas`: the portable Pallas kernels (Triton on a GPU, the Pallas interpreter on a CPU, as
  the kernel tests run them), no CUDA op: GEMV, paged attention decode and prefill, flash
  prefill, the fused GDN decode kernel with the state stacks updated in place, the chunked GDN
  prefill kernel.
- `h200`: the plan behind the README's H200 figures (docs/benchmarks): `pallas` plus the CUDA
  int4 GEMV and MLP ops (sm_90), the fused decode norms, the attention prep kernel, the GDN
  conv state written into a second stack, and XLA's CUDA graphs for the decode step; short
  new turns in 8-wide pieces, and 64-wide pieces through the CUDA int4 GEMM (since
  2026-12-07: a 64-wide piece at 32K 35.5 -> 29.3 ms of device time on an H100).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

# The XLA flags of `xla_gpu_graphs`: XLA's command buffers (CUDA graphs) take the custom calls
# (the CUDA ops, the Pallas kernels) too, and graphs of any length are made (on the H200 the
# 27B C1 1K decode step took 9.48 ms with XLA's defaults, 9.09 ms with these, 9.13 ms with no
# graphs).
GPU_GRAPH_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
                   "--xla_gpu_graph_min_graph_size=1")
CUDA_ARCHS = ("80", "86", "89", "90", "100", "120")
# The CUDA GEMM's 64-row build takes 3 stages of 34 KB of shared memory a block; these
# architectures allow 99 KB.
GEMM_SMEM_KB = 102
GEMM_SMALL_SMEM_ARCHS = ("86", "89", "120")


class PlanError(ValueError):
    """A plan (or a profile's plan table) that names an unknown preset, field or value, or
    choices that do not fit together."""


@dataclass(frozen=True)
class KernelPlan:
    # Weight matmuls of decode-sized x (at most `qgemv.MAX_ROWS` rows): "xla" dequantizes and
    # multiplies; "pallas" the weight-only GEMV kernel (engine/kernels/qgemv.py); "cuda" the
    # same, with int4_g64 weights through the CUDA op (engine/kernels/cuda_ops.py), a layer's
    # projections of one input in one launch.
    gemv: str = "xla"
    # Prefill pieces of up to this many rows against int4_g64 weights through the int4 GEMM
    # (engine/kernels/qgemm.py) in place of a dequantized copy; 0: none (wider pieces are
    # compute-bound, where cuBLAS over the copy is faster).
    int4_gemm_rows: int = 0
    # Those pieces' kernel: "pallas" (engine/kernels/qgemm.py) or "cuda" (the CUDA op's int4
    # GEMM, engine/kernels/cuda_ops.py `int4_gemm_multi`, for bf16 x of up to 64 rows, a
    # layer's projections of one input in one launch; wider pieces take the Pallas kernel).
    gemm: str = "pallas"
    # Prefill pieces this wide for a short remainder (a short new turn, or the end of a longer
    # one: up to scheduler.SHORT_PIECES of them) instead of one padded to the 64-token floor,
    # so that their matmuls take the decode GEMV (`gemv`, at most qgemv.MAX_ROWS rows) and
    # their GDN step the recurrent kernel; 0: every piece at least 64 wide. One more width.
    short_piece: int = 0
    # A decode step's MLP: "separate" (its GEMVs as `gemv` says, SwiGLU and the residual in
    # XLA) or "cuda" (the CUDA op: gate|up then down, chained by programmatic dependent launch).
    mlp: str = "separate"
    # A decode step's RMSNorms with the residual add and the group sums the int4 GEMV takes:
    # "xla" or "fused" (engine/kernels/norm_sums.py, one kernel a norm).
    norms: str = "xla"
    # The block scans: "slices" (each block's weights sliced out of the stacks) or "views"
    # (the stacks carried whole and read in place by the kernels at a layer index,
    # engine/kernels/stacked.py).
    block_loop: str = "slices"
    # Unroll the block scans (the same math with static weight slices; compile time grows with
    # depth, so no preset does).
    unroll_blocks: bool = False
    # A GDN layer's decode step after its projections: "xla" (the reference), "pallas" (the
    # recurrent kernel, engine/kernels/gdn_decode.py, the other steps in XLA) or "fused" (the
    # whole step in one kernel, engine/kernels/gdn_decode_fused.py, the state stacks updated in
    # place; needs block_loop "views").
    gdn_decode: str = "xla"
    # With gdn_decode "fused": "copy" (each layer's new conv window copied into the stack) or
    # "swap" (written in place into a second stack, which becomes the cache's).
    gdn_conv_write: str = "copy"
    # A GDN prefill chunk: "xla" (the chunked reference) or "pallas" (XLA prepares the
    # state-independent terms, engine/kernels/gdn_prefill.py's lean scan carries the state).
    gdn_prefill: str = "xla"
    # Attention of a prefill chunk: "xla" (gather and attend) or "flash" (the paged prefill
    # kernel over the pool; the flash kernel over a contiguous cache).
    prefill_attention: str = "xla"
    # Attention of a decode step: "xla" or "paged" (engine/kernels/paged_decode.py).
    decode_attention: str = "xla"
    # How the paged decode kernel's splits are merged: "reduce" (XLA reductions) or "chain"
    # (elementwise sums in split order: the same additions at any batch size).
    paged_merge: str = "reduce"
    # A decode step's q/k norms, RoPE and K/V write in one kernel (engine/kernels/attn_prep.py);
    # needs decode_attention "paged".
    attn_prep: bool = False
    # With attn_prep: the splits' merge, the output gate and o_proj's group sums in one kernel
    # (engine/kernels/attn_merge.py).
    attn_merge: bool = False
    # The engine's loop: decode steps chained on the device (the next dispatched before the
    # host reads the last one's tokens).
    chain_decode: bool = True
    # In an engine of several rows, a decode step of fewer live rows runs over those alone.
    narrow_decode: bool = False
    # The logits at a step's last positions as one matrix-vector product a live row (a row of
    # length 0 is skipped and gets zeros) instead of one product over every row. XLA:CPU
    # multiplies one row by tiny-chat's 248,320 x 256 f32 lm_head in 9 ms and two in 15-17
    # (another kernel), so a lone session in an engine of two rows pays for the idle one; each
    # row's logits stay those of a one-row product whichever rows are live.
    head_rows: bool = False
    # XLA's CUDA graphs for the decode step (GPU_GRAPH_FLAGS), set before JAX starts.
    xla_gpu_graphs: bool = False
    # The CUDA ops' build (gemv "cuda" or mlp "cuda"): the GPU architecture the library is
    # compiled for (the machine's must match) and nvcc's optimization flags.
    cuda_arch: str | None = None
    cuda_flags: tuple[str, ...] = ("-O3", "-std=c++17")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in CHOICES and v not in CHOICES[f.name]:
                raise PlanError(f"plan field {f.name!r} must be one of "
                                f"{list(CHOICES[f.name])}, got {v!r}")
        if isinstance(self.short_piece, bool):
            raise PlanError(f"plan field 'short_piece' must be one of "
                            f"{list(CHOICES['short_piece'])}, got {self.short_piece!r}")
        for name in ("unroll_blocks", "attn_prep", "attn_merge", "chain_decode",
                     "narrow_decode", "head_rows", "xla_gpu_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"plan field {name!r} must be true or false, "
                                f"got {getattr(self, name)!r}")
        if not (isinstance(self.int4_gemm_rows, int) and not isinstance(self.int4_gemm_rows,
                                                                         bool)
                and self.int4_gemm_rows >= 0):
            raise PlanError("plan field 'int4_gemm_rows' must be a non-negative integer, "
                            f"got {self.int4_gemm_rows!r}")
        if not (isinstance(self.cuda_flags, tuple)
                and all(isinstance(a, str) and a.startswith("-") for a in self.cuda_flags)):
            raise PlanError(f"plan field 'cuda_flags' must be a list of nvcc flags, "
                            f"got {self.cuda_flags!r}")
        if self.cuda_arch is not None and self.cuda_arch not in CUDA_ARCHS:
            raise PlanError(f"plan field 'cuda_arch' must be one of {list(CUDA_ARCHS)}, "
                            f"got {self.cuda_arch!r}")
        needs = [
            (self.gdn_decode == "fused" and self.block_loop != "views",
             "gdn_decode 'fused' needs block_loop 'views'"),
            (self.norms == "fused" and self.block_loop != "views",
             "norms 'fused' needs block_loop 'views'"),
            (self.gdn_conv_write == "swap" and self.gdn_decode != "fused",
             "gdn_conv_write 'swap' needs gdn_decode 'fused'"),
            (self.attn_prep and self.decode_attention != "paged",
             "attn_prep needs decode_attention 'paged'"),
            (self.attn_merge and not self.attn_prep, "attn_merge needs attn_prep"),
            (self.mlp == "cuda" and self.block_loop != "views",
             "mlp 'cuda' needs block_loop 'views'"),
            (self.uses_cuda and self.cuda_arch is None,
             "gemv, mlp or gemm 'cuda' needs cuda_arch (the GPU architecture it is built for)"),
            (self.int4_gemm_rows and self.gemv == "xla", "int4_gemm_rows needs gemv 'pallas' "
             "or 'cuda'"),
            (self.gemm == "cuda" and not self.int4_gemm_rows,
             "gemm 'cuda' needs int4_gemm_rows (the pieces it takes)"),
            (self.gemm == "cuda" and self.cuda_arch in GEMM_SMALL_SMEM_ARCHS,
             f"gemm 'cuda' needs {GEMM_SMEM_KB} KB of shared memory a block, more than "
             f"sm_{self.cuda_arch} has (cuda_arch 80, 90 or 100)"),
        ]
        for bad, why in needs:
            if bad:
                raise PlanError(f"plan: {why}")

    # ---- what it needs -----------------------------------------------------------------
    @property
    def uses_cuda(self) -> bool:
        """Whether the forward calls the CUDA ops (built with nvcc for `cuda_arch`)."""
        return self.gemv == "cuda" or self.mlp == "cuda" or self.gemm == "cuda"

    @property
    def uses_pallas(self) -> bool:
        """Whether the forward runs any Pallas kernel (Triton: compiled on a GPU only)."""
        return (self.gemv != "xla" or self.norms != "xla" or self.gdn_decode != "xla"
                or self.gdn_prefill != "xla" or self.prefill_attention != "xla"
                or self.decode_attention != "xla")

    def xla_flags(self) -> tuple[str, ...]:
        """The XLA flags this plan sets for the process, before JAX starts its backend."""
        return GPU_GRAPH_FLAGS if self.xla_gpu_graphs else ()

    # ---- identity ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The plan as its identity (digest, checkpoint fingerprints, executable keys, lane
        hashes): every field, but a field of LATE_DEFAULTS only where it is set, so a plan
        that leaves a newer field at its default keeps the identity it had before the field
        existed."""
        d = dataclasses.asdict(self)
        d["cuda_flags"] = list(self.cuda_flags)
        for name, default in LATE_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        return d

    def digest(self) -> str:
        """sha256 of the plan as canonical JSON: every field, named."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def preset_name(self) -> str | None:
        """The preset this plan equals, or None for a variant."""
        return next((n for n, p in PRESETS.items() if p == self), None)

    def describe(self) -> dict:
        """The effective plan as a report shows it: preset (or null), digest, fields (those of
        LATE_DEFAULTS where set, as `to_dict` has them: a report of an existing plan, and what
        is keyed by it, such as the qualification corpus, stays as it was)."""
        return {"preset": self.preset_name(), "digest": self.digest(), **self.to_dict()}


# Fields added since plans were first fingerprinted (v0.16.0), with their defaults: in a plan's
# identity only where set (`KernelPlan.to_dict`).
LATE_DEFAULTS: dict[str, object] = {"gemm": "pallas"}

CHOICES: dict[str, tuple] = {
    "gemv": ("xla", "pallas", "cuda"),
    "gemm": ("pallas", "cuda"),
    "mlp": ("separate", "cuda"),
    "norms": ("xla", "fused"),
    "block_loop": ("slices", "views"),
    "gdn_decode": ("xla", "pallas", "fused"),
    "gdn_conv_write": ("copy", "swap"),
    "gdn_prefill": ("xla", "pallas"),
    "prefill_attention": ("xla", "flash"),
    "decode_attention": ("xla", "paged"),
    "paged_merge": ("reduce", "chain"),
    "short_piece": (0, 2, 4, 8),
}

REFERENCE = KernelPlan()
CPU = KernelPlan(head_rows=True)
PALLAS = KernelPlan(gemv="pallas", block_loop="views", gdn_decode="fused", gdn_prefill="pallas",
                    prefill_attention="flash", decode_attention="paged")
H200 = dataclasses.replace(PALLAS, gemv="cuda", mlp="cuda", norms="fused", attn_prep=True,
                           gdn_conv_write="swap", xla_gpu_graphs=True, cuda_arch="90",
                           short_piece=8, int4_gemm_rows=64, gemm="cuda")
PRESETS: dict[str, KernelPlan] = {"reference": REFERENCE, "cpu": CPU, "pallas": PALLAS,
                                  "h200": H200}


def preset(name: str) -> KernelPlan:
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise PlanError(f"unknown kernel plan preset {name!r}; known: {sorted(PRESETS)}") \
            from None


def with_overrides(base: KernelPlan, overrides: dict, where: str = "plan") -> KernelPlan:
    """`base` with the fields `overrides` names replaced (a profile's `[plan]` table; `where`
    names it in errors). An unknown field or a bad value is a PlanError naming the key."""
    fields = {f.name for f in dataclasses.fields(KernelPlan)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise PlanError(f"{where}: unknown plan field(s) {unknown}; fields: {sorted(fields)}")
    vals = dict(overrides)
    if isinstance(vals.get("cuda_flags"), list):
        vals["cuda_flags"] = tuple(vals["cuda_flags"])
    try:
        return dataclasses.replace(base, **vals)
    except PlanError as e:
        raise PlanError(f"{where}: {e}") from None


def from_dict(d: dict) -> KernelPlan:
    """The plan `to_dict` wrote (a fingerprint's or a report's; extra report keys ignored)."""
    fields = {f.name for f in dataclasses.fields(KernelPlan)}
    return with_overrides(REFERENCE, {k: v for k, v in d.items() if k in fields})


def check_plan(plan) -> KernelPlan:
    if not isinstance(plan, KernelPlan):
        raise PlanError(f"plan must be a KernelPlan, got {type(plan).__name__}")
    return plan


def machine_problems(plan: KernelPlan, platform: str, serving: bool = True) -> list[str]:
    """Why this machine cannot run `plan` (an empty list: it can). platform: JAX's backend
    ("gpu", "cpu"). serving: a server's engine (the Pallas interpreter is for tests, not for
    serving). The CUDA ops' build is checked by `engine.kernels.cuda_ops.require`."""
    out = []
    if plan.uses_cuda and platform != "gpu":
        out.append(f"the plan runs the CUDA ops (gemv={plan.gemv!r}, mlp={plan.mlp!r}, "
                   f"gemm={plan.gemm!r}), and JAX's backend here is {platform!r}, not a GPU")
    if serving and plan.uses_pallas and platform != "gpu":
        out.append(f"the plan runs Pallas (Triton) kernels, which compile only for a GPU; JAX's "
                   f"backend here is {platform!r} (use the 'reference' plan)")
    return out


def process_xla_flags() -> str:
    """XLA's flags for this process (XLA_FLAGS: the operator's, with the plan's that
    `apply_process_settings` added): the one place the engine reads them."""
    import os

    return os.environ.get("XLA_FLAGS", "")


def apply_process_settings(plan: KernelPlan) -> None:
    """Put the plan's XLA flags into XLA_FLAGS for this process; JAX reads them when it starts
    its backend, so this runs before that (the server does it right after loading the lane's
    profile). Flags the operator already gave for the same option win. A backend already
    started without them is a PlanError: the plan would not be what runs."""
    import os

    given = process_xla_flags()
    missing = [f for f in plan.xla_flags() if f.split("=")[0] not in given]
    if not missing:
        return
    try:
        from jax._src import xla_bridge
        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a JAX without the probe: trust the caller
        started = False
    if started:
        raise PlanError(f"the plan's XLA flags {missing} must be set before JAX starts its "
                        "backend")
    os.environ["XLA_FLAGS"] = " ".join([given, *missing]).strip()
