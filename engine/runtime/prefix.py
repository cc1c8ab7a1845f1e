"""Prefix index: stored model states keyed by the exact token sequence they follow.

A snapshot is the model state after a token sequence: KV pages (a forked `PageTable`) plus a
recurrent-state image. A new request whose prompt starts with a snapshot's tokens continues from
it and computes only the rest. One mechanism serves continuation (the prompt extends a stored
response), forks and rollback (two prompts extend the same or an older response), and the shared
stable prefix (a snapshot at the end of the system turn). Snapshots belong to one principal and
are never matched across principals.

Retention (`Role`, `retention_score`): which stored state to keep when memory runs out; higher
is kept longer.

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
import hashlib
import math
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np


def token_key(principal: str, tokens) -> str:
    """Content key of a state: who owns it and exactly which tokens it follows."""
    h = hashlib.sha256(b"ninfer-state/v1\0" + principal.encode() + b"\0")
    h.update(np.asarray(tokens, np.int32).tobytes())
    return h.hexdigest()


@dataclass(eq=False)
class Snapshot:
    principal: str
    tokens: np.ndarray      # int32 [n]: the state follows exactly these tokens
    kind: str               # "response" | "prefix"
    pages: object = None    # PageTable holding this state's KV pages (shared, refcounted)
    image: object = None    # StateImage in the StatePool
    uses: int = 0           # requests that continued from it (the second one is a fork)
    session: str | None = None  # the prompt_cache_key of the response that produced it
    from_disk: bool = False     # installed from a checkpoint (engine/runtime/checkpoint_io.py)
    key: str = field(init=False)

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, np.int32)
        self.key = token_key(self.principal, self.tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


class PrefixIndex:
    def __init__(self):
        self._by_principal: dict[str, dict[str, Snapshot]] = {}

    def __len__(self) -> int:
        return sum(len(d) for d in self._by_principal.values())

    def get(self, principal: str, key: str) -> Snapshot | None:
        return self._by_principal.get(principal, {}).get(key)

    def add(self, snap: Snapshot) -> Snapshot:
        """Index `snap`; if an identical state is already indexed, returns that one instead."""
        d = self._by_principal.setdefault(snap.principal, {})
        return d.setdefault(snap.key, snap)

    def remove(self, snap: Snapshot) -> None:
        d = self._by_principal.get(snap.principal, {})
        if d.get(snap.key) is snap:
            del d[snap.key]

    def snapshots(self, principal: str | None = None) -> list[Snapshot]:
        if principal is not None:
            return list(self._by_principal.get(principal, {}).values())
        return [s for d in self._by_principal.values() for s in d.values()]

    def longest_prefix(self, principal: str, prompt) -> Snapshot | None:
        """The snapshot with the most tokens that is a STRICT prefix of `prompt`.

        Strict: at least one prompt token must remain to compute, because the logits of the
        last token are not part of a stored state.
        """
        prompt = np.asarray(prompt, np.int32)
        best = None
        for snap in self._by_principal.get(principal, {}).values():
            n = snap.num_tokens
            if n >= prompt.shape[0] or (best is not None and n <= best.num_tokens):
                continue
            if np.array_equal(prompt[:n], snap.tokens):
                best = snap
        return best


# ---- retention -------------------------------------------------------------------------------
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
