"""Prefix index: stored model states keyed by the exact token sequence they follow.

A snapshot is the model state after a token sequence: KV pages (a forked `PageTable`) plus a
recurrent-state image. A new request whose prompt starts with a snapshot's tokens continues from
it and computes only the rest. One mechanism serves continuation (the prompt extends a stored
response), forks and rollback (two prompts extend the same or an older response), and the shared
stable prefix (a snapshot at the end of the system turn). Snapshots belong to one principal and
are never matched across principals.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

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
