"""Lab: how fast can a checkpoint's page files be read cold, and what holds the store's load back?

    .venv/bin/python bench/lab/cold_read.py --dir /tmp/coldread --pages 512 --threads 2,4,8

Writes `pages` files of 4 MiB (a checkpoint's page size), then for each way of reading them
evicts them from the page cache (fsync, posix_fadvise DONTNEED) and reads them all on a thread
pool: buffered readv into preallocated buffers (what server/checkpoints/verify.py does), the
same after posix_fadvise(WILLNEED) of every file (the kernel starts every file's read-ahead at
once), and O_DIRECT reads of whole files into page-aligned buffers (no page cache, one request a
file). Each with and without sha256 of the bytes. Then the same bytes as one file, read with
O_DIRECT by one thread and by several. Prints MB/s a way and writes JSON.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import mmap
import os
import sys
import time
from pathlib import Path

PAGE = 4 << 20


def evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_buffered(path, buf, hashed, willneed=False):
    fd = os.open(path, os.O_RDONLY)
    try:
        view, n = memoryview(buf), 0
        while n < PAGE:
            got = os.readv(fd, [view[n:]])
            if got == 0:
                break
            n += got
    finally:
        os.close(fd)
    return hashlib.sha256(buf).hexdigest() if hashed else n


def read_direct(path, buf, hashed, willneed=False):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        n = os.preadv(fd, [buf], 0)
    finally:
        os.close(fd)
    return hashlib.sha256(buf).hexdigest() if hashed else n


def run(paths, threads, how, hashed) -> float:
    bufs = [mmap.mmap(-1, PAGE) for _ in paths]  # page-aligned, as O_DIRECT needs
    evict(paths)
    fn = {"buffered": read_buffered, "willneed": read_buffered, "direct": read_direct}[how]
    t0 = time.perf_counter()
    if how == "willneed":
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            os.close(fd)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda a: fn(a[0], a[1], hashed), zip(paths, bufs)))
    dt = time.perf_counter() - t0
    for b in bufs:
        b.close()
    return len(paths) * PAGE / dt / 1e6


def run_one_file(path, pages, threads) -> float:
    evict([path])
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, PAGE) for _ in range(threads)]

    def work(i):
        for k in range(i, pages, threads):
            os.preadv(fd, [bufs[i]], k * PAGE)
    t0 = time.perf_counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
    finally:
        os.close(fd)
    return pages * PAGE / (time.perf_counter() - t0) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/coldread")
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--threads", default="2,4,8")
    ap.add_argument("--out")
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    block = os.urandom(PAGE)
    for i in range(a.pages):
        p = d / f"page{i:05d}.bin"
        if not p.exists() or p.stat().st_size != PAGE:
            p.write_bytes(block[i % 7:] + block[:i % 7])
        paths.append(str(p))
    rows = []
    for threads in [int(t) for t in a.threads.split(",")]:
        for how in ("buffered", "willneed", "direct"):
            for hashed in (False, True):
                mbs = run(paths, threads, how, hashed)
                rows.append({"threads": threads, "how": how, "sha256": hashed,
                             "mb_s": round(mbs)})
                print(f"threads {threads}  {how:9s} sha256={hashed!s:5s}  {mbs:8.0f} MB/s",
                      flush=True)
    # the same bytes as ONE file, read with O_DIRECT in 4 MiB requests by 1, 2 or 4 threads
    # (thread i takes requests i, i + n, ...): a single stream against interleaved ones
    big = d / "all-pages.bin"
    if not big.exists() or big.stat().st_size != a.pages * PAGE:
        with open(big, "wb") as f:
            for p in paths:
                f.write(Path(p).read_bytes())
    for threads in (1, 2, 4):
        mbs = run_one_file(big, a.pages, threads)
        rows.append({"threads": threads, "how": "one_file_direct", "sha256": False,
                     "mb_s": round(mbs)})
        print(f"threads {threads}  one file, O_DIRECT, 4 MiB requests  {mbs:8.0f} MB/s",
              flush=True)
    rec = {"command": "bench/lab/cold_read.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "bytes": a.pages * PAGE, "load_average": os.getloadavg(), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
