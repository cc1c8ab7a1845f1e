"""Pallas kernels (Triton backend), each beside a pure-JAX reference with the same signature.

The model picks each implementation by its kernel plan (engine/plan.py). A kernel module imports
only the references and formats of engine/ops/, engine/plan.py and other kernels, never the
model (tests/test_import_graph.py). Every kernel wrapper takes `interpret=None`:
None runs the Pallas interpreter on a non-GPU backend (how the CPU tests check the kernels) and
the compiled Triton kernel on a GPU. Triton, not Mosaic GPU: Triton Pallas calls survive
`jax.export` across JAX versions (REFERENCE section 9).

Modules (kernel; reference, in engine/ops/ unless named here):
- `qgemv`: weight-only GEMV for decode, int4_g64 / int8_row / fp8_row / dense;
  `quant.linear_ref`.
- `paged_decode`: paged attention decode over bf16/f32/int8 KV; the gather in `paged_kv`.
- `paged_prefill`: paged attention for a prefill chunk (T > 1) over bf16/f32/int8 KV, GQA
  heads packed into the tile rows; the gather in `paged_kv`.
- `gdn_decode`: gated delta rule step(s) with the state in and out;
  `gdn.recurrent_gated_delta_rule`.
- `gdn_decode_fused`: a GDN layer's whole decode step after its projections (conv, norms,
  gates, recurrent step, gated norm) in one kernel (a plan's gdn_decode "fused");
  `gdn.gdn_core`.
- `gdn_prefill`: chunked (WY/UT) gated delta rule for prefill, state in and out;
  `gdn.chunk_gated_delta_rule`.
- `gdn_inverse`: the UT transform's diagonal-block inverses in one launch;
  `gdn.diag_block_inverse`.
- `flash_prefill`: causal GQA attention over the contiguous cache; `attention.attend`.
- `norm_sums`: a decode step's RMSNorms (with the residual add) and the GDN output's gated
  norm, each with the group sums the int4 GEMV takes, one kernel a norm (a plan's norms
  "fused"); `norm_sums.rms_norm_sums_ref`, `gated_norm_sums_ref`.
- `attn_prep`: a gated-attention layer's decode step between its projections and the paged
  kernel (q/k norms, RoPE, the K/V write in place) in one kernel (a plan's attn_prep);
  `attn_prep.prep_ref`.
- `attn_merge`: the attention layer's tail after the paged decode kernel (the splits' merge in
  the row's own order, the output gate, o_proj's group sums) in one kernel, with the prep
  kernel (a plan's attn_merge; no preset: no faster in the step); `attn_merge.merge_gate_sums_ref`.
- `stacked`: layer views of stacked weights (and layer norms), so a kernel reads a layer in
  place.
"""
from __future__ import annotations

import jax

def resolve_interpret(interpret: bool | None) -> bool:
    """None -> interpret everywhere but on a GPU backend."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def triton_params(num_warps: int, num_stages: int):
    """The Triton compiler parameters under either JAX spelling (0.10 and 0.11 both have
    `pallas.triton.CompilerParams`; older ones called it TritonCompilerParams)."""
    from jax.experimental.pallas import triton as plt

    cls = getattr(plt, "CompilerParams", None) or getattr(plt, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)
