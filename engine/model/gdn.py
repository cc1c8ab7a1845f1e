"""The model's choice of gated delta rule: the references of engine/ops/gdn.py or, by the
plan, the Pallas kernels with their signature (engine/kernels/gdn_decode.py, gdn_prefill.py).
The GDN mixer around it is `layers.gdn_mixer`."""
from __future__ import annotations

from engine.ops.gdn import GDN_RULES


def select_rule(mode: str, plan, t: int):
    """The gated delta rule for a call of T steps: `mode` ("chunk" or "recurrent") names the
    reference; the plan (engine/plan.py) swaps in the Pallas kernels (same signature and
    result): with gdn_decode "pallas" or "fused", decode-sized steps (T <= 16) the recurrent
    one (engine/kernels/gdn_decode.py); with gdn_prefill "pallas", longer chunked calls the
    chunked prefill one (engine/kernels/gdn_prefill.py): XLA prepares every term that does
    not depend on the carried state and the kernel's lean state pass keeps a layer's state in
    registers for the whole scan (a whole 27B prefill of 8K tokens: 0.981 s with the
    reference chunk rule, 0.772 s so, H200 docs/benchmarks). The kernels are imported
    lazily: a plan that names none loads no Pallas module."""
    if plan.gdn_decode != "xla" and t <= 16:
        from engine.kernels.gdn_decode import gdn_recurrent

        return gdn_recurrent
    if plan.gdn_prefill == "pallas" and mode == "chunk":
        from engine.kernels.gdn_prefill import gdn_chunk_bf16_operands

        return gdn_chunk_bf16_operands
    return GDN_RULES[mode]
