"""Retention weight: which stored state to keep when memory runs out. Higher is kept longer.

The rule, in order of base weight:

  SESSION_HEAD     8  the newest response of a session: the next turn continues from it
  SHARED_PREFIX    4  the state after the instructions and tools many sessions share (~18 KB)
  SESSION_HISTORY  2  older responses of a session: rollback and fork points
  FORK, ONE_OFF    1  branches off older responses, retries, sub-agents; requests with no session

and every weight halves for each `half_life_s` the state sits idle (unused since `last_active`).
So a session's head outranks everything else while the session is active, and an abandoned head
falls to the rank of a fresh one-off after three half-lives (8 -> 1).

Because every weight decays at the same rate, the order of two idle states never changes with
time; only an event (a new turn, a hit on a prefix, a role change) changes it. `retention_score`
is that time-independent form (log2 of the weight, shifted by a common amount), so scores computed
at different moments compare correctly: a pool can store a score once per event instead of
re-weighing every image on a timer.
"""
from __future__ import annotations

import enum
import math
from types import MappingProxyType


class Role(enum.Enum):
    SESSION_HEAD = "session_head"
    SHARED_PREFIX = "shared_prefix"
    SESSION_HISTORY = "session_history"
    FORK = "fork"
    ONE_OFF = "one_off"


BASE_WEIGHT = MappingProxyType({
    Role.SESSION_HEAD: 8.0,
    Role.SHARED_PREFIX: 4.0,
    Role.SESSION_HISTORY: 2.0,
    Role.FORK: 1.0,
    Role.ONE_OFF: 1.0,
})

# 15 minutes: a coding agent waiting on a human is idle for minutes, not hours.
DEFAULT_HALF_LIFE_S = 900.0


def _check(name: str, v: float, positive: bool = False) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be {'positive' if positive else 'non-negative'}, got {v!r}")
    return float(v)


def retention_weight(role: Role, idle_s: float, *,
                     half_life_s: float = DEFAULT_HALF_LIFE_S) -> float:
    """BASE_WEIGHT[role] halved for every `half_life_s` seconds of idleness."""
    idle = _check("idle_s", idle_s)
    hl = _check("half_life_s", half_life_s, positive=True)
    return BASE_WEIGHT[Role(role)] * 2.0 ** (-idle / hl)


def retention_score(role: Role, last_active_s: float, *,
                    half_life_s: float = DEFAULT_HALF_LIFE_S) -> float:
    """log2 of the weight at any common `now`, plus log2(now)/half-life: independent of `now`.

    `last_active_s` is a monotonic timestamp (seconds). For any now >= both timestamps,
    score(a) < score(b) exactly when weight(a, now - a.last) < weight(b, now - b.last)."""
    if not isinstance(last_active_s, (int, float)) or not math.isfinite(last_active_s):
        raise ValueError(f"last_active_s must be a finite number, got {last_active_s!r}")
    hl = _check("half_life_s", half_life_s, positive=True)
    return math.log2(BASE_WEIGHT[Role(role)]) + last_active_s / hl
