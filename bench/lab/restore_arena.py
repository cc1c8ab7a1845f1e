"""Lab: what a cold restore costs in first-touch page faults. The store's load of a large
session (bench/checkpoint_cold_read.py's, built here once and kept in --dir) read cold into
fresh buffers, as the product does today, against the same load into one pre-faulted,
page-aligned arena passed as the load's page layout (what a staging buffer kept from one
restore to the next would give), alternating, the page cache dropped before each.

    .venv/bin/python bench/lab/restore_arena.py --dir /tmp/lab/big --pages 1920 --reps 2 \
        --out docs/benchmarks/restore_arena_lab.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import checkpoint_cold_read as B  # noqa: E402
from bench.checkpoint_io_bench import drop_cache, store_files  # noqa: E402
from bench.suites import commit, machine  # noqa: E402


def main() -> int:
    from server.checkpoints.checkpoint_store import CheckpointStore
    from server.checkpoints.files import READS, aligned_bytes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/lab/big")
    ap.add_argument("--pages", type=int, default=1920)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    root = Path(a.dir)
    if not (root / "built").exists():
        B.build(root, a.pages, 128)
        (root / "built").write_text(str(a.pages))
    n, pb = int((root / "built").read_text()), B.PAGE
    arena = aligned_bytes(n * pb)
    arena[::4096] = 1  # faulted in once, before any timing

    def arena_layout(count, page_bytes):
        return None, [memoryview(arena[i * page_bytes:(i + 1) * page_bytes])
                      for i in range(count)]
    rows = []
    for _ in range(a.reps):
        for mode in ("fresh buffers", "pre-faulted arena"):
            drop_cache(store_files(root))
            store = CheckpointStore(root, quota_bytes=1 << 45)
            kw = {"page_layout": arena_layout} if mode != "fresh buffers" else {}
            direct0 = READS["direct"]
            t0 = time.perf_counter()
            got = store.load("owner", "bench", B.FP, np.arange(n * B.PS + 1, dtype=np.int32),
                             **kw)
            dt = time.perf_counter() - t0
            assert got.state == "available", got.reason
            rows.append({"mode": mode, "bytes": got.bytes_read, "seconds": round(dt, 3),
                         "mb_s": round(got.bytes_read / dt / 1e6, 1),
                         "direct_reads": READS["direct"] - direct0})
            del got
            store.close()
            print(f"{mode:18s} {rows[-1]['mb_s']:7.0f} MB/s", flush=True)
    res = {"command": "bench/lab/restore_arena.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
           "commit": commit(), "plan": "none: checkpoint store I/O only, no engine",
           "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
