"""Host bookkeeping for the paged attention KV pool: which page ids each sequence holds.

The device pool (`engine/ops/paged_kv.py`, [attn_layers, num_pages, page_size, kv_heads, head_dim])
knows nothing about ownership. This module decides page ids and tells the device which pages to
copy; it never touches device arrays. Token i of a sequence lives in page
`pages[i // page_size]` at slot `i % page_size`.

Pages are shared by reference between a response and the responses that continue it (`fork`), and
copied on write: a table only ever writes into a page that no other table holds. Full pages are
never written again, so sharing them is free; only a partial last page held by more than one table
has to be copied before an append, and that copy is the `CopyPlan` the device executes first.
"""
from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


class PagesExhausted(RuntimeError):
    """An allocation asked for more pages than are free (check `can_allocate` first)."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def _positive_int(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


class PageAllocator:
    """A fixed set of page ids with reference counts.

    Free pages are handed out lowest id first, so the same sequence of calls always yields the same
    ids (reproducible block tables, stable tests). A page is free exactly when its count is 0.
    `page_bytes` is only for accounting (stats): the device bytes of one page, e.g.
    `paged_kv.kv_bytes_per_token(cfg, dtype) * page_size`.
    """

    def __init__(self, num_pages: int, page_size: int, page_bytes: int = 0):
        self.num_pages = _positive_int("num_pages", num_pages)
        self.page_size = _positive_int("page_size", page_size)
        if not isinstance(page_bytes, int) or page_bytes < 0:
            raise ValueError(f"page_bytes must be a non-negative integer, got {page_bytes!r}")
        self.page_bytes = page_bytes
        self._free: list[int] = list(range(num_pages))  # a sorted list is already a heap
        self._refs: list[int] = [0] * num_pages

    # ---- queries ---------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._refs[page]

    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes

    def free_bytes(self) -> int:
        return self.free_pages * self.page_bytes

    def stats(self) -> dict[str, int]:
        return {
            "pages_total": self.num_pages,
            "pages_used": self.used_pages,
            "pages_free": self.free_pages,
            "pages_shared": sum(1 for r in self._refs if r > 1),
            "page_size_tokens": self.page_size,
            "page_bytes": self.page_bytes,
            "kv_bytes_total": self.num_pages * self.page_bytes,
            "kv_bytes_used": self.used_bytes(),
        }

    # ---- guard / act -----------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages (lowest ids first), each with refcount 1."""
        if not self.can_allocate(n):
            raise PagesExhausted(f"asked for {n} pages, {len(self._free)} free of {self.num_pages}")
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for p in ids:
            self._refs[p] = 1
        return ids

    def retain(self, ids: Iterable[int]) -> None:
        """One more reference to each of `ids` (all must be in use)."""
        ids = list(ids)
        for p in ids:
            self._check_id(p)
            if self._refs[p] == 0:
                raise ValueError(f"retain of free page {p}")
        for p in ids:
            self._refs[p] += 1

    def release(self, ids: Iterable[int]) -> None:
        """Drop one reference per occurrence in `ids`; a page whose count reaches 0 is free.

        Validated before anything changes, so a bad call leaves the allocator as it was."""
        counts = Counter(ids)
        for p, k in counts.items():
            self._check_id(p)
            if k > self._refs[p]:
                raise ValueError(f"release of page {p} x{k} but it has {self._refs[p]} references")
        for p, k in counts.items():
            self._refs[p] -= k
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)

    def _check_id(self, p) -> None:
        if not isinstance(p, (int, np.integer)) or not 0 <= p < self.num_pages:
            raise ValueError(f"page id {p!r} is not in [0, {self.num_pages})")


@dataclass(frozen=True)
class CopyPlan:
    """Device work an append needs before the new tokens are written.

    `copies` are (src, dst) page pairs for `copy_pages(pool, src_ids, dst_ids)`: copy-on-write of a
    shared partial page. `allocated` lists every page the append took (dst pages included)."""
    copies: tuple[tuple[int, int], ...] = ()
    allocated: tuple[int, ...] = ()

    @property
    def src_ids(self) -> np.ndarray:  # [num_copies] int32
        return np.array([s for s, _ in self.copies], np.int32)

    @property
    def dst_ids(self) -> np.ndarray:  # [num_copies] int32
        return np.array([d for _, d in self.copies], np.int32)

    def arrays(self, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(src_ids, dst_ids) int32, padded to `pad_to` entries with src 0 / dst -1 (a negative
        dst is a no-op in `paged_kv.copy_pages`), so a fixed length avoids recompiles."""
        n = len(self.copies)
        size = n if pad_to is None else pad_to
        if size < n:
            raise ValueError(f"{n} copies do not fit in pad_to={pad_to}")
        src, dst = np.zeros((size,), np.int32), np.full((size,), -1, np.int32)
        src[:n], dst[:n] = self.src_ids, self.dst_ids
        return src, dst

    @staticmethod
    def merge(plans: Sequence["CopyPlan"]) -> "CopyPlan":
        """One plan for a whole batch step (dst pages are distinct: each was freshly allocated)."""
        return CopyPlan(tuple(c for p in plans for c in p.copies),
                        tuple(a for p in plans for a in p.allocated))


class PageTable:
    """One sequence's pages and token length, bound to the allocator its references live in.

    Every page in `pages` is one reference in the allocator; `release()` gives them all back.
    """

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self._pages: list[int] = []
        self._num_tokens = 0

    @property
    def pages(self) -> tuple[int, ...]:
        return tuple(self._pages)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def fork(self, num_tokens: int | None = None) -> "PageTable":
        """A new table sharing this one's first `num_tokens` tokens (default: all) by reference."""
        n = self._num_tokens if num_tokens is None else num_tokens
        if not 0 <= n <= self._num_tokens:
            raise ValueError(f"fork at {n} tokens of a {self._num_tokens}-token table")
        child = PageTable(self.allocator)
        shared = self._pages[:pages_for(n, self.page_size)]
        self.allocator.retain(shared)
        child._pages, child._num_tokens = list(shared), n
        return child

    def needs_cow(self) -> bool:
        """Whether the next append must copy the last page first: it is partial, so the append
        writes into it, and another table holds it, so that table may read the slots we write.

        This is derived from the refcount at append time rather than stored as a flag, so it stays
        right when the other holder goes away (no needless copy) or a truncate leaves a shared page
        partial (the copy happens)."""
        return (self._num_tokens % self.page_size != 0
                and self.allocator.refcount(self._pages[-1]) > 1)

    def pages_needed(self, n_tokens: int) -> int:
        """Fresh pages an append of `n_tokens` takes, the copy-on-write page included."""
        if n_tokens < 0:
            raise ValueError(f"cannot append {n_tokens} tokens")
        if n_tokens == 0:
            return 0
        grow = pages_for(self._num_tokens + n_tokens, self.page_size) - len(self._pages)
        return grow + (1 if self.needs_cow() else 0)

    def can_append(self, n_tokens: int) -> bool:
        return self.allocator.can_allocate(self.pages_needed(n_tokens))

    def append(self, n_tokens: int) -> CopyPlan:
        """Make room for `n_tokens` more tokens; run the returned copies before writing them.

        All or nothing: raises PagesExhausted (and changes nothing) if the pages are not free."""
        fresh = self.allocator.allocate(self.pages_needed(n_tokens))
        allocated = tuple(fresh)
        copies: tuple[tuple[int, int], ...] = ()
        if n_tokens and self.needs_cow():
            src, dst = self._pages[-1], fresh.pop(0)
            self._pages[-1] = dst
            self.allocator.release([src])  # still held by the other table(s): never freed here
            copies = ((src, dst),)
        self._pages.extend(fresh)
        self._num_tokens += n_tokens
        return CopyPlan(copies, allocated)

    def truncate(self, n_tokens: int) -> None:
        """Roll back to the first `n_tokens` tokens: whole pages past them are released.

        A last page left partial keeps its stale tail; the next append overwrites it in place if
        this table is its only holder, and copies it first otherwise (see `needs_cow`)."""
        if not 0 <= n_tokens <= self._num_tokens:
            raise ValueError(f"truncate to {n_tokens} tokens of a {self._num_tokens}-token table")
        keep = pages_for(n_tokens, self.page_size)
        dropped, self._pages = self._pages[keep:], self._pages[:keep]
        self._num_tokens = n_tokens
        self.allocator.release(dropped)

    def release(self) -> None:
        """Give every page back; the table is empty and may be reused."""
        self.truncate(0)

    def as_row(self, max_pages: int, fill: int = 0) -> np.ndarray:
        """This table as one row of the device block table: [max_pages] int32.

        Entries past `len(pages)` are `fill` (0 keeps gathers in bounds; the device masks every
        position at or past the row's length, so they are never read)."""
        if len(self._pages) > max_pages:
            raise ValueError(f"table holds {len(self._pages)} pages, row has {max_pages}")
        row = np.full((max_pages,), fill, np.int32)
        row[:len(self._pages)] = self._pages
        return row
