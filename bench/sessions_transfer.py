r"""Session export/import throughput (`./ninfer checkpoints export|import`): no server, no model.

    .venv/bin/python bench/sessions_transfer.py --dir /tmp/sxfer \
        --out docs/benchmarks/sessions_transfer.json

Builds one synthetic session in a state directory through the real stores (a
`CheckpointStore.save` of random pages and a random recurrent-state image, and a chain of
stored responses in the `ResponseStore`), then, --reps times: exports it (the store read and
verified without its lock, the bundle hashed, written and fsync'd), verifies the bundle alone
(`read_bundle`: every entry's sha256 and the tag), and imports it into a fresh state directory
with the server stopped (the whole import: verification, publish through the store's save
protocol, the responses' transaction). Each runs twice: warm (the files just written, in the
page cache) and cold (the files read are dropped from the page cache first, with
posix_fadvise(DONTNEED) on the clean, fsync'd files). MB/s are over the bundle's bytes.

Then one `./ninfer checkpoints import` of the bundle as a process of its own: its peak resident
memory beside the bundle's size.

Default config: 4 MiB pages (qwen3.8-27b BF16: 64 tokens x 64 KiB) x 64 (a 4K-token session)
plus the 27B's 153,944,064-byte state image; --pages scales it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PRINCIPAL, SESSION = "bench", "bench-session"


def evict(root: Path) -> None:
    """Drop `root`'s files (or the file itself) from the page cache."""
    paths = [root] if root.is_file() else [Path(d) / n for d, _, ns in os.walk(root) for n in ns]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def build_source(state: Path, page_bytes: int, pages: int, state_bytes: int) -> dict:
    from server.checkpoints.checkpoint_store import CheckpointStore
    from server.checkpoints.publish import SaveInput
    from server.checkpoints.transfer import expected_fingerprint, record_runtime
    from server.response_store import ResponseRecord, ResponseStore

    rng = np.random.default_rng(0)
    store = CheckpointStore(state / "checkpoints", quota_bytes=1 << 40)
    fp, _ = expected_fingerprint(store.root)
    fp = dict(fp, page_size=64, plan={"bench": True})
    record_runtime(store.root, fp)  # the importing side checks against the same runtime
    tokens = rng.integers(0, 1000, pages * 64 - 7).astype(np.int32)
    rs = ResponseStore(state / "responses.db")
    prev = None
    for i in range(4):
        rid = f"resp_bench{i}"
        rs.put_response(ResponseRecord(
            id=rid, principal=PRINCIPAL, model="bench", status="completed",
            input_items=[{"type": "message", "role": "user", "content": f"turn {i}"}],
            output_items=[{"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": "ok " * 50}]}],
            output_token_ids=[list(range(100))], previous_response_id=prev,
            prompt_cache_key=SESSION, prompt_tokens=len(tokens)))
        prev = rid
    rs.close()
    inp = SaveInput(tokens=tokens, page_size=64,
                    pages=[rng.integers(0, 255, page_bytes, np.uint8) for _ in range(pages)],
                    digests=[None] * pages,
                    state=rng.integers(0, 255, state_bytes, np.uint8), head_response_id=prev)
    res = store.save(PRINCIPAL, SESSION, inp, fp)
    store.close()
    assert res.status == "saved", res
    return fp


def one_rep(work: Path, src: Path, key: bytes, cold: bool) -> dict:
    from server.checkpoints.bundle import read_bundle
    from server.checkpoints.checkpoint_store import CheckpointStore
    from server.checkpoints.transfer import (expected_fingerprint, export_session,
                                             import_session, record_runtime)
    from server.response_store import ResponseStore

    bundle = work / "session.bundle"
    bundle.unlink(missing_ok=True)
    if cold:
        evict(src / "checkpoints")
    with ThreadPoolExecutor(min(32, (os.cpu_count() or 1) + 4)) as pool:
        t = time.perf_counter()
        export_session(src, PRINCIPAL, SESSION, bundle, key, pool)
        t_export = time.perf_counter() - t
    size = bundle.stat().st_size
    if cold:
        evict(bundle)
    t = time.perf_counter()
    read_bundle(bundle, key).close()
    t_verify = time.perf_counter() - t
    dst = work / "dst"
    shutil.rmtree(dst, ignore_errors=True)
    (dst / "checkpoints").mkdir(parents=True, mode=0o700)
    fp = json.loads((src / "checkpoints" / "runtime.json").read_text())
    record_runtime(dst / "checkpoints", fp)
    if cold:
        evict(bundle)
    t = time.perf_counter()
    store = CheckpointStore(dst / "checkpoints", quota_bytes=1 << 40)
    rs = ResponseStore(dst / "responses.db")
    expected, complete = expected_fingerprint(dst / "checkpoints")
    r = import_session(bundle, key, store, rs, expected, complete)
    rs.close()
    store.close()
    t_import = time.perf_counter() - t
    assert r["responses"] == 4 and complete
    mb = size / 1e6
    return {"bundle_bytes": size, "export_s": t_export, "verify_s": t_verify,
            "import_s": t_import, "export_mb_s": mb / t_export, "verify_mb_s": mb / t_verify,
            "import_mb_s": mb / t_import}


# runs `./ninfer` and reports its peak resident memory (VmHWM: this process's own high-water
# mark; ru_maxrss would include the forking parent's, which exec keeps)
_PEAK = ("import runpy, sys\nsys.argv = ['ninfer'] + sys.argv[1:]\ntry:\n"
         "    runpy.run_module('server.cli', run_name='__main__')\nfinally:\n"
         "    print('VmHWM', [x.split()[1] for x in open('/proc/self/status')\n"
         "                    if x.startswith('VmHWM')][0], file=sys.stderr)\n")


def import_peak_rss(work: Path, src: Path, key: bytes) -> dict:
    """`./ninfer checkpoints import` of the bundle as its own process, into a fresh stopped
    state directory: its peak resident memory beside the bundle's size (an import streams its
    pages, so the peak should not grow with them)."""
    import subprocess

    from server.checkpoints.transfer import record_runtime

    bundle, dst = work / "session.bundle", work / "dst-rss"
    shutil.rmtree(dst, ignore_errors=True)
    (dst / "checkpoints").mkdir(parents=True, mode=0o700)
    record_runtime(dst / "checkpoints",
                   json.loads((src / "checkpoints" / "runtime.json").read_text()))
    (work / "key").write_bytes(key)
    os.chmod(work / "key", 0o600)
    r = subprocess.run([sys.executable, "-c", _PEAK, "checkpoints", "import", str(bundle),
                        "--state-dir", str(dst), "--transfer-key", str(work / "key"),
                        "--checkpoint-quota", "1T"], cwd=REPO, check=True, capture_output=True,
                       text=True)
    kib = int(next(x for x in r.stderr.splitlines() if x.startswith("VmHWM")).split()[1])
    return {"bundle_bytes": bundle.stat().st_size, "peak_rss_bytes": kib * 1024}


def session_args(doc: str, argv=None) -> tuple[argparse.Namespace, Path]:
    """The synthetic session's options (page and state sizes, --reps, --dir, --out), parsed,
    and the scratch directory, emptied (shared with bench/replication.py)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--dir", required=True, help="a scratch directory (removed first)")
    p.add_argument("--out", help="write the results JSON here")
    p.add_argument("--page-bytes", type=int, default=4 << 20)
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--state-bytes", type=int, default=153_944_064)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    os.umask(0o077)
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return args, work


def write_results(script: str, args, work: Path, argv, summary: dict, config: dict,
                  **body) -> int:
    """Print the summary; write the results file (--out) with the command, date, machine and
    commit; remove the scratch directory (shared with bench/replication.py)."""
    from bench.suites import commit, machine

    result = {"command": f"bench/{script} " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), "commit": commit(), "load_average": os.getloadavg(),
              "config": {"page_bytes": args.page_bytes, "pages": args.pages,
                         "state_bytes": args.state_bytes, "reps": args.reps, **config},
              "summary_mb_s": summary, **body}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    args, work = session_args(__doc__, argv)
    from server.checkpoints.bundle import create_transfer_key

    src = work / "src"
    build_source(src, args.page_bytes, args.pages, args.state_bytes)
    key = create_transfer_key(work / "transfer-key").read_bytes()
    runs = {"warm": [], "cold": []}
    for _ in range(args.reps):
        for mode in ("warm", "cold"):
            runs[mode].append(one_rep(work, src, key, mode == "cold"))
            print(mode, json.dumps({k: round(v, 1) for k, v in runs[mode][-1].items()
                                    if k.endswith("mb_s")}), flush=True)
    peak = import_peak_rss(work, src, key)
    print("import peak RSS", json.dumps(peak), flush=True)
    summary = {mode: {k: {"best": round(max(r[k] for r in rs), 1),
                          "median": round(statistics.median(r[k] for r in rs), 1)}
                      for k in ("export_mb_s", "verify_mb_s", "import_mb_s")}
               for mode, rs in runs.items()}
    return write_results("sessions_transfer.py", args, work, argv, summary,
                         {"responses": 4}, runs=runs, import_peak=peak)


if __name__ == "__main__":
    sys.exit(main())
