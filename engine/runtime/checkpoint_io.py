"""A stored state (Snapshot) out of the runtime and back in, bit for bit.

Both directions run on the engine thread: it owns the device pool, whose arrays are donated at
every step, so no other thread may read them. Everything else (hashing, files) happens elsewhere.

An export is the snapshot's tokens, its recurrent-state image (host copies of conv and rec) and
its KV pages as raw bytes. A page's bytes are, for each pool array in the order k, v[, k_scale,
v_scale], that array's [L, page_size, ...] slice of the page, C order. Slots past the state's
last token (the tail of a partial last page) are written as zeros: they are masked by position,
and zeroing them makes the bytes a function of the state alone, so pages are content-addressed.

Import without extra copies: `StagedPages` holds, per pool array, one host array [n_pages, L,
page_size, ...] (page-major, so every page's slice of it is contiguous). The checkpoint store
reads each page file straight into its slices (`StagedPages.layout`, one readv per page), or
`stage_pages` copies pages given as buffers into it once; either happens off the engine thread.
The host-to-device transfer runs off the engine thread too, run by run (RUN_PAGES pages, then
power-of-two runs: few compiled shapes, no padding pages to build, transfer or drop): the store
reports each verified page (`StagedPages.page_ready`) and a run's transfer starts with its last
page, while later pages are still being read; `StagedPages.to_device` starts any run not yet
started. The engine thread then only scatters.

Full pages are immutable while any table holds them (writers copy a shared page first and never
write below their own length), so a full page's digest stays valid as long as a live snapshot
that was exported holds it: `PageDigests` remembers those and an export skips reading them.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from engine.runtime.pages import PageTable, pages_for
from engine.runtime.memory import Role, Snapshot, retention_score, token_key


@dataclass(eq=False)
class SnapshotExport:
    """What a checkpoint needs of one stored state. `pages[i]` is None when `digests[i]` was
    already known (the page is on disk); the saver fills in the other digests after hashing."""
    principal: str
    session: str | None
    tokens: np.ndarray               # int32 [n]
    page_size: int
    pages: list                      # one buffer (or None) per page, pages_for(n, page_size)
    digests: list[str | None]
    conv: np.ndarray                 # [nb, G, C, K-1] conv dtype
    rec: np.ndarray                  # [nb, G, Hv, Dk, Dv] fp32

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class _Known:
    owner: Snapshot
    export: SnapshotExport
    index: int


@dataclass
class PageDigests:
    """Device page id -> the export that hashed it, valid while that snapshot is live."""
    by_page: dict[int, _Known] = field(default_factory=dict)

    def lookup(self, mem, page_id: int) -> str | None:
        k = self.by_page.get(page_id)
        if k is None:
            return None
        live = mem._by_key.get(k.owner.key) is k.owner and k.owner.pages is not None
        if not live or page_id not in k.owner.pages.pages:
            del self.by_page[page_id]
            return None
        return k.export.digests[k.index]

    def remember(self, snap: Snapshot, export: SnapshotExport) -> None:
        for i, pid in enumerate(snap.pages.pages):
            if (i + 1) * export.page_size <= export.num_tokens:  # full pages only
                self.by_page[pid] = _Known(snap, export, i)


def page_spec(pool) -> list[tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each array's slice of one page: [L, page_size, ...]."""
    out = []
    for a in _arrays(pool):
        out.append(((a.shape[0],) + tuple(a.shape[2:]), np.dtype(a.dtype)))
    return out


def page_nbytes(pool) -> int:
    return sum(int(np.prod(s)) * d.itemsize for s, d in page_spec(pool))


def _arrays(pool):
    return [a for a in (pool.k, pool.v, pool.k_scale, pool.v_scale) if a is not None]


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())  # pad page lists to powers of two: few compiles


RUN_PAGES = 128  # the longest run: its transfer starts as soon as its pages are verified


def _chunks(n: int, longest: int = RUN_PAGES) -> list[tuple[int, int]]:
    """[start, stop) runs covering n pages: runs of `longest` (a power of two, at most
    RUN_PAGES), then the rest in power-of-two runs, largest first (a few compiled scatter
    shapes, no padding pages)."""
    out, start = [], 0
    while n - start >= longest:
        out.append((start, start + longest))
        start += longest
    rest = n - start
    for bit in reversed(range(max(rest, 1).bit_length())):
        if rest & (1 << bit):
            out.append((start, start + (1 << bit)))
            start += 1 << bit
    return out


@jax.jit
def _gather(arrays, ids):
    # page-major on the device: each page's slice of each array arrives contiguous
    return [jnp.moveaxis(a[:, ids], 1, 0) for a in arrays]


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(arrays, ids, data):
    # data: page-major [pages, L, page_size, ...] per array, as StagedPages holds it
    return [a.at[:, ids].set(jnp.moveaxis(d, 0, 1)) for a, d in zip(arrays, data)]


class StagedPages:
    """Host buffers for n pages in the scatter's layout: per pool array, [n, L, page_size,
    ...] C order. `views(i)` are page i's slices in page-byte order (k, v[, k_scale,
    v_scale]): concatenated they are exactly the page's bytes."""

    def __init__(self, spec, n: int, alloc=None):
        """`alloc(nbytes)`: a 1-D uint8 array for each pool array's bytes (default np.empty;
        the checkpoint store passes its page-aligned allocator, so its reads can be direct)."""
        self.spec, self.n = spec, n
        self.page_bytes = sum(int(np.prod(s)) * d.itemsize for s, d in spec)
        alloc = alloc or (lambda k: np.empty(k, np.uint8))
        # raw bytes (a dtype such as bfloat16 may not export a buffer): typed views below
        rows = [int(np.prod(s)) * d.itemsize for s, d in spec]
        self._raw = [alloc(n * row).reshape(n, row) for row in rows]
        self.arrays = [r.view(d).reshape((n,) + tuple(s)) for r, (s, d) in zip(self._raw, spec)]
        self.runs = _chunks(n)
        self.device_chunks = None  # per run: its arrays on the device (to_device)
        self._started: list = [None] * len(self.runs)  # per run: its arrays, once put
        self._left = [stop - start for start, stop in self.runs]  # pages not verified yet
        self._run_of = np.repeat(np.arange(len(self.runs)), self._left)
        self._mu = threading.Lock()

    def views(self, i: int) -> list[memoryview]:
        return [memoryview(r[i]) for r in self._raw]

    def _put(self, k: int) -> None:
        start, stop = self.runs[k]
        self._started[k] = [jax.device_put(a[start:stop]) for a in self.arrays]

    def page_ready(self, i: int) -> None:
        """Page i's bytes are in and verified (any thread): the last page of a run starts that
        run's host-to-device transfer, so the transfers overlap the reading of later pages.
        Nothing reaches the pool before `import_snapshot`, which the store's caller reaches
        only when every page verified; a failed load just drops the transferred runs."""
        k = int(self._run_of[i])
        with self._mu:
            self._left[k] -= 1
            full = self._left[k] == 0
        if full:
            try:
                self._put(k)
            except Exception:  # noqa: BLE001 - to_device puts the run again and raises there
                self._started[k] = None

    def to_device(self) -> "StagedPages":
        """Start the host-to-device transfer of every run not started by `page_ready` (any
        thread: the pool is not touched), so the engine thread only scatters."""
        for k in range(len(self.runs)):
            if self._started[k] is None:
                self._put(k)
        self.device_chunks = list(self._started)
        return self

    @classmethod
    def layout(cls, spec, alloc=None):
        """For CheckpointStore.load(page_layout=...): (staged, per-page views) for n pages of
        `page_bytes`, or None when that is not this runtime's page size; `alloc` as in
        __init__."""
        def make(n: int, page_bytes: int):
            if page_bytes != sum(int(np.prod(s)) * d.itemsize for s, d in spec):
                return None
            staged = cls(spec, n, alloc)
            return staged, [staged.views(i) for i in range(n)]
        return make


def stage_pages(spec, pages) -> StagedPages:
    """Pages given as buffers (bytes, memoryviews), copied once into a StagedPages."""
    staged = StagedPages(spec, len(pages))
    for i, data in enumerate(pages):
        src = memoryview(data).cast("B")
        if src.nbytes != staged.page_bytes:
            raise ValueError(f"page of {src.nbytes} bytes, the pool's pages have "
                             f"{staged.page_bytes}")
        off = 0
        for dst in staged.views(i):
            dst[:] = src[off:off + dst.nbytes]
            off += dst.nbytes
    return staged


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def prepare_restore(mem) -> int:
    """Compile ahead of time, without running anything, what a process's first restore would
    otherwise compile on its way to the first token: the page scatter for every run length
    `_chunks` makes, the state image's write into a slot, its copy into a batch row, and a
    one-page copy-on-write (a continued session's partial last page). On a CPU they were
    ~0.9 s of the first restore's 1.2 s TTFT (tiny model); from JAX's persistent cache after
    the first process each is a trace and a load. Reads only shapes: any thread. Returns how
    many executables it prepared."""
    from engine.ops import paged_kv as pk
    import engine.runtime.state_copy as sc

    arrays = [_abstract(a) for a in _arrays(mem.cache.pool)]
    spec = page_spec(mem.cache.pool)
    runs = sorted({stop - start for start, stop in _chunks(2 * RUN_PAGES - 1)})
    done = 0
    for r in runs:  # RUN_PAGES and every power of two below it
        data = [jax.ShapeDtypeStruct((r,) + tuple(shape), dtype) for shape, dtype in spec]
        _scatter.lower(arrays, _i32(r), data).compile()
        done += 1
    st = mem.states
    slots = (_abstract(st._conv), _abstract(st._rec))
    image = (jax.ShapeDtypeStruct(st.conv_shape, st.conv_dtype),
             jax.ShapeDtypeStruct(st.rec_shape, jnp.float32))
    sc.write_slot.lower(*slots, *image, _i32()).compile()
    sc.restore_to_row.lower(*slots, _abstract(mem.cache.conv), _abstract(mem.cache.rec),
                            _i32(), _i32()).compile()
    pk.copy_pages.lower(jax.tree.map(_abstract, mem.cache.pool), _i32(1), _i32(1)).compile()
    return done + 3


def _replace_arrays(pool, arrays):
    names = [n for n in ("k", "v", "k_scale", "v_scale") if getattr(pool, n) is not None]
    return pool._replace(**dict(zip(names, arrays)))


def export_snapshot(mem, snap: Snapshot, digests: PageDigests | None = None,
                    session: str | None = None) -> SnapshotExport:
    """Host copies of `snap`'s state and of the pages whose digest is not known yet."""
    n, ps = snap.num_tokens, mem.page_size
    ids = list(snap.pages.pages)[:pages_for(n, ps)]
    known = [digests.lookup(mem, p) if digests is not None and (i + 1) * ps <= n else None
             for i, p in enumerate(ids)]
    need = [i for i, d in enumerate(known) if d is None]
    pages: list[bytes | None] = [None] * len(ids)
    if need:
        sel = np.zeros((_bucket(len(need)),), np.int32)
        sel[:len(need)] = [ids[i] for i in need]
        got = [np.asarray(x)[:len(need)] for x in jax.device_get(
            _gather(_arrays(mem.cache.pool), jnp.asarray(sel)))]  # [pages, L, page_size, ...]
        # one buffer, one row per page: each array's page-major block copied in once (no
        # per-page tobytes or join); the tail of a partial last page zeroed in place
        packed = np.empty((len(need), sum(a[0].nbytes for a in got)), np.uint8)
        off = 0
        for a in got:
            size = a[0].nbytes
            dst = packed[:, off:off + size]
            dst[...] = np.ascontiguousarray(a).reshape(len(need), -1).view(np.uint8)
            used = n - need[-1] * ps
            if used < ps:  # only the state's last page can be partial
                tail = dst[-1].view(a.dtype).reshape(a.shape[1:])
                tail[:, used:] = 0
            off += size
        for j, i in enumerate(need):
            pages[i] = memoryview(packed[j])
    conv, rec = mem.states.read(snap.image)
    exp = SnapshotExport(snap.principal, session if session is not None else snap.session,
                         np.array(snap.tokens, np.int32), ps, pages, known, conv, rec)
    if digests is not None:
        digests.remember(snap, exp)
    return exp


def split_page(pool, data: bytes) -> list[np.ndarray]:
    """A page's bytes back into its arrays' [L, page_size, ...] slices; ValueError on size."""
    spec = page_spec(pool)
    if len(data) != sum(int(np.prod(s)) * d.itemsize for s, d in spec):
        raise ValueError(f"page of {len(data)} bytes, the pool's pages have "
                         f"{page_nbytes(pool)}")
    out, off = [], 0
    for shape, dt in spec:
        size = int(np.prod(shape)) * dt.itemsize
        out.append(np.frombuffer(data, dt, count=int(np.prod(shape)), offset=off).reshape(shape))
        off += size
    return out


def import_snapshot(mem, principal: str, session: str | None, tokens, pages,
                    conv: np.ndarray, rec: np.ndarray, digests: PageDigests | None = None,
                    page_digests: list[str] | None = None) -> Snapshot | None:
    """Install a state read from disk as a stored snapshot of `principal`; the next request
    whose prompt extends `tokens` continues from it (path "disk-restored"). `pages`: a
    StagedPages (staged off the engine thread; no host copy here), a staging.StreamedPages
    (its pages already in the pool pages it reserved; this takes them over) or a list of page
    buffers. Returns None when the runtime has no room (pages or state slots held by running
    sequences)."""
    tokens = np.asarray(tokens, np.int32)
    n = int(tokens.shape[0])
    listed = isinstance(pages, (list, tuple))  # else a StagedPages or a staging.StreamedPages
    n_pages = len(pages) if listed else pages.n
    if n_pages != pages_for(n, mem.page_size) or n == 0:
        raise ValueError(f"{n_pages} pages for {n} tokens")
    # pages a streamed restore already scattered into fresh pool pages (staging.py): its
    # reserved table becomes the snapshot's, or goes back if the state is not installed
    reserved = None if listed else getattr(pages, "reservation", None)
    existing = mem.index.get(principal, token_key(principal, tokens))
    if reserved is not None and not reserved.live:
        raise ValueError("the restore's reserved pages went back before its install")
    if existing is not None or (reserved is not None and not mem.states.can_store()):
        if reserved is not None:
            reserved.live = False
            reserved.table.release()
        return existing
    if reserved is not None:
        reserved.live = False  # the snapshot holds the table now
        table = reserved.table
        table.truncate(n)  # it holds exactly pages_for(n) pages: this only sets the length
        try:
            return _install(mem, principal, session, tokens, table, conv, rec, digests,
                            page_digests)
        except Exception:
            table.release()
            raise
    spec = page_spec(mem.cache.pool)
    staged = stage_pages(spec, pages) if listed else pages
    if [(tuple(s), d.itemsize) for s, d in staged.spec] != [(tuple(s), d.itemsize)
                                                             for s, d in spec]:
        raise ValueError("staged pages do not match the pool's page layout")
    while not mem.alloc.can_allocate(n_pages):
        if not mem._evict_one():
            return None
    if not mem.states.can_store():
        return None
    table = PageTable(mem.alloc)
    table.append(n)  # fresh pages, no copies: the table was empty
    page_ids = np.asarray(table.pages, np.int32)
    arrays = _arrays(mem.cache.pool)
    for k, (start, stop) in enumerate(staged.runs):  # few compiled shapes, no padding
        data = (staged.device_chunks[k] if staged.device_chunks is not None
                else [jax.device_put(a[start:stop]) for a in staged.arrays])
        # device_put, not jnp.asarray: that compiles a staging computation a shape
        arrays = _scatter(arrays, jax.device_put(page_ids[start:stop]), data)
    mem.cache = mem.cache._replace(pool=_replace_arrays(mem.cache.pool, arrays))
    return _install(mem, principal, session, tokens, table, conv, rec, digests, page_digests)


def _install(mem, principal, session, tokens, table, conv, rec, digests, page_digests):
    n = int(tokens.shape[0])
    snap = Snapshot(principal, tokens, "response", session=session)
    snap.from_disk = True
    snap.image = mem.states.load(conv, rec, key=snap.key, num_tokens=n,
                                 weight=retention_score(Role.SESSION_HEAD, _now()))
    snap.pages = table
    mem.install(snap)
    if digests is not None and page_digests is not None:
        exp = SnapshotExport(principal, session, tokens, mem.page_size,
                             [None] * len(table.pages), list(page_digests), conv, rec)
        digests.remember(snap, exp)
    return snap


def _now() -> float:
    import time

    return time.time()
