"""The runtime's memory: paged KV, recurrent-state images and the prefix index, as one unit.

`Memory` owns the device pool and the batched `PagedCache`, and the host bookkeeping of what
lives in it. The engine thread calls it in a fixed pattern:

    begin(seq)              at admission: find the longest stored state the prompt continues,
                            share its pages and restore its GDN state into the row (or start empty)
    prepare(seqs, n)        before a step: make room for n tokens per row (copy-on-write, evicting
                            stored states when pages run out), refresh the block table rows
    snapshot(seq, n, kind)  after a step: store the state after the first n tokens of the sequence
    end(seq)                when a sequence finishes: give its pages back

Evicting a stored state calls `before_evict(snapshot)` first (the checkpoint work saves there).

The prefix index (`PrefixIndex`): stored model states keyed by the exact token sequence they
follow. A snapshot is the model state after a token sequence: KV pages (a forked `PageTable`) plus a
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
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.cache import PagedCache, init_paged_cache
from engine.model.config import ModelConfig
from engine.ops import paged_kv as pk
from engine.runtime.pages import PageAllocator, PageTable, pages_for
import engine.runtime.state_copy as sc
from engine.runtime.states import StatePool, Tier


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


# A shared prefix serves every new session of its principal: kept like a live session head.
_ROLE = {"response": Role.SESSION_HEAD, "prefix": Role.SESSION_HEAD}


class Memory:
    def __init__(self, cfg: ModelConfig, *, batch: int, context_tokens: int,
                 capacity_tokens: int, kv_dtype, conv_dtype, state_slots: int,
                 host_state_bytes: int, page_size: int = pk.PAGE_SIZE,
                 before_evict: Callable[[Snapshot], None] | None = None, mtp: bool = False):
        self.cfg = cfg
        self.page_size = page_size
        self.max_pages = pages_for(context_tokens, page_size)
        num_pages = max(pages_for(capacity_tokens, page_size), batch * self.max_pages)
        page_bytes = pk.kv_bytes_per_token(cfg, kv_dtype, mtp=mtp) * page_size
        self.alloc = PageAllocator(num_pages, page_size, page_bytes)
        pool = pk.init_kv_pool(cfg, num_pages, page_size, kv_dtype, mtp=mtp)
        self.table = np.zeros((batch, self.max_pages), np.int32)
        self.cache: PagedCache = init_paged_cache(cfg, pool, self.table.copy(), conv_dtype)
        if mtp:  # MTP drafting: every forward keeps the MTP layer's KV current (model.py)
            self.cache = self.cache._replace(
                mtp_hidden=jnp.zeros((batch, cfg.hidden_size), conv_dtype))
        self.states = StatePool(cfg, state_slots, host_state_bytes, conv_dtype=conv_dtype,
                                on_evict=self._image_evicted)
        self.index = PrefixIndex()
        self._by_key: dict[str, Snapshot] = {}
        self.before_evict = before_evict
        self.evictions = 0

    # ---- sequences ------------------------------------------------------------------------
    def begin(self, seq, principal: str | None) -> tuple[str, int]:
        """Place `seq` in its row; returns (reuse path, cached tokens)."""
        snap = self.index.longest_prefix(principal, seq.prompt_ids) if principal else None
        if snap is not None and snap.image.tier is Tier.HOST and not self.states.can_fetch(
                snap.image):
            snap = None
        if snap is None:
            seq.table = PageTable(self.alloc)
            self._set_row(seq.slot, seq.table, pos=0)
            conv, rec = sc.zero_row(self.cache.conv, self.cache.rec, np.int32(seq.slot))
            self.cache = self.cache._replace(conv=conv, rec=rec)
            return "root", 0
        path = {"prefix": "shared-prefix", "response": "continuation"}[snap.kind]
        if snap.kind == "response" and snap.uses > 0:
            path = "fork"
        restored = "host-restored" if snap.image.tier is Tier.HOST else None
        if snap.from_disk and snap.uses == 0:
            restored = "disk-restored"
        snap.uses += 1
        if snap.image.tier is Tier.HOST:
            self.states.fetch(snap.image)
        conv, rec = self.states.restore_into(self.cache.conv, self.cache.rec, seq.slot,
                                             snap.image)
        self.cache = self.cache._replace(conv=conv, rec=rec)
        seq.table = snap.pages.fork()
        self._set_row(seq.slot, seq.table, pos=snap.num_tokens)
        # A response that has been continued is history now; the continuation becomes the head.
        role = Role.SESSION_HISTORY if snap.kind == "response" else _ROLE[snap.kind]
        self.states.set_weight(snap.image, retention_score(role, _now()))
        return restored or path, snap.num_tokens

    def prepare(self, seqs, n_tokens: int) -> None:
        """Room for `n_tokens` more tokens in each sequence's pages, copies done on the device."""
        src, dst, changed = [], [], False
        for seq in seqs:
            while not seq.table.can_append(n_tokens):
                if not self._evict_one():
                    raise MemoryError("KV pages exhausted with nothing left to evict")
            plan = seq.table.append(n_tokens)
            src += list(plan.src_ids)
            dst += list(plan.dst_ids)
            row = seq.table.as_row(self.max_pages)
            if not np.array_equal(row, self.table[seq.slot]):
                self.table[seq.slot] = row
                changed = True
        if src:
            pool = pk.copy_pages(self.cache.pool, np.asarray(src, np.int32),
                                 np.asarray(dst, np.int32))
            self.cache = self.cache._replace(pool=pool)
        if changed:  # most decode steps stay within their pages: the device's table holds
            self.cache = self.cache._replace(block_table=self._device_table())

    def rollback(self, cuts) -> None:
        """Cut each (seq, n_tokens) of `cuts` back to its first n_tokens KV slots (a verify
        pass's rejected positions): pages past them go back to the allocator."""
        for seq, n in cuts:
            seq.table.truncate(n)
            self.table[seq.slot] = seq.table.as_row(self.max_pages)
        self.cache = self.cache._replace(block_table=self._device_table())

    def snapshot(self, seq, principal: str | None, n_tokens: int, kind: str,
                 one_off: bool = False, session: str | None = None) -> bool:
        """Store the state after the first `n_tokens` tokens of `seq` (its row must be there).
        `one_off`: a response outside any session, evicted before session states."""
        if not principal or n_tokens <= 0:
            return False
        tokens = (list(seq.prompt_ids) + list(seq.output_ids))[:n_tokens]
        snap = Snapshot(principal, tokens, kind, session=session)
        if self.index.get(principal, snap.key) is not None or not self.states.can_store():
            return False
        snap.image = self.states.store(self.cache.conv, self.cache.rec, seq.slot, key=snap.key,
                                       num_tokens=n_tokens,
                                       weight=retention_score(
                                           Role.ONE_OFF if one_off else _ROLE[kind], _now()))
        snap.pages = seq.table.fork(n_tokens)
        self.index.add(snap)
        self._by_key[snap.key] = snap
        return True

    def install(self, snap: Snapshot) -> None:
        """Index a snapshot whose pages and image the caller placed (a checkpoint restore)."""
        self.index.add(snap)
        self._by_key[snap.key] = snap

    def end(self, seq) -> None:
        if getattr(seq, "table", None) is not None:
            seq.table.release()
            seq.table = None

    def forget(self, principal: str, key: str) -> bool:
        """Drop the stored state with content key `key` (a deleted response or purged session):
        its KV pages and state image are released now, not when eviction gets to them."""
        snap = self.index.get(principal, key)
        if snap is None or snap.image.pinned:
            return False
        self.states.drop(snap.image)
        self._forget(snap)
        return True

    def forget_session(self, principal: str, session: str) -> int:
        """Drop every stored response state of one session (a session purge); returns how many.
        Shared-prefix states stay: they hold only the principal's system turn."""
        gone = [s for s in self.index.snapshots(principal)
                if s.kind == "response" and s.session == session and not s.image.pinned]
        for snap in gone:
            self.states.drop(snap.image)
            self._forget(snap)
        return len(gone)

    # ---- eviction -------------------------------------------------------------------------
    def _evict_one(self) -> bool:
        """Drop the stored state with the lowest retention; False when none is left."""
        victims = [s for s in self._by_key.values() if not s.image.pinned]
        if not victims:
            return False
        snap = min(victims, key=lambda s: (s.image.weight, s.image.last_used))
        if self.before_evict:
            self.before_evict(snap)
        self.states.drop(snap.image)
        self._forget(snap)
        return True

    def _image_evicted(self, image) -> None:
        # Called by the state pool before it drops an image it had to make room for.
        snap = self._by_key.get(image.key)
        if snap is not None and self.before_evict:
            self.before_evict(snap)
        if snap is not None:
            self._forget(snap)

    def _forget(self, snap: Snapshot) -> None:
        self.evictions += 1
        self.index.remove(snap)
        self._by_key.pop(snap.key, None)
        snap.pages.release()

    # ---- helpers --------------------------------------------------------------------------
    def _device_table(self) -> jax.Array:
        """The block table as the next step reads it, from a host copy of its own. The CPU
        backend may alias a 64-byte-aligned numpy buffer instead of copying it, and reads it
        only when the step runs: handed `self.table` itself, a step still queued behind the
        last one would see the rows the host writes for the step after it (a prefill piece's
        K/V went to the copy-on-write page that the next piece's `prepare` put in the row,
        and the snapshot's page kept zeros)."""
        return jax.device_put(self.table.copy())

    def _set_row(self, row: int, table: PageTable, pos: int) -> None:
        self.table[row] = table.as_row(self.max_pages)
        p, mp = sc.set_position(self.cache.pos, self.cache.mtp_pos, np.int32(row), np.int32(pos))
        self.cache = self.cache._replace(pos=p, mtp_pos=mp, block_table=self._device_table())
        if self.cache.mtp_hidden is not None:
            # a stored state carries no pending MTP input: the row's first draft starts from
            # zero, never from the row's previous sequence (engine/model/model.py mtp_track)
            self.cache = self.cache._replace(
                mtp_hidden=sc.clear_hidden(self.cache.mtp_hidden, np.int32(row)))

    def warm(self) -> None:
        """Run once each device op that admitting, continuing and storing a request runs (row
        0's position, table row and states set; a state stored and restored; a page copied on
        write), so that a first request compiles none of them: before this they compiled on
        first use, ~0.5 s of a first request's time to first token. Before serving only
        (it writes row 0 and the state pool's slot 0)."""
        table = PageTable(self.alloc)
        self._set_row(0, table, pos=0)
        table.release()
        conv, rec = sc.zero_row(self.cache.conv, self.cache.rec, np.int32(0))
        conv, rec = self.states.warm(conv, rec)
        self.cache = self.cache._replace(conv=conv, rec=rec)
        # no page is written: a negative destination is skipped
        none = np.full((1,), -1, np.int32)
        self.cache = self.cache._replace(pool=pk.copy_pages(self.cache.pool, none + 1, none))
        jax.block_until_ready(self.cache)

    def stats(self) -> dict:
        return {"kv": self.alloc.stats(), "states": self.states.stats(),
                "snapshots": len(self.index), "evictions": self.evictions}


def _now() -> float:
    import time

    return time.time()
