r"""Checkpoint store I/O micro-benchmark: no server, no model.

    .venv/bin/python bench/checkpoint_io_bench.py --dir /tmp/ckio --out result.json
    .venv/bin/python bench/checkpoint_io_bench.py --dir /tmp/ckio \
        --configs 27b:4194304:2048:153944064 --reps 1      # a 128K-token 27B session

Each config NAME:PAGE_BYTES:PAGES:STATE_BYTES builds a synthetic export (random pages, a random
recurrent-state image), saves it through the real `CheckpointStore` (every page new: a first
save) and loads it back with full verification, twice: warm (the files still in the page cache)
and cold (each file's cached pages dropped first with posix_fadvise(DONTNEED), which works on
clean, fsync'd files without root). Next to it, in the same directory: one plain file of the
same bytes written sequentially with one fsync, and read back warm and cold.

Reported per config (MB/s over all the checkpoint's bytes; best of --reps runs and their
median, since the machine may be shared): save and load vs plain, `restore_warm` = a warm
load plus the hand-off below (what a restore costs before the engine's scatter), the store's
own per-stage split (`CheckpointStore.last_timings`, when the store has it), single- and
multi-thread sha256 rates,
and the hand-off to the engine on the host side: the loaded pages laid out as the engine's
scatter wants them (engine/runtime/checkpoint_io.py; since StagedPages the load reads pages
straight into that layout, so this is no work) plus a `jax.device_put` of the result (on this
CPU backend a host copy; on a GPU the host-to-device transfer).

Defaults: `27b` = 4 MiB pages (qwen3.8-27b BF16: 64 tokens x 64 KiB) x 256 (16K tokens,
1 GiB) + its 153,944,064-byte image; `tiny` = the embedded tiny model's 128 KiB pages x 512
(32K tokens) + its 116,736-byte image. Use --pages to scale (2,048 x 4 MiB is a 128K session,
8.6 GB: needs that much free memory twice).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_CONFIGS = "27b:4194304:256:153944064,tiny:131072:512:116736"
# (shape, dtype) of each pool array's slice of one page, as engine/runtime/checkpoint_io.py
# page_spec gives them: k then v, [L, page_size, kv_heads, head_dim]. bf16 is stood in by
# uint16 (same size; the hand-off never interprets values).
SPECS = {
    4194304: [((16, 64, 4, 256), np.dtype(np.uint16))] * 2,   # 27B: 16 attn layers, BF16
    131072: [((2, 64, 2, 64), np.dtype(np.float32))] * 2,      # tiny: fp32
}


def rand_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, np.uint8).tobytes()


def drop_cache(paths) -> None:
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def store_files(root: Path) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]


def plain_io(directory: Path, data_parts: list, total: int) -> dict:
    """One file: every part written sequentially, one fsync; read back warm and cold."""
    path = directory / "plain.bin"
    path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for part in data_parts:
        view = memoryview(part)
        while view:
            view = view[os.write(fd, view):]
    os.fsync(fd)
    os.close(fd)
    w = time.perf_counter() - t0
    buf = bytearray(total)

    def read():
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            view, got = memoryview(buf), 0
            while got < total:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        assert got == total
        return time.perf_counter() - t0

    warm = read()
    drop_cache([path])
    cold = read()
    # the disk's direct-read rate for the same bytes, past the page cache: dd with O_DIRECT
    t0 = time.perf_counter()
    dd = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"],
                        capture_output=True, text=True)
    direct = time.perf_counter() - t0
    path.unlink()
    out = {"plain_write_s": w, "plain_read_warm_s": warm, "plain_read_cold_s": cold}
    if dd.returncode == 0:  # a filesystem without O_DIRECT (tmpfs) refuses it
        out["dd_direct_read_s"] = direct
    return out


def sha_rates(sample: bytes, threads: int) -> dict:
    t0 = time.perf_counter()
    hashlib.sha256(sample).digest()
    one = len(sample) / (time.perf_counter() - t0) / 1e6
    chunks = [memoryview(sample)[i::1] for i in range(threads)]  # same buffer, N hashes
    with ThreadPoolExecutor(threads) as ex:
        t0 = time.perf_counter()
        list(ex.map(lambda b: hashlib.sha256(b).digest(), chunks))
        many = len(sample) * threads / (time.perf_counter() - t0) / 1e6
    return {"sha256_1thread_MBps": round(one), f"sha256_{threads}threads_MBps": round(many)}


def page_layout(page_bytes: int):
    """The server's restore path reads pages straight into the engine's staging layout
    (engine/runtime/checkpoint_io.StagedPages) in page-aligned memory, as the checkpoint
    manager lays it out, when this build has it."""
    from engine.runtime import checkpoint_io as cio
    from server.checkpoints.files import aligned_bytes

    spec = SPECS.get(page_bytes)
    if spec is None or not hasattr(cio, "StagedPages"):
        return None
    return cio.StagedPages.layout(spec, aligned_bytes)


def handoff(page_bytes: int, got) -> dict:
    """The loaded pages to the engine's scatter layout on the host, then device_put (in the
    power-of-two chunks the import scatters, or one padded block before)."""
    import jax

    from engine.runtime import checkpoint_io as cio

    spec = SPECS.get(page_bytes)
    if spec is None:
        return {}
    pages = got.pages
    t0 = time.perf_counter()
    if getattr(got, "staged", None) is not None:  # read straight into the layout: no copy
        host = [a[s:e] for s, e in cio._chunks(got.staged.n) for a in got.staged.arrays]
    else:  # the layout before StagedPages: per page frombuffer, np.stack, pad by concatenate
        bucket = 1 << max(0, (len(pages) - 1).bit_length())
        host = []
        cols = list(zip(*[_split(spec, p) for p in pages]))
        for col in cols:
            stacked = np.stack(col, axis=1)
            pad = np.zeros((stacked.shape[0], bucket - stacked.shape[1]) + stacked.shape[2:],
                           stacked.dtype)
            host.append(np.concatenate([stacked, pad], axis=1))
    t1 = time.perf_counter()
    dev = [jax.device_put(h) for h in host]
    for d in dev:
        d.block_until_ready()
    t2 = time.perf_counter()
    del dev, host
    return {"handoff_host_s": t1 - t0, "handoff_device_put_s": t2 - t1}


def _split(spec, data):
    out, off = [], 0
    for shape, dt in spec:
        count = int(np.prod(shape))
        out.append(np.frombuffer(data, dt, count=count, offset=off).reshape(shape))
        off += count * dt.itemsize
    return out


def one_config(base: Path, name: str, page_bytes: int, n_pages: int, state_bytes: int,
               reps: int, threads: int | None) -> dict:
    from server.checkpoints.checkpoint_store import CheckpointStore
    from server.checkpoints.publish import SaveInput

    ps = 64
    n_tokens = n_pages * ps
    pages = [rand_bytes(page_bytes, [1, i]) for i in range(n_pages)]
    state = rand_bytes(state_bytes, 2)
    total = n_pages * page_bytes + state_bytes + 4 * n_tokens
    fp = {"bench": name}
    rows = []
    for rep in range(reps):
        root = base / f"store-{name}"
        shutil.rmtree(root, ignore_errors=True)
        kw = {} if threads is None else {"io_threads": threads}
        try:
            store = CheckpointStore(root, quota_bytes=1 << 44, **kw)
        except TypeError:  # a store without io_threads
            store = CheckpointStore(root, quota_bytes=1 << 44)
        inp = SaveInput(np.arange(n_tokens, dtype=np.int32), ps, list(pages),
                        [None] * n_pages, state, "resp_bench")
        t0 = time.perf_counter()
        r = store.save("owner", "bench", inp, fp)
        save_s = time.perf_counter() - t0
        assert r.status == "saved", r
        save_stages = dict(getattr(store, "last_timings", {}) or {})
        prompt = np.arange(n_tokens + 1, dtype=np.int32)
        layout = page_layout(page_bytes)
        lkw = {} if layout is None else {"page_layout": layout}
        t0 = time.perf_counter()
        got = store.load("owner", "bench", fp, prompt, **lkw)
        warm_s = time.perf_counter() - t0
        assert got.state == "available", got.reason
        warm_stages = dict(getattr(store, "last_timings", {}) or {})
        if rep == 0:
            assert all(b"".join(a if isinstance(a, list) else [a]) == b
                       for a, b in zip(got.pages, pages))
            assert bytes(got.state_bytes) == state
        del got
        drop_cache(store_files(root))
        t0 = time.perf_counter()
        got = store.load("owner", "bench", fp, prompt, **lkw)
        cold_s = time.perf_counter() - t0
        assert got.state == "available", got.reason
        cold_stages = dict(getattr(store, "last_timings", {}) or {})
        ho = handoff(page_bytes, got)
        del got
        store.close()
        shutil.rmtree(root)
        plain = plain_io(base, pages + [state], n_pages * page_bytes + state_bytes)
        # a restore end to end: read + verify (warm) + the hand-off to the engine
        restore = {"restore_warm_s": warm_s + ho["handoff_host_s"] + ho["handoff_device_put_s"]
                   } if ho else {}
        rows.append({"save_s": save_s, "load_warm_s": warm_s, "load_cold_s": cold_s, **plain,
                     **ho, **restore, "save_stages": save_stages, "load_warm_stages": warm_stages,
                     "load_cold_stages": cold_stages})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]
           if not k.endswith("_stages")}
    low = {k: min(r[k] for r in rows) for k in med}
    best = min(rows, key=lambda r: r["save_s"] + r["load_warm_s"])
    mbps = lambda s: round(total / s / 1e6, 1)  # noqa: E731
    out = {"config": name, "page_bytes": page_bytes, "pages": n_pages,
           "state_bytes": state_bytes, "bytes": total, "reps": reps,
           "io_threads": threads or "default"}
    for k in ("save", "plain_write", "load_warm", "plain_read_warm", "load_cold",
              "plain_read_cold", "dd_direct_read"):  # best of the reps, and their median
        if f"{k}_s" in low:
            out[f"{k}_MBps"] = mbps(low[f"{k}_s"])
            out[f"{k}_MBps_median"] = mbps(med[f"{k}_s"])
    if "dd_direct_read_s" in low:  # the cold restore read against the disk's direct rate
        out["load_cold_of_dd_direct"] = round(low["dd_direct_read_s"] / low["load_cold_s"], 3)
    out.update({f"{k}_median": round(v, 4) for k, v in med.items()})
    out.update({f"{k}_best": round(v, 4) for k, v in low.items()})
    out["stages_of_best_rep"] = {k: {s: round(v, 4) for s, v in best[k].items()}
                                 for k in ("save_stages", "load_warm_stages",
                                           "load_cold_stages")}
    out.update(sha_rates(pages[0] * max(1, (32 << 20) // page_bytes), os.cpu_count() or 1))
    if "handoff_host_s" in med:
        kv = n_pages * page_bytes
        out["handoff_host_s_best"] = round(low["handoff_host_s"], 4)
        out["handoff_device_put_MBps"] = round(kv / low["handoff_device_put_s"] / 1e6, 1)
        out["restore_warm_MBps"] = mbps(low["restore_warm_s"])
        out["restore_warm_MBps_median"] = mbps(med["restore_warm_s"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="scratch directory (on the disk to measure)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="NAME:PAGE_BYTES:PAGES:STATE_BYTES, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--io-threads", type=int, default=None,
                    help="the store's thread pool size (default: the store's own)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    results = []
    for cfg in args.configs.split(","):
        name, pb, n, sb = cfg.split(":")
        res = one_config(base, name, int(pb), int(n), int(sb), args.reps, args.io_threads)
        results.append(res)
        print(json.dumps(res, indent=1), flush=True)
    print("\nMB/s, best of the reps (median in brackets)")
    cols = ("save", "plain_write", "load_warm", "plain_read_warm", "load_cold",
            "plain_read_cold", "dd_direct_read", "restore_warm")
    print(f"{'config':8} {'bytes':>10} " + " ".join(f"{c:>18}" for c in cols))
    for r in results:
        cells = " ".join(f"{r.get(c + '_MBps', '-'):>9} ({r.get(c + '_MBps_median', '-'):>6})"
                         for c in cols)
        print(f"{r['config']:8} {r['bytes'] / 1e6:>8.1f}MB {cells}")
    if args.out:
        from bench.suites import commit, machine
        Path(args.out).write_text(json.dumps({
            "command": "bench/checkpoint_io_bench.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
            "commit": commit(), "load_average": os.getloadavg(), "results": results},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
