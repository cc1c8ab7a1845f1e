"""Pallas kernels (Triton backend), each beside a pure-JAX reference with the same signature.

The model picks the implementation with `kernels="xla"` (the plain-jnp references, the default)
or `kernels="pallas"`. Every kernel wrapper takes `interpret=None`:
None runs the Pallas interpreter on a non-GPU backend (how the CPU tests check the kernels) and
the compiled Triton kernel on a GPU. Triton, not Mosaic GPU: Triton Pallas calls survive
`jax.export` across JAX versions (REFERENCE section 9).

Modules (kernel; reference):
- `qgemv`: weight-only GEMV for decode, int4_g64 / int8_row / fp8_row / dense; `quant.linear`.
- `paged_decode`: paged attention decode over bf16/f32/int8 KV; the gather in `paged_kv`.
- `paged_prefill`: paged attention for a prefill chunk (T > 1) over bf16/f32/int8 KV, GQA
  heads packed into the tile rows; the gather in `paged_kv`.
- `gdn_decode`: gated delta rule step(s) with the state in and out;
  `gdn.recurrent_gated_delta_rule`.
- `gdn_decode_fused`: a GDN layer's whole decode step after its projections (conv, norms,
  gates, recurrent step, gated norm) in one kernel (NINFER_GDN_FUSED=0 turns it off);
  `layers.gdn_core`.
- `gdn_prefill`: chunked (WY/UT) gated delta rule for prefill, state in and out;
  `gdn.chunk_gated_delta_rule`.
- `gdn_inverse`: the UT transform's diagonal-block inverses in one launch;
  `gdn.diag_block_inverse`.
- `flash_prefill`: causal GQA attention over the contiguous cache; `attention.attend`.
- `norm_sums`: a decode step's RMSNorms (with the residual add) and the GDN output's gated
  norm, each with the group sums the int4 GEMV takes, one kernel a norm
  (NINFER_NORM_FUSED=0 turns them off); `norm_sums.rms_norm_sums_ref`, `gated_norm_sums_ref`.
- `attn_prep`: a gated-attention layer's decode step between its projections and the paged
  kernel (q/k norms, RoPE, the K/V write in place) in one kernel (NINFER_ATTN_PREP: on a GPU by
  default, 0 off, 1 also on a CPU); `attn_prep.prep_ref`.
- `attn_merge`: the attention layer's tail after the paged decode kernel (the splits' merge in
  the row's own order, the output gate, o_proj's group sums) in one kernel, with the prep
  kernel (NINFER_ATTN_MERGE=1; off: no faster in the step, v29); `attn_merge.merge_gate_sums_ref`.
- `stacked`: layer views of stacked weights (and layer norms), so a kernel reads a layer in
  place.
"""
from __future__ import annotations

import os

import jax

KERNEL_CHOICES = ("xla", "pallas")


def check_kernels(kernels: str) -> str:
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    return kernels


def resolve_interpret(interpret: bool | None) -> bool:
    """None -> interpret everywhere but on a GPU backend."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def gpu_default(var: str, choices: tuple[str, ...], gpu: str, other: str) -> str:
    """A kernel switch from the environment variable `var`: unset or "auto" -> `gpu` where
    JAX's backend is the GPU, `other` elsewhere; else one of `choices` (anything else is a
    ValueError). Read while tracing, so a test that flips it clears JAX's caches."""
    setting = os.environ.get(var, "auto")
    if setting == "auto":
        return gpu if jax.default_backend() == "gpu" else other
    if setting not in choices:
        names = ("auto",) + tuple(choices)
        raise ValueError(f"{var} must be {', '.join(names[:-1])} or {names[-1]}, "
                         f"got {setting!r}")
    return setting


def triton_params(num_warps: int, num_stages: int):
    """The Triton compiler parameters under either JAX spelling (0.10 and 0.11 both have
    `pallas.triton.CompilerParams`; older ones called it TritonCompilerParams)."""
    from jax.experimental.pallas import triton as plt

    cls = getattr(plt, "CompilerParams", None) or getattr(plt, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)
