"""The memory planner: what a lane profile needs on its card and on its host, part by part,
and whether that fits, before anything is allocated.

Exact parts are computed from the model's shapes with the engine's own formulas (the same
functions the engine allocates with): the weights in the lane's format, the paged KV pool,
the live rows' recurrent state and the device state slots; the host's state tier, staging and
RAM floor are the profile's own budgets. Estimated parts (marked `~`) are the prefill chunk's
activations and the compiled code's headroom, which XLA decides.

    plan = plan_lane(profile)          # a MemoryPlan
    plan.fits, plan.problems, plan.table()

`kv_capacity_tokens = "auto"` resolves from the lane's declared card memory (never from what is
free at start), so it is the same on every start and the checkpoint fingerprint can depend on it:
every page the card holds after the other parts, rounded down to whole pages.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.model.config import ModelConfig
from engine.ops import paged_kv as pk
from engine.runtime.pages import pages_for
from engine.runtime.states import state_image_bytes

MiB = 1 << 20
# the weight formats a lane may name: what `./ninfer convert --recipe` writes
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "fp8", "int4")
_ITEMSIZE = {"float32": 4, "bfloat16": 2}


class PlanRefused(ValueError):
    """A lane whose parts do not fit its card or host; the message holds the table."""


@dataclass(frozen=True)
class Part:
    name: str
    where: str  # "device" or "host"
    bytes: int
    formula: str
    exact: bool = True


@dataclass
class MemoryPlan:
    lane: str
    card: str
    parts: list[Part]
    device_budget: int | None  # bytes the card gives the engine (None: the host is the device)
    host_budget: int | None    # the host RAM the lane may count on (None: not checked)
    kv_capacity_tokens: int
    kv_auto: bool
    problems: list[str] = field(default_factory=list)

    def total(self, where: str) -> int:
        return sum(p.bytes for p in self.parts if p.where == where)

    @property
    def fits(self) -> bool:
        return not self.problems

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def to_dict(self) -> dict:
        return {"lane": self.lane, "card": self.card, "fits": self.fits,
                "kv_capacity_tokens": self.kv_capacity_tokens, "kv_auto": self.kv_auto,
                "device_budget": self.device_budget, "host_budget": self.host_budget,
                "device_total": self.total("device"), "host_total": self.total("host"),
                "parts": [p.__dict__ for p in self.parts], "problems": list(self.problems)}

    def table(self) -> str:
        w = max(len(p.name) for p in self.parts) + 2
        lines = [f"lane {self.lane} on {self.card}: KV capacity {self.kv_capacity_tokens:,} "
                 f"tokens{' (auto)' if self.kv_auto else ''}",
                 f"{'part':<{w}} {'where':<6} {'bytes':>16} {'MiB':>11}  formula"]
        for where in ("device", "host"):
            for p in (p for p in self.parts if p.where == where):
                mark = " " if p.exact else "~"
                lines.append(f"{p.name:<{w}} {where:<6} {p.bytes:>16,} {p.bytes / MiB:>10.1f}"
                             f"{mark}  {p.formula}")
            budget = self.device_budget if where == "device" else self.host_budget
            total = self.total(where)
            tail = "" if budget is None else (f" of {budget:,} ({budget / MiB:.1f} MiB): "
                                              f"{'fits' if total <= budget else 'DOES NOT FIT'}")
            lines.append(f"{'total':<{w}} {where:<6} {total:>16,} {total / MiB:>10.1f}{tail}")
        lines.append("~ estimated (XLA decides); every other figure is what the engine allocates")
        lines += [f"refused: {m}" for m in self.problems]
        return "\n".join(lines)


def weight_bytes(cfg: ModelConfig, fmt: str, *, mtp: bool = True) -> int:
    """Bytes of every stored tensor under weight format `fmt` (a converter recipe), as the
    converter stores them (engine/io/convert.py)."""
    from engine.io.convert import ConvertError, stored_bytes

    try:
        return stored_bytes(cfg, fmt, mtp=mtp)
    except ConvertError as e:
        raise ValueError(str(e)) from None


def kv_pool_pages(capacity_tokens: int, context_tokens: int, batch: int,
                  page_size: int = pk.PAGE_SIZE) -> int:
    """Pages the engine's pool holds: the capacity, and never less than every row's context
    (engine/runtime/memory.py)."""
    return max(pages_for(capacity_tokens, page_size), batch * pages_for(context_tokens, page_size))


def activation_bytes(cfg: ModelConfig, chunk: int, itemsize: int) -> int:
    """An estimate of one prefill chunk's live activations at the widest layer: the residual
    stream and its norm, the MLP's gate, up and product, the GDN projections (q, k, v, z, and
    the chunked scan's per-chunk states), the last position's logits in fp32, and XLA's copy
    of the largest of them."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    mlp = chunk * (2 * h + 3 * i) * itemsize
    gdn = chunk * (2 * h + cfg.conv_dim + 2 * cfg.value_dim) * itemsize + \
        (chunk // 64 + 1) * cfg.linear_num_value_heads * cfg.linear_key_head_dim * \
        cfg.linear_value_head_dim * 4
    logits = cfg.vocab_size * 4
    return max(mlp, gdn) * 2 + logits


def plan_lane(profile, cfg: ModelConfig | None = None, *, context_tokens: int | None = None,
              host_ram: int | None = None) -> MemoryPlan:
    """The memory plan of `profile` (lanes.profile.LaneProfile), at its own context or at
    `context_tokens`. `host_ram`: the RAM this host has (bytes; None: not checked)."""
    from engine.runtime.speculative import uses_mtp
    from lanes.profile import model_config

    cfg = cfg or model_config(profile)
    ctx = context_tokens or profile.context_tokens
    itemsize = _ITEMSIZE[profile.compute_dtype]
    # MTP drafting keeps the MTP layer's KV in the pool too (engine/runtime/memory.py)
    mtp = uses_mtp(profile.table("speculative").get("method"))
    kv_tok = pk.kv_bytes_per_token(cfg, profile.kv_dtype, mtp=mtp)
    image = state_image_bytes(cfg, itemsize)
    B = profile.max_concurrency
    card = profile.table("card")
    gpu = profile.gpu
    problems: list[str] = []
    where = "device"
    fixed = [
        Part("weights", where, weight_bytes(cfg, profile.weights),
             f"{cfg.name} in {profile.weights} (embedding bf16, vectors fp32)"),
        Part("live rows' recurrent state", where, B * image,
             f"{B} rows x {image:,} B (conv {profile.compute_dtype} + fp32 state)"),
        Part("state slots", where, profile.state_slots * image,
             f"{profile.state_slots} slots x {image:,} B"),
        Part("prefill activations", where,
             activation_bytes(cfg, profile.prefill_chunk, itemsize),
             f"chunk {profile.prefill_chunk} at the widest layer, x2, + logits", exact=False),
        Part("compiled code and workspace", where, profile.compile_headroom_bytes,
             "the profile's compile_headroom_bytes", exact=False),
    ]
    budget = None
    if gpu:
        budget = card["memory_mib"] * MiB - profile.admission_headroom_bytes
    auto = profile.kv_capacity_auto
    if auto:
        if budget is None:
            raise ValueError(f"lane {profile.name!r}: kv_capacity_tokens = \"auto\" needs a "
                             f"[card] with memory_mib")
        room = budget - sum(p.bytes for p in fixed)
        page = kv_tok * pk.PAGE_SIZE
        capacity = max(0, room // page) * pk.PAGE_SIZE
    else:
        capacity = profile.kv_capacity_tokens
    pages = kv_pool_pages(max(capacity, ctx), ctx, B)
    kv = Part("KV pool", where, pages * pk.PAGE_SIZE * kv_tok,
              f"{pages:,} pages x {pk.PAGE_SIZE} tokens x {kv_tok:,} B ({profile.kv_dtype})")
    parts = fixed[:1] + [kv] + fixed[1:]
    if auto and capacity < max(ctx, B * ctx if B > 1 else ctx):
        problems.append(f"kv_capacity_tokens auto resolves to {capacity:,} tokens on "
                        f"{card['name']}, less than {B} x the {ctx:,}-token context; lower "
                        f"context_tokens or max_concurrency, use kv_dtype int8, or a smaller "
                        f"weight format")
    host = "host"
    parts += [
        Part("host state tier", host, profile.host_state_bytes, "the profile's host_state_bytes"),
        Part("checkpoint staging", host, profile.checkpoint_staging_bytes,
             "the profile's checkpoint_staging_bytes"),
        Part("RAM floor", host, profile.ram_floor_bytes,
             "the profile's ram_floor_bytes (the process, its libraries, the page cache)"),
    ]
    if not gpu:  # the CPU lane: the "device" parts live in host memory too
        parts = [Part(p.name, host, p.bytes, p.formula, p.exact) for p in parts]
    plan = MemoryPlan(lane=profile.name, card=card["name"] if gpu else "cpu", parts=parts,
                      device_budget=budget, host_budget=host_ram, kv_capacity_tokens=capacity,
                      kv_auto=auto, problems=problems)
    if budget is not None and plan.total("device") > budget:
        over = plan.total("device") - budget
        problems.append(f"the device parts need {plan.total('device'):,} B, {over:,} B "
                        f"({over / MiB:,.0f} MiB) more than the {budget:,} B the "
                        f"{card['name']} gives the engine ({card['memory_mib']:,} MiB less "
                        f"{profile.admission_headroom_bytes:,} B admission headroom)")
    if host_ram is not None and plan.total("host") > host_ram:
        problems.append(f"the host parts need {plan.total('host'):,} B, more than this "
                        f"host's {host_ram:,} B of RAM")
    return plan


def allocator_fraction(profile) -> float | None:
    """The share of the card JAX's allocator takes at start (what the plan budgets: the card
    less the admission headroom), or None on the CPU lane. JAX's default, 75% of the card,
    would hold back memory the plan counts on, or on a card with other work, take too much."""
    if not profile.gpu:
        return None
    card = profile.table("card")
    total = card["memory_mib"] * MiB
    return (total - profile.admission_headroom_bytes) / total


def apply_process_settings(profile) -> None:
    """What a lane sets in this process before JAX starts its backend (JAX reads both from
    the environment then): its kernel plan's XLA flags (engine/plan.py) and, on a GPU lane,
    the allocator's share of the card (the lane's, over any inherited value)."""
    import os

    from engine.plan import apply_process_settings as apply_plan

    apply_plan(profile.plan)
    fraction = allocator_fraction(profile)
    if fraction is not None:
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"
