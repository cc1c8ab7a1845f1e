"""Recurrent-state images: exact snapshots, bounded tiers, eviction order, the evict hook, pins
(engine/runtime/states.py), and the retention rule (engine/runtime/memory.py)."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.model.config import QWEN38_27B, TEST_SMALL
from engine.runtime import state_copy
from engine.runtime.memory import BASE_WEIGHT, Role, retention_score, retention_weight
from engine.runtime.states import StatePool, StatePoolError, Tier, state_image_bytes

CFG = TEST_SMALL
BATCH = 4
CONV_SHAPE = (CFG.num_blocks, CFG.gdn_per_block, BATCH, CFG.conv_dim, CFG.linear_conv_kernel - 1)
REC_SHAPE = (CFG.num_blocks, CFG.gdn_per_block, BATCH, CFG.linear_num_value_heads,
             CFG.linear_key_head_dim, CFG.linear_value_head_dim)
IMG = state_image_bytes(CFG, 4)


def random_bits(shape, dtype, seed):
    """Arbitrary bit patterns (NaN payloads, -0.0, subnormals): a copy must keep every bit."""
    dt = np.dtype(jnp.dtype(dtype))
    uint = {2: np.uint16, 4: np.uint32}[dt.itemsize]
    bits = np.random.default_rng(seed).integers(0, np.iinfo(uint).max, shape, dtype=uint,
                                                endpoint=True)
    return bits.view(dt)


def make_cache(seed, conv_dtype=jnp.float32):
    conv = random_bits(CONV_SHAPE, conv_dtype, seed)
    rec = random_bits(REC_SHAPE, jnp.float32, seed + 1000)
    return jnp.asarray(conv), jnp.asarray(rec), conv, rec


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def pool(device_slots=2, host_images=2, **kw) -> StatePool:
    return StatePool(CFG, device_slots, host_images * IMG, **kw)


CACHE = make_cache(0)


def store(p, key, weight=1.0, row=0):
    return p.store(CACHE[0], CACHE[1], row, key=key, num_tokens=10, weight=weight)


# ---- sizes -------------------------------------------------------------------------------------
def test_image_bytes():
    # 48 GDN layers x (48*128*128 fp32 + 10240*3 bf16), see REFERENCE.md section 2.
    assert state_image_bytes(QWEN38_27B, 2) == 48 * (48 * 128 * 128 * 4 + 10240 * 3 * 2)
    row_bytes = (math.prod(CONV_SHAPE) + math.prod(REC_SHAPE)) * 4 // BATCH
    assert pool().image_bytes == IMG == row_bytes


# ---- exactness ---------------------------------------------------------------------------------
@pytest.mark.parametrize("conv_dtype", [jnp.float32, jnp.bfloat16])
def test_snapshot_restore_bit_exact_through_host(conv_dtype):
    conv, rec, conv_np, rec_np = make_cache(7, conv_dtype)
    p = StatePool(CFG, 2, 4 * state_image_bytes(CFG, jnp.dtype(conv_dtype).itemsize),
                  conv_dtype=conv_dtype)
    images = [p.store(conv, rec, r, key=f"r{r}", num_tokens=r, weight=1.0) for r in range(BATCH)]
    assert [im.tier for im in images] == [Tier.HOST, Tier.HOST, Tier.DEVICE, Tier.DEVICE]
    for r, im in enumerate(images):
        host_conv, host_rec = p.read(im)
        assert same_bits(host_conv, conv_np[:, :, r]) and same_bits(host_rec, rec_np[:, :, r])
        if im.tier is Tier.HOST:
            p.fetch(im)
        c, h = p.restore(im)
        assert same_bits(c, conv_np[:, :, r]) and same_bits(h, rec_np[:, :, r])
    # Restored into a different row of another cache; the other rows stay as they were.
    if images[0].tier is Tier.HOST:
        p.fetch(images[0])
    target_conv, target_rec, tc_np, tr_np = make_cache(99, conv_dtype)
    new_conv, new_rec = p.restore_into(target_conv, target_rec, 1, images[0])
    expect_conv, expect_rec = tc_np.copy(), tr_np.copy()
    expect_conv[:, :, 1], expect_rec[:, :, 1] = conv_np[:, :, 0], rec_np[:, :, 0]
    assert same_bits(new_conv, expect_conv) and same_bits(new_rec, expect_rec)
    # The two-step form gives the same cache.
    c, h = p.restore(images[0])
    t2 = make_cache(99, conv_dtype)
    w_conv, w_rec = state_copy.write_row(t2[0], t2[1], np.int32(1), c, h)
    assert same_bits(w_conv, expect_conv) and same_bits(w_rec, expect_rec)


def test_snapshot_is_a_copy_not_a_view():
    conv, rec, conv_np, rec_np = make_cache(3)
    p = pool()
    im = p.store(conv, rec, 2, key="k", num_tokens=1, weight=1.0)
    zero_conv = jnp.zeros(CONV_SHAPE[:2] + CONV_SHAPE[3:])
    zero_rec = jnp.zeros(REC_SHAPE[:2] + REC_SHAPE[3:])
    conv, rec = state_copy.write_row(conv, rec, np.int32(2), zero_conv, zero_rec)
    c, h = p.restore(im)
    assert same_bits(c, conv_np[:, :, 2]) and same_bits(h, rec_np[:, :, 2])


# ---- eviction ----------------------------------------------------------------------------------
def test_eviction_spills_lowest_weight_then_lru():
    dropped = []
    p = pool(2, 2, on_evict=lambda im: dropped.append(im.key))
    a, b = store(p, "a", 1.0), store(p, "b", 1.0)
    p.touch(a)                                    # equal weights: b is now least recently used
    c = store(p, "c", 5.0)
    assert (a.tier, b.tier, c.tier) == (Tier.DEVICE, Tier.HOST, Tier.DEVICE)
    d = store(p, "d", 3.0)                        # device {a:1, c:5}: a goes to the host
    assert a.tier is Tier.HOST and d.tier is Tier.DEVICE
    e = store(p, "e", 4.0)                        # device {c:5, d:3}: d down; host full of 1s:
    assert d.tier is Tier.HOST and e.tier is Tier.DEVICE    # the LRU one (b) is dropped
    assert b.tier is Tier.DROPPED and dropped == ["b"]
    assert {im.key for im in p.images(Tier.HOST)} == {"a", "d"}
    assert p.lookup("b") is None and p.lookup("d") is d


def test_device_victim_below_every_host_image_is_dropped_not_spilled():
    dropped = []
    p = pool(1, 1, on_evict=lambda im: dropped.append(im.key))
    h = store(p, "h", 5.0)
    low = store(p, "low", 1.0)                    # h (5) spills to the host
    assert h.tier is Tier.HOST
    store(p, "new", 2.0)                          # low (1) < h (5): low is dropped, h stays
    assert low.tier is Tier.DROPPED and h.tier is Tier.HOST and dropped == ["low"]


def test_no_host_tier_drops_directly():
    dropped = []
    p = StatePool(CFG, 1, IMG - 1, on_evict=lambda im: dropped.append(im.key))
    assert p.host_capacity == 0
    a = store(p, "a")
    assert not p.can_spill(a)
    store(p, "b")
    assert a.tier is Tier.DROPPED and dropped == ["a"] and p.host_bytes == 0


def test_hook_runs_once_before_the_image_is_gone():
    _, _, conv_np, rec_np = CACHE
    seen = []

    def on_evict(im):
        assert im.tier is not Tier.DROPPED and p.lookup(im.key) is im
        c, h = p.read(im)                         # still readable: a checkpointer saves it here
        exact = same_bits(c, conv_np[:, :, 3]) and same_bits(h, rec_np[:, :, 3])
        seen.append((im.key, im.tier, exact))

    p = pool(1, 1, on_evict=on_evict)
    a = store(p, "a", 1.0, row=3)
    store(p, "b", 2.0)                            # a -> host
    store(p, "c", 3.0)                            # b -> host displaces a: hook(a) on the host
    assert seen == [("a", Tier.HOST, True)] and a.tier is Tier.DROPPED
    p = pool(1, 0, on_evict=on_evict)
    store(p, "x", 1.0, row=3)
    store(p, "y", 1.0)                            # no host: hook(x) while still on the device
    assert seen[-1] == ("x", Tier.DEVICE, True) and len(seen) == 2
    assert p.stats()["evictions"] == 1


def test_hook_failure_or_mutation_leaves_pool_unchanged():
    def on_evict(im):
        p.drop(im)                                # not allowed from the hook

    p = pool(1, 0, on_evict=on_evict)
    a = store(p, "a")
    with pytest.raises(StatePoolError, match="on_evict"):
        store(p, "b")
    assert a.tier is Tier.DEVICE and p.lookup("b") is None and p.stats()["device_images"] == 1
    p.on_evict = None
    store(p, "b")
    assert a.tier is Tier.DROPPED


def test_pinned_images_are_never_evicted():
    dropped = []
    p = pool(2, 1, on_evict=lambda im: dropped.append(im.key))
    a, b = store(p, "a", 0.0), store(p, "b", 0.0)
    p.pin(a)
    p.pin(b)
    assert not p.can_store() and not p.can_spill(a)
    with pytest.raises(StatePoolError):
        store(p, "c")
    with pytest.raises(StatePoolError):
        p.spill(a)
    with pytest.raises(StatePoolError):
        p.drop(a)
    p.unpin(b)
    c = store(p, "c", 9.0)                        # b (unpinned) makes room, a stays
    assert a.tier is Tier.DEVICE and b.tier is Tier.HOST and c.tier is Tier.DEVICE
    p.pin(b)                                      # a pinned host image is not displaced either:
    p.unpin(a)
    store(p, "d", 9.0)                            # a must go down, host holds pinned b: a dropped
    assert b.tier is Tier.HOST and a.tier is Tier.DROPPED and dropped == ["a"]
    with pytest.raises(StatePoolError):
        p.unpin(a)


def test_fetch_swaps_with_a_device_victim():
    dropped = []
    p = pool(1, 1, on_evict=lambda im: dropped.append(im.key))
    a = store(p, "a", 9.0, row=1)
    b = store(p, "b", 1.0, row=2)                 # a -> host
    assert p.can_fetch(a) and not p.can_fetch(b)
    p.fetch(a)                                    # b goes to the host in a's place
    assert (a.tier, b.tier, dropped) == (Tier.DEVICE, Tier.HOST, [])
    c, h = p.restore(a)
    assert same_bits(c, CACHE[2][:, :, 1]) and same_bits(h, CACHE[3][:, :, 1])
    with pytest.raises(StatePoolError):
        p.restore(b)                              # on the host: fetch first
    assert p.stats()["fetches"] == 1 and p.stats()["spills"] == 2


def test_explicit_spill_and_drop():
    dropped = []
    p = pool(2, 1, on_evict=lambda im: dropped.append(im.key))
    a, b = store(p, "a", 1.0), store(p, "b", 2.0)
    p.spill(a)
    assert a.tier is Tier.HOST and p.stats()["device_images"] == 1
    assert p.can_spill(b)                         # b (2) outranks a (1) on a full host
    p.spill(b)
    assert a.tier is Tier.DROPPED and dropped == ["a"]
    p.drop(b)                                     # the owner's decision: no hook
    assert b.tier is Tier.DROPPED and dropped == ["a"] and p.stats()["drops"] == 1
    store(p, "b")                                 # a dropped key may be stored again
    with pytest.raises(StatePoolError):
        p.drop(a)


def test_store_validation():
    p = pool()
    store(p, "a")
    with pytest.raises(StatePoolError):
        store(p, "a")
    with pytest.raises(ValueError):
        p.store(CACHE[0], CACHE[1], BATCH, key="x", num_tokens=1, weight=1.0)
    with pytest.raises(ValueError):
        p.store(CACHE[0][:, :, :2], CACHE[1], 0, key="x", num_tokens=1, weight=1.0)
    with pytest.raises(ValueError):
        p.store(CACHE[0].astype(jnp.bfloat16), CACHE[1], 0, key="x", num_tokens=1, weight=1.0)
    with pytest.raises(ValueError):
        StatePool(CFG, 0, 0)
    with pytest.raises(ValueError):
        StatePool(CFG, 1, -1)


def test_stats_accounting():
    p = pool(2, 3)
    for i, w in enumerate([1.0, 2.0, 3.0, 4.0]):
        store(p, f"k{i}", w)
    p.pin(p.lookup("k3"))
    s = p.stats()
    assert s["device_images"] == 2 and s["host_images"] == 2
    assert s["device_bytes"] == 2 * IMG == p.device_bytes
    assert s["host_bytes"] == 2 * IMG == p.host_bytes and s["host_bytes_limit"] == 3 * IMG
    assert s["device_reserved_bytes"] == 2 * IMG and s["image_bytes"] == IMG
    assert s["pinned_images"] == 1 and s["stores"] == 4 and s["spills"] == 2


# ---- stateful: bounds, hook and contents under random use --------------------------------------
class StateMachine(RuleBasedStateMachine):
    SLOTS, HOST = 3, 2

    def __init__(self):
        super().__init__()
        self.evicted: list[str] = []
        self.pool = StatePool(CFG, self.SLOTS, self.HOST * IMG + IMG // 2, on_evict=self._hook)
        self.live: dict[str, tuple] = {}          # key -> (image, row it was taken from)
        self.n = 0

    def _hook(self, im):
        assert im.tier is not Tier.DROPPED and not im.pinned and im.key in self.live
        self.evicted.append(im.key)

    def _pick(self, i):
        keys = sorted(self.live)
        return self.live[keys[i % len(keys)]]

    def _sync(self):
        for key in [k for k, (im, _) in self.live.items() if im.tier is Tier.DROPPED]:
            del self.live[key]

    @rule(weight=st.sampled_from([0.0, 1.0, 2.0]), row=st.integers(0, BATCH - 1))
    def store(self, weight, row):
        before = len(self.evicted)
        if not self.pool.can_store():
            with pytest.raises(StatePoolError):
                store(self.pool, "never", weight, row)
            return
        self.n += 1
        im = store(self.pool, f"s{self.n}", weight, row)
        self.live[im.key] = (im, row)
        assert len(self.evicted) - before <= 1
        self._sync()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def spill_or_fetch(self, i):
        im, _ = self._pick(i)
        if im.tier is Tier.DEVICE and self.pool.can_spill(im):
            self.pool.spill(im)
            assert im.tier is Tier.HOST
        elif im.tier is Tier.HOST and self.pool.can_fetch(im):
            self.pool.fetch(im)
            assert im.tier is Tier.DEVICE
        self._sync()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def toggle_pin(self, i):
        im, _ = self._pick(i)
        self.pool.unpin(im) if im.pinned else self.pool.pin(im)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def drop(self, i):
        im, _ = self._pick(i)
        if im.pinned:
            with pytest.raises(StatePoolError):
                self.pool.drop(im)
        else:
            self.pool.drop(im)
            del self.live[im.key]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def contents_are_exact(self, i):
        im, row = self._pick(i)
        c, h = self.pool.read(im)
        assert same_bits(c, CACHE[2][:, :, row]) and same_bits(h, CACHE[3][:, :, row])

    @invariant()
    def bounds_and_tiers(self):
        s = self.pool.stats()
        assert s["device_images"] <= self.SLOTS and s["host_bytes"] <= s["host_bytes_limit"]
        assert s["host_images"] <= self.HOST
        tiers = [im.tier for im, _ in self.live.values()]
        assert tiers.count(Tier.DEVICE) == s["device_images"]
        assert tiers.count(Tier.HOST) == s["host_images"]
        slots = [im.slot for im, _ in self.live.values() if im.tier is Tier.DEVICE]
        assert len(set(slots)) == len(slots)
        assert all(self.pool.lookup(k) is im for k, (im, _) in self.live.items())

    @invariant()
    def hook_once_per_evicted_image(self):
        assert len(self.evicted) == len(set(self.evicted)) == self.pool.stats()["evictions"]
        assert not set(self.evicted) & set(self.live)


TestStateMachine = StateMachine.TestCase
TestStateMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None,
                                     database=None, suppress_health_check=[HealthCheck.too_slow])


# ---- retention ---------------------------------------------------------------------------------
def test_retention_order_at_equal_idle():
    for idle in (0.0, 60.0, 3600.0):
        w = {r: retention_weight(r, idle) for r in Role}
        assert (w[Role.SESSION_HEAD] > w[Role.SHARED_PREFIX] > w[Role.SESSION_HISTORY]
                > w[Role.FORK] == w[Role.ONE_OFF] > 0)


def test_retention_decays_with_idle_time():
    assert retention_weight(Role.SESSION_HEAD, 0.0) == BASE_WEIGHT[Role.SESSION_HEAD]
    assert retention_weight(Role.SESSION_HEAD, 100.0, half_life_s=100.0) == 4.0
    # An abandoned head falls to a fresh one-off's rank after three half-lives.
    assert retention_weight(Role.SESSION_HEAD, 300.0, half_life_s=100.0) == \
        retention_weight(Role.ONE_OFF, 0.0)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            retention_weight(Role.FORK, bad)
    with pytest.raises(ValueError):
        retention_weight(Role.FORK, 1.0, half_life_s=0.0)


@settings(max_examples=200, deadline=None, database=None)
@given(ra=st.sampled_from(list(Role)), rb=st.sampled_from(list(Role)),
       ta=st.floats(0, 1e5), tb=st.floats(0, 1e5), later=st.floats(0, 1e5))
def test_retention_score_orders_like_weight_at_any_time(ra, rb, ta, tb, later):
    now = max(ta, tb) + later
    wa, wb = retention_weight(ra, now - ta), retention_weight(rb, now - tb)
    sa, sb = retention_score(ra, ta), retention_score(rb, tb)
    if not math.isclose(wa, wb, rel_tol=1e-9):
        assert (wa < wb) == (sa < sb)


def test_warm_books_nothing_and_leaves_the_pool_working():
    """StatePool.warm runs the copies once (for their compiles) and books nothing: no image,
    no count; the cache's other rows keep their bits; with an image stored it does nothing."""
    p = pool()
    conv, rec, conv_np, rec_np = make_cache(5)
    before = p.stats()
    conv, rec = p.warm(conv, rec)
    assert p.stats() == before and p.images() == []
    # rows other than 0 untouched
    assert same_bits(np.asarray(conv)[:, :, 1:], conv_np[:, :, 1:])
    assert same_bits(np.asarray(rec)[:, :, 1:], rec_np[:, :, 1:])
    a = store(p, "a")
    assert same_bits(p.read(a)[1], CACHE[3][:, :, 0])  # slot 0 holds what was stored
    c2, r2 = p.warm(conv, rec)  # an image stored: nothing is touched
    assert c2 is conv and r2 is rec and same_bits(p.read(a)[1], CACHE[3][:, :, 0])
