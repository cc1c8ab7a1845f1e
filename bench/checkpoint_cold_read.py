r"""A large checkpoint restored cold, beside raw O_DIRECT reads of the very same files (the
sessions issue's part 4): no server, no model.

    .venv/bin/python bench/checkpoint_cold_read.py --dir /tmp/ckcold --pages 1920 \
        --out docs/benchmarks/checkpoint_cold_read.json        # 8.2 GB: 1,920 x 4 MiB + 154 MB

Builds one session in a real `CheckpointStore` (4 MiB pages, the 27B's page size, plus its
153,944,064-byte recurrent-state image), saved in steps of --chunk pages so that the bench never
holds more than one step's pages (each save after the first names the pages already on disk by
digest, as the server's incremental saves do). Then, --reps times, in this order, each with the
store's files dropped from the page cache first (fsync'd files, posix_fadvise(DONTNEED)):

- `load`: `CheckpointStore.load` with full verification (the manifest's tag, every page's and
  the image's sha256), into fresh buffers, as a restore after a restart does;
- `stream`: the same load as the server restores with the lane's `checkpoint_staging_bytes`
  (--staging, the h200 lane's 1 GiB by default): the pages read straight into the slots of a
  staging arena faulted in once before the first rep (its fault-in time is reported apart),
  laid out as the 27B's pool (k and v, 2 MiB a page each), each run of verified pages copied
  to the device (here the CPU backend: a host copy) before its slot is reused;
- `stream_host`: `stream` up to the device copy (each run's transfer left out, its slot
  freed at once): the host side of a GPU lane's restore, whose copy is a DMA out of the slot;
- `direct`: the same files read with O_DIRECT in the same order on as many threads as the store
  uses, into buffers reused across files, nothing hashed: what the disk gives for these files;
- `dd`: `dd iflag=direct bs=4M` of each file, six at a time (xargs -P 6).

Then `load`, `stream` and `stream_host` once more warm, each after every file was read into
the page cache (a restore soon after a save or an eviction): the store copies what the cache
holds instead of reading it from the disk again.

The files are read long after they were written and each way reads them after the others
evicted them, so none of the three is favoured by a cache on the virtual disk's host side
(which serves a read right after a write at several GB/s; docs/benchmarks/README.md). Reported:
MB/s over the checkpoint's bytes, each rep and the median, each way over direct and dd.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.checkpoint_io_bench import drop_cache, store_files  # noqa: E402
from bench.suites import commit, machine  # noqa: E402

PAGE, STATE, PS = 4 << 20, 153_944_064, 64
FP = {"bench": "cold-read"}


def build(root: Path, n_pages: int, chunk: int) -> list[Path]:
    """The session saved in steps; returns its files in the order a load reads them."""
    from server.checkpoints.checkpoint_store import CheckpointStore
    from server.checkpoints.publish import SaveInput

    shutil.rmtree(root, ignore_errors=True)
    store = CheckpointStore(root, quota_bytes=1 << 45)
    state = np.random.default_rng(2).integers(0, 256, STATE, np.uint8).tobytes()
    digests: list = []
    try:
        for start in range(0, n_pages, chunk):
            stop = min(n_pages, start + chunk)
            new = [np.random.default_rng([1, i]).integers(0, 256, PAGE, np.uint8).tobytes()
                   for i in range(start, stop)]
            inp = SaveInput(np.arange(stop * PS, dtype=np.int32), PS,
                            [None] * start + new, digests + [None] * len(new), state, "resp")
            r = store.save("owner", "bench", inp, FP)
            assert r.status == "saved", r
            digests = list(inp.digests)
            print(f"saved {stop} of {n_pages} pages", flush=True)
    finally:
        store.close()
    gen = max((root / "sessions").glob("*/generations/*"), key=lambda p: p.stat().st_mtime)
    return [gen / "state.bin"] + [root / "pages" / d[:2] / d for d in digests]


def load_once(root: Path, n_pages: int) -> tuple[float, dict]:
    from server.checkpoints.checkpoint_store import CheckpointStore

    store = CheckpointStore(root, quota_bytes=1 << 45)
    try:
        t0 = time.perf_counter()
        got = store.load("owner", "bench", FP, np.arange(n_pages * PS + 1, dtype=np.int32))
        dt = time.perf_counter() - t0
        assert got.state == "available", got.reason
        return dt, dict(store.last_timings)
    finally:
        store.close()


def stream_once(root: Path, n_pages: int, arena, host_side: bool) -> tuple[float, dict]:
    from engine.runtime.staging import StreamedPages, slot_plan
    from server.checkpoints.checkpoint_store import CheckpointStore

    class HostSide(StreamedPages):
        @staticmethod
        def transfer(host):
            return host  # no device copy: the slot is reused right away

    half = ((16, PS, 4, 256), np.dtype(np.float16))  # 2 MiB: a page's k (or v) slice
    spec = [half, half]
    def host_side_layout(n, page_bytes):  # StagingArena.layout's, with HostSide
        arena._busy.acquire()
        staged = HostSide(arena, spec, n, *slot_plan(arena.nbytes, spec))
        return staged, [staged.lazy_views(i) for i in range(n)]
    layout = host_side_layout if host_side else arena.layout(spec, None)
    store = CheckpointStore(root, quota_bytes=1 << 45)
    try:
        t0 = time.perf_counter()
        got = store.load("owner", "bench", FP, np.arange(n_pages * PS + 1, dtype=np.int32),
                         page_layout=layout)
        got.staged.to_device()
        dt = time.perf_counter() - t0
        assert got.state == "available", got.reason
        return dt, dict(store.last_timings)
    finally:
        store.close()


def direct_once(files: list[Path], threads: int) -> float:
    bufs = [mmap.mmap(-1, max(PAGE, STATE)) for _ in range(threads)]  # page-aligned

    def read(args):
        k, path = args
        buf = memoryview(bufs[k % threads])
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            size = os.fstat(fd).st_size
            done = 0
            while done < size:
                n = os.preadv(fd, [buf[done:done + min(size - done, 64 << 20)]], done)
                if n <= 0:
                    break
                done += n
        finally:
            os.close(fd)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:  # thread k takes files k, k + threads, ...
        list(pool.map(lambda k: [read((k, f)) for f in files[k::threads]], range(threads)))
    return time.perf_counter() - t0


def cache(files: list[Path]) -> None:
    """Every file read once through the page cache (as a checkpoint just written is)."""
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


def dd_once(files: list[Path], listing: Path) -> float:
    listing.write_text("\n".join(map(str, files)) + "\n")
    t0 = time.perf_counter()
    subprocess.run(f"xargs -P 6 -I{{}} dd if={{}} of=/dev/null bs=4M iflag=direct status=none "
                   f"< {listing}", shell=True, check=True)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a scratch directory (removed first)")
    ap.add_argument("--pages", type=int, default=1920)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--staging", type=int, default=1 << 30,
                    help="the arena's bytes for `stream` (default: the h200 lane's 1 GiB)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from engine.runtime.staging import StagingArena
    from server.checkpoints.checkpoint_store import default_io_threads
    from server.checkpoints.files import READS, aligned_bytes

    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    files = build(base / "store", a.pages, a.chunk)
    total = sum(f.stat().st_size for f in files)
    threads = default_io_threads()
    t0 = time.perf_counter()
    arena = StagingArena(a.staging, aligned_bytes).start()
    arena._ready.wait()
    fault_in_s = time.perf_counter() - t0
    runs = []
    for rep in range(a.reps):
        row = {}
        drop_cache(store_files(base / "store"))
        row["load_s"], row["load_stages"] = load_once(base / "store", a.pages)
        drop_cache(store_files(base / "store"))
        row["stream_s"], row["stream_stages"] = stream_once(base / "store", a.pages, arena,
                                                            False)
        drop_cache(store_files(base / "store"))
        row["stream_host_s"], row["stream_host_stages"] = stream_once(
            base / "store", a.pages, arena, True)
        drop_cache(store_files(base / "store"))
        row["direct_s"] = direct_once(files, threads)
        drop_cache(store_files(base / "store"))
        row["dd_s"] = dd_once(files, base / "files.txt")
        for k in ("load", "stream", "stream_host", "direct", "dd"):
            row[f"{k}_mb_s"] = round(total / row[f"{k}_s"] / 1e6, 1)
        runs.append(row)
        print(f"rep {rep}: load {row['load_mb_s']:.0f} MB/s, stream {row['stream_mb_s']:.0f} "
              f"(host side {row['stream_host_mb_s']:.0f}), "
              f"O_DIRECT {row['direct_mb_s']:.0f}, "
              f"dd {row['dd_mb_s']:.0f}", flush=True)
    warm = {}  # the restores once more, each after every file was read into the page cache
    for k, once in (("load", lambda: load_once(base / "store", a.pages)),
                    ("stream", lambda: stream_once(base / "store", a.pages, arena, False)),
                    ("stream_host", lambda: stream_once(base / "store", a.pages, arena, True))):
        cache(files)
        before = dict(READS)
        warm[f"{k}_s"], warm[f"{k}_stages"] = once()
        warm[f"{k}_reads"] = {w: READS[w] - before[w] for w in READS}  # files each way
        warm[f"{k}_mb_s"] = round(total / warm[f"{k}_s"] / 1e6, 1)
    print(f"warm: load {warm['load_mb_s']:.0f} MB/s, stream {warm['stream_mb_s']:.0f} (host "
          f"side {warm['stream_host_mb_s']:.0f})", flush=True)
    med = {k: statistics.median(r[f"{k}_mb_s"] for r in runs)
           for k in ("load", "stream", "stream_host", "direct", "dd")}
    res = {"command": "bench/checkpoint_cold_read.py " + " ".join(argv or sys.argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {**machine(), "node": platform.node()}, "commit": commit(),
           "plan": "none: checkpoint store I/O only, no engine",
           "bytes": total, "files": len(files), "io_threads": threads,
           "load_average": os.getloadavg(), "runs": runs, "median_mb_s": med, "warm": warm,
           "load_over_direct": round(med["load"] / med["direct"], 3),
           "load_over_dd": round(med["load"] / med["dd"], 3),
           "stream_over_direct": round(med["stream"] / med["direct"], 3),
           "stream_over_dd": round(med["stream"] / med["dd"], 3),
           "stream_host_over_direct": round(med["stream_host"] / med["direct"], 3),
           "stream_host_over_dd": round(med["stream_host"] / med["dd"], 3),
           "staging_bytes": a.staging, "staging_fault_in_s": round(fault_in_s, 3),
           "staging_runs": arena.counts["runs"]}
    print(f"median: load {med['load']:.0f} MB/s, stream {med['stream']:.0f}, host side "
          f"{med['stream_host']:.0f} (/dd {res['stream_host_over_dd']:.2f}), O_DIRECT {med['direct']:.0f}, dd "
          f"{med['dd']:.0f}; load/direct {res['load_over_direct']:.2f}, load/dd "
          f"{res['load_over_dd']:.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
