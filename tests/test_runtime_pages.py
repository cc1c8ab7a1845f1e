"""KV page bookkeeping: allocator, page tables, copy-on-write (engine/runtime/pages.py)."""
from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.runtime.pages import CopyPlan, PageAllocator, PagesExhausted, PageTable, pages_for


# ---- allocator ---------------------------------------------------------------------------------
def test_allocate_lowest_first_and_reuse():
    a = PageAllocator(6, 4)
    assert a.allocate(3) == [0, 1, 2]
    a.release([1])
    assert a.allocate(2) == [1, 3]
    assert (a.used_pages, a.free_pages) == (4, 2)


def test_allocate_beyond_capacity_raises_and_changes_nothing():
    a = PageAllocator(3, 4)
    a.allocate(2)
    assert a.can_allocate(1) and not a.can_allocate(2) and not a.can_allocate(-1)
    with pytest.raises(PagesExhausted):
        a.allocate(2)
    assert a.free_pages == 1 and a.allocate(1) == [2]


def test_retain_release_refcounts():
    a = PageAllocator(4, 4)
    p = a.allocate(1)
    a.retain(p)
    assert a.refcount(p[0]) == 2
    a.release(p)
    assert a.refcount(p[0]) == 1 and a.free_pages == 3
    a.release(p)
    assert a.refcount(p[0]) == 0 and a.free_pages == 4


def test_bad_retain_and_release_change_nothing():
    a = PageAllocator(4, 4)
    p, q = a.allocate(2)
    with pytest.raises(ValueError):
        a.retain([p, 3])  # 3 is free
    assert a.refcount(p) == 1
    with pytest.raises(ValueError):
        a.release([q, p, p])  # p has one reference
    assert (a.refcount(p), a.refcount(q)) == (1, 1)
    with pytest.raises(ValueError):
        a.release([7])


@pytest.mark.parametrize("args", [(0, 4), (4, 0), (-1, 4), (4, 4, -1), (True, 4)])
def test_allocator_rejects_bad_config(args):
    with pytest.raises(ValueError):
        PageAllocator(*args)


def test_stats_bytes():
    a = PageAllocator(10, 64, page_bytes=64 * 65536)  # qwen3.8-27b bf16: 4 MiB a page
    t = PageTable(a)
    t.append(130)
    t.fork()
    s = a.stats()
    assert s["pages_used"] == 3 and s["pages_free"] == 7 and s["pages_shared"] == 3
    assert s["kv_bytes_used"] == 3 * 4 * 2**20 == a.used_bytes()
    assert s["kv_bytes_total"] == 40 * 2**20
    assert a.capacity_tokens == 640


# ---- page tables -------------------------------------------------------------------------------
def test_append_grows_pages():
    a = PageAllocator(8, 4)
    t = PageTable(a)
    assert t.pages_needed(0) == 0 and t.append(0) == CopyPlan()
    plan = t.append(5)
    assert plan.copies == () and plan.allocated == (0, 1)
    assert t.pages == (0, 1) and t.num_tokens == 5
    assert t.append(3).allocated == ()  # fills page 1 in place
    assert t.append(1).allocated == (2,)


def test_fork_cow_on_shared_partial_page():
    a = PageAllocator(8, 4)
    parent = PageTable(a)
    parent.append(6)                    # pages 0, 1 (1 partial)
    child = parent.fork()
    assert child.pages == (0, 1) and a.refcount(0) == a.refcount(1) == 2
    assert child.needs_cow() and child.pages_needed(1) == 1
    plan = child.append(1)
    assert plan.copies == ((1, 2),) and plan.allocated == (2,)
    assert child.pages == (0, 2) and a.refcount(1) == 1 and a.refcount(0) == 2
    np.testing.assert_array_equal(plan.src_ids, [1])
    np.testing.assert_array_equal(plan.dst_ids, [2])
    # The parent is now page 1's only holder: it writes in place.
    assert not parent.needs_cow() and parent.append(2) == CopyPlan()


def test_fork_at_page_boundary_needs_no_copy():
    a = PageAllocator(8, 4)
    parent = PageTable(a)
    parent.append(8)
    child = parent.fork()
    plan = child.append(3)
    assert plan.copies == () and child.pages == (0, 1, 2)


def test_cow_plus_growth_in_one_append():
    a = PageAllocator(8, 4)
    parent = PageTable(a)
    parent.append(2)
    child = parent.fork()
    assert child.pages_needed(7) == 3   # COW page + 2 more
    plan = child.append(7)
    assert plan.copies == ((0, 1),) and plan.allocated == (1, 2, 3)
    assert child.pages == (1, 2, 3) and child.num_tokens == 9


def test_fork_prefix_shares_only_its_pages():
    a = PageAllocator(8, 4)
    t = PageTable(a)
    t.append(10)                        # pages 0, 1, 2
    prefix = t.fork(5)
    assert prefix.pages == (0, 1) and prefix.num_tokens == 5
    assert [a.refcount(p) for p in (0, 1, 2)] == [2, 2, 1]
    with pytest.raises(ValueError):
        t.fork(11)


def test_truncate_then_append_copies_shared_page():
    a = PageAllocator(8, 4)
    t = PageTable(a)
    t.append(8)                         # pages 0, 1 (both full)
    other = t.fork()
    t.truncate(6)                       # page 1 is partial for t, still read by `other`
    assert t.pages == (0, 1) and t.needs_cow()
    plan = t.append(1)
    assert plan.copies == ((1, 2),) and t.pages == (0, 2)
    # Rolling back past a whole page releases it; a sole holder's page is freed.
    t.truncate(3)
    assert t.pages == (0,) and a.refcount(2) == 0
    other.release()
    t.release()
    assert a.free_pages == 8


def test_append_exhaustion_changes_nothing():
    a = PageAllocator(3, 4)
    t = PageTable(a)
    t.append(6)
    u = t.fork()
    assert not u.can_append(7)          # COW page + 1 more > 1 free
    with pytest.raises(PagesExhausted):
        u.append(7)
    assert u.pages == (0, 1) and u.num_tokens == 6 and a.free_pages == 1
    assert u.can_append(2)


def test_as_row():
    a = PageAllocator(8, 4)
    t = PageTable(a)
    a.allocate(2)
    t.append(5)
    row = t.as_row(4)
    assert row.dtype == np.int32 and row.tolist() == [2, 3, 0, 0]
    assert t.as_row(3, fill=-1).tolist() == [2, 3, -1]
    with pytest.raises(ValueError):
        t.as_row(1)


def test_copy_plan_arrays_and_merge():
    plan = CopyPlan.merge([CopyPlan(((1, 5),), (5,)), CopyPlan(), CopyPlan(((2, 6),), (6, 7))])
    assert plan.copies == ((1, 5), (2, 6)) and plan.allocated == (5, 6, 7)
    src, dst = plan.arrays(pad_to=4)
    assert src.tolist() == [1, 2, 0, 0] and dst.tolist() == [5, 6, -1, -1]
    assert src.dtype == dst.dtype == np.int32
    with pytest.raises(ValueError):
        plan.arrays(pad_to=1)


# ---- stateful: every interleaving keeps the invariants -----------------------------------------
NUM_PAGES, PAGE = 10, 4


class PageMachine(RuleBasedStateMachine):
    """Tables forked, appended, truncated and released at random over a small pool, with a
    simulated device pool: writes go where the tables say, copies run as the plans say, and each
    table must read back exactly the tokens it wrote."""

    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES, PAGE, page_bytes=10)
        self.tables: list[tuple[PageTable, list[int]]] = []  # (table, tokens it should read)
        self.device: dict[int, list] = {}                      # page -> PAGE token slots
        self.values = itertools.count(1)

    def _pick(self, i):
        return self.tables[i % len(self.tables)]

    def _snapshot(self):
        return ([(t.pages, t.num_tokens) for t, _ in self.tables],
                [self.alloc.refcount(p) for p in range(NUM_PAGES)], self.alloc.free_pages)

    @precondition(lambda self: len(self.tables) < 6)
    @rule()
    def new_table(self):
        self.tables.append((PageTable(self.alloc), []))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 63), n=st.integers(0, 3 * PAGE + 1))
    def append(self, i, n):
        table, tokens = self._pick(i)
        if not table.can_append(n):
            before = self._snapshot()
            with pytest.raises(PagesExhausted):
                table.append(n)
            assert self._snapshot() == before
            return
        plan = table.append(n)
        assert len(plan.allocated) == len(set(plan.allocated))
        for src, dst in plan.copies:
            assert dst in plan.allocated and src not in table.pages
            self.device[dst] = list(self.device[src])
        for pos in range(len(tokens), len(tokens) + n):
            page = table.pages[pos // PAGE]
            # Copy-on-write: the page written is held by this table alone.
            assert self.alloc.refcount(page) == 1
            v = next(self.values)
            self.device.setdefault(page, [None] * PAGE)[pos % PAGE] = v
            tokens.append(v)

    @precondition(lambda self: self.tables and len(self.tables) < 6)
    @rule(i=st.integers(0, 63), at=st.integers(0, 1000))
    def fork(self, i, at):
        table, tokens = self._pick(i)
        n = at % (table.num_tokens + 1)
        self.tables.append((table.fork(n), tokens[:n]))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 63), at=st.integers(0, 1000))
    def truncate(self, i, at):
        table, tokens = self._pick(i)
        n = at % (table.num_tokens + 1)
        table.truncate(n)
        del tokens[n:]

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 63))
    def release(self, i):
        table, _ = self.tables.pop(i % len(self.tables))
        table.release()
        assert table.pages == () and table.num_tokens == 0

    @invariant()
    def refcounts_match_holders(self):
        holders = Counter()
        for table, tokens in self.tables:
            assert len(table.pages) == len(set(table.pages)) == pages_for(len(tokens), PAGE)
            assert table.num_tokens == len(tokens)
            holders.update(table.pages)
        for p in range(NUM_PAGES):
            assert self.alloc.refcount(p) == holders[p]

    @invariant()
    def free_list_is_exactly_the_unreferenced_pages(self):
        free = self.alloc._free  # the free list itself is the subject of this invariant
        assert len(free) == len(set(free))
        assert set(free) == {p for p in range(NUM_PAGES) if self.alloc.refcount(p) == 0}
        assert self.alloc.used_pages + self.alloc.free_pages == NUM_PAGES
        assert self.alloc.stats()["kv_bytes_used"] == 10 * self.alloc.used_pages

    @invariant()
    def every_table_reads_what_it_wrote(self):
        for table, tokens in self.tables:
            got = [self.device[table.pages[s // PAGE]][s % PAGE] for s in range(len(tokens))]
            assert got == tokens
            row = table.as_row(NUM_PAGES, fill=-1)
            assert row[:len(table.pages)].tolist() == list(table.pages)
            assert (row[len(table.pages):] == -1).all()

    def teardown(self):
        for table, _ in self.tables:
            table.release()
        assert self.alloc.free_pages == NUM_PAGES
        assert all(self.alloc.refcount(p) == 0 for p in range(NUM_PAGES))
        assert sorted(self.alloc.allocate(NUM_PAGES)) == list(range(NUM_PAGES))


TestPageMachine = PageMachine.TestCase
TestPageMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                    database=None,
                                    suppress_health_check=[HealthCheck.too_slow])
