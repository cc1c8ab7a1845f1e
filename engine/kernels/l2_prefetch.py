"""Weights of a decode step's next GEMV asked into L2 while the HBM would idle.

A decode step streams ~14.8 GB of int4 weights (the 27B) through GEMVs that reach 1.6-2.5 TB/s
of the 4.3 TB/s a copy does, bound by their loads' latency (docs/benchmarks/README.md v19),
while ~1.9 ms a step of small kernels, the GDN kernel and attention leave the HBM idle. At a
point of the layer (below), `at_point(x, point, mats)` returns x and, on the side, starts
the L2 fill of the first bytes of the layer's next matrices (engine/kernels/cuda/l2_prefetch.cu:
one op call between x's producer and its consumers, its output aliasing x), so that the GEMV
after the gap finds them at L2 latency. No value changes: x passes through bit for bit.

NINFER_L2_PREFETCH (unset or "off": nothing; the default until the H200 says otherwise)
names the points and the megabytes each prefetches, comma-separated `point=MB` (`all`: the
whole layer of those matrices):
- `in`: at a layer's start, before its input norm: its input projections (GDN in_proj
  qkv|z|b|a, attention q|k|v), in the order the one GEMV launch reads their rows;
- `out`: after the input projections, before the GDN kernel or attention: the mixer's output
  projection (GDN out_proj, attention o_proj);
- `mlp`: after the output projection, before the residual add and the post-attention norm:
  gate and up, the first rows of each (the MLP's tile u reads rows 16u.. of both).
NINFER_L2_PREFETCH_MODE: 1 `prefetch.global.L2`, 2 the same with evict_last (default), 3
bulk prefetches (sm_90); NINFER_L2_PREFETCH_STEP bytes a prefetch (modes 1, 2: 32 or 128,
default 128; mode 3: default 16384); NINFER_L2_PREFETCH_BLOCKS (default 132).
Only decode-sized rows (at most `cuda_ops.WIDE_MAX_M`) of int4_g64 `Stacked` layer views on a
GPU where the CUDA ops build take it; anywhere else x comes back as it is.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

POINTS = ("in", "out", "mlp")
MODES = (1, 2, 3)
_ORDER = {"in": "concat", "out": "concat", "mlp": "parallel"}


@dataclass(frozen=True)
class Plan:
    """Megabytes a point prefetches (None: the whole layer of its matrices), and how."""
    mb: tuple[tuple[str, float | None], ...]
    mode: int = 2
    step: int = 128
    blocks: int = 132

    def budget(self, point: str) -> tuple[bool, float | None]:
        """(whether the point prefetches, its megabytes or None for all)."""
        for name, mb in self.mb:
            if name == point:
                return True, mb
        return False, None


def parse_plan(spec: str | None, mode: str | None = None, step: str | None = None,
               blocks: str | None = None) -> Plan | None:
    """The plan NINFER_L2_PREFETCH* spell (see the module's doc); None for none. A malformed
    setting is a ValueError that names it."""
    if spec is None or spec.strip() in ("", "off", "0"):
        return None
    mb: list[tuple[str, float | None]] = []
    for part in spec.split(","):
        name, sep, amount = part.strip().partition("=")
        if not sep or name not in POINTS or name in (n for n, _ in mb):
            raise ValueError(f"NINFER_L2_PREFETCH: {part!r}: want point=MB with a point of "
                             f"{POINTS} (each once), e.g. 'out=all,mlp=24'")
        if amount == "all":
            mb.append((name, None))
            continue
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"NINFER_L2_PREFETCH: {part!r}: MB must be a positive number "
                             "or 'all'")
        mb.append((name, value))
    m = _int_setting("NINFER_L2_PREFETCH_MODE", mode, 2)
    if m not in MODES:
        raise ValueError(f"NINFER_L2_PREFETCH_MODE must be one of {MODES}, got {m}")
    s = _int_setting("NINFER_L2_PREFETCH_STEP", step, 16384 if m == 3 else 128)
    if (m < 3 and s not in (32, 128)) or (m == 3 and (s < 32 or s % 16)):
        raise ValueError("NINFER_L2_PREFETCH_STEP: 32 or 128 with modes 1 and 2, a multiple "
                         f"of 16 from 32 with mode 3; got {s}")
    b = _int_setting("NINFER_L2_PREFETCH_BLOCKS", blocks, 132)
    if not 1 <= b <= 4096:
        raise ValueError(f"NINFER_L2_PREFETCH_BLOCKS must be 1..4096, got {b}")
    return Plan(tuple(mb), m, s, b)


def _int_setting(name: str, value: str | None, default: int) -> int:
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def plan() -> Plan | None:
    """The plan of this process's environment (read at trace time)."""
    env = os.environ.get
    return parse_plan(env("NINFER_L2_PREFETCH"), env("NINFER_L2_PREFETCH_MODE"),
                      env("NINFER_L2_PREFETCH_STEP"), env("NINFER_L2_PREFETCH_BLOCKS"))


def _row_bytes(w) -> int:
    """Bytes of one output row of an int4_g64 QTensor [N, K]: codes and scales."""
    k = w.shape[1]
    return k // 2 + (k // 64) * jnp.dtype(w.scale.dtype).itemsize


def rows_for(mats, mb: float | None, order: str) -> list[int]:
    """Rows of each matrix (int4_g64 QTensors of logical shape [N_j, K], stacked or not) that `mb` megabytes cover: -1
    (all) for None; "concat": the first rows of the matrices side by side, as one GEMV
    launch reads them (the first matrix first); "parallel": the same first rows of each."""
    if mb is None:
        return [-1] * len(mats)
    budget = mb * 1e6
    if order == "parallel":
        r = int(budget // sum(_row_bytes(w) for w in mats))
        return [min(r, w.shape[0]) for w in mats]
    rows = []
    for w in mats:
        r = int(min(budget // _row_bytes(w), w.shape[0]))
        rows.append(r)
        budget -= r * _row_bytes(w)
    return rows


def at_point(x, point: str, views, kernels: str = "xla", settings: Plan | None = None):
    """x, with the L2 fill of `point`'s share of `views` (`Stacked` layer views of int4_g64
    QTensor stacks, one layer index) started on the side where the plan names the point and
    the op runs here (see the module's doc); else x itself."""
    if point not in POINTS:
        raise ValueError(f"l2_prefetch: point must be one of {POINTS}, got {point!r}")
    if kernels != "pallas":
        return x
    p = plan() if settings is None else settings
    if p is None:
        return x
    on, mb = p.budget(point)
    if not on or not _takes(x, views):
        return x
    from engine.kernels import cuda_ops

    mats = [v.w for v in views]
    index = jnp.asarray(views[0].index, jnp.int32).reshape(-1)
    # the codes' and the scales' stacks of a matrix take the same rows
    rows = [r for r in rows_for(mats, mb, _ORDER[point]) for _ in (0, 1)]
    stacks = [a for w in mats for a in (w.data, w.scale)]
    call = jax.ffi.ffi_call(cuda_ops.L2_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype),
                            input_output_aliases={0: 0})
    return call(x, index, *stacks, lead=np.int64(index.shape[0]),
                rows=np.asarray(rows, np.int64), offset=np.int64(0), mode=np.int64(p.mode),
                step=np.int64(p.step), blocks=np.int64(p.blocks))


def _takes(x, views) -> bool:
    from engine.kernels import cuda_ops
    from engine.kernels.stacked import Stacked
    from engine.quant import INT4_G64, QTensor

    m = int(np.prod(x.shape[:-1], dtype=np.int64))
    if not (1 <= m <= cuda_ops.WIDE_MAX_M) or not views or len(views) > 4:
        return False
    if not all(isinstance(v, Stacked) and isinstance(v.w, QTensor) and v.w.fmt == INT4_G64
               for v in views):
        return False
    lead = int(jnp.shape(views[0].index)[0])
    if any(int(jnp.shape(v.index)[0]) != lead or jnp.ndim(v.w.data) != lead + 2
           for v in views):
        return False
    return cuda_ops.available()
