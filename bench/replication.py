r"""Replication throughput and incremental push size (`./ninfer checkpoints replica
push|pull`): no model, a real replica service process on a loopback TLS port.

    .venv/bin/python bench/replication.py --dir /tmp/repl --out docs/benchmarks/replication.json

Builds one synthetic session through the real stores, as bench/sessions_transfer.py does
(4 MiB pages: qwen3.8-27b BF16, 64 tokens x 64 KiB; the 27B's 153,944,064-byte state image;
a chain of stored responses), then --reps times, each against a fresh replica directory and
service: a full push (the generation read and verified, signed, every object streamed, verified
and fsync'd on the replica, the manifest published) and a pull into a fresh, stopped state
directory (every object fetched and verified, the bundle rebuilt and imported through the
store's publish protocol). MB/s are over the objects' bytes; the push's figure counts from the
first byte on the wire, `push_total` from reading the generation. Then the session grows by
N = 64 and 512 tokens (new generations sharing the full pages) and each is pushed again:
the bytes the replica received, by kind.
"""
from __future__ import annotations

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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PRINCIPAL, SESSION = "bench", "bench-session"


def page(session: str, i: int, fill: int, nbytes: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"{session}/{i}/{fill}".encode()).digest()[:8],
                          "little")
    return np.random.default_rng(seed).integers(0, 255, nbytes, np.uint8)


def save(state: Path, n_tokens: int, page_bytes: int, state_bytes: int, turns: int,
         prev: str | None, principal: str = PRINCIPAL, session: str = SESSION):
    """A generation of `n_tokens` through the real CheckpointStore (full pages depend only on
    the session and their index: a grown session shares them) and `turns` more stored
    responses after `prev`; returns the pages' digests and the newest response id."""
    from server.checkpoints.checkpoint_store import CheckpointStore
    from server.checkpoints.publish import SaveInput
    from server.checkpoints.transfer import expected_fingerprint, record_runtime
    from server.response_store import ResponseRecord, ResponseStore

    store = CheckpointStore(state / "checkpoints", quota_bytes=1 << 40)
    fp = dict(expected_fingerprint(store.root)[0], page_size=64, plan={"bench": True})
    record_runtime(store.root, fp)
    rs = ResponseStore(state / "responses.db")
    for _ in range(turns):
        rid = f"resp_{os.urandom(12).hex()}"
        rs.put_response(ResponseRecord(
            id=rid, principal=principal, model="bench", status="completed",
            input_items=[{"type": "message", "role": "user", "content": "go on"}],
            output_items=[{"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": "ok " * 50}]}],
            output_token_ids=[list(range(100))], previous_response_id=prev,
            prompt_cache_key=session, prompt_tokens=n_tokens))
        prev = rid
    rs.close()
    n = -(-n_tokens // 64)
    pages = [page(session, i, min(64, n_tokens - 64 * i), page_bytes) for i in range(n)]
    res = store.save(principal, session, SaveInput(
        tokens=(np.arange(n_tokens) % 997).astype(np.int32), page_size=64, pages=pages,
        digests=[None] * n,
        state=page(session, -1, n_tokens, state_bytes),  # the state image
        head_response_id=prev), fp)
    store.close()
    assert res.status == "saved", res
    return {hashlib.sha256(p).hexdigest() for p in pages}, prev


def cli(*args) -> dict:
    r = subprocess.run([sys.executable, "-m", "server.cli", "checkpoints", *map(str, args)],
                       cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(r.stdout) if r.stdout.startswith("{") else {"out": r.stdout.strip()}


class Replica:
    def __init__(self, work: Path, key: Path, client: dict):
        self.dir = work / "replica"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "checkpoints", "replica", "serve", "--dir",
             self.dir, "--listen", "127.0.0.1:0", "--cert-dir", work / "replica-cert",
             "--transfer-key", key, "--peer-cert", client["cert"], "--pin", client["sha256"]],
            cwd=REPO, stdout=subprocess.PIPE, text=True)
        self.addr = json.loads(self.proc.stdout.readline())["listening"]

    def received(self) -> dict:
        return json.loads((self.dir / "received.json").read_text())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def main(argv=None) -> int:
    from bench.sessions_transfer import session_args, write_results

    args, work = session_args(__doc__, argv)
    from server.checkpoints.bundle import read_transfer_key
    from server.checkpoints.checkpoint_store import default_io_threads
    from server.checkpoints.replica_client import pull, push
    from server.checkpoints.replica_tls import load_identity
    from server.checkpoints_cli import _import_running, _import_stopped

    src = work / "src"
    n_tokens = args.pages * 64 - 7
    _, head = save(src, n_tokens, args.page_bytes, args.state_bytes, 4, None)
    key_path = Path(cli("transfer-key", "--state-dir", src)["out"])
    key = read_transfer_key(key_path)
    client = cli("replica", "cert", "--state-dir", src)
    server = cli("replica", "cert", "--out", work / "replica-cert")
    ident = load_identity(src / "secrets" / "replica", [server["cert"]], [server["sha256"]])
    runs = []
    with ThreadPoolExecutor(default_io_threads()) as pool:
        for _ in range(args.reps):
            rep = Replica(work, key_path, client)
            try:
                t = time.perf_counter()
                r = push(src, PRINCIPAL, SESSION, rep.addr, ident, key, pool)
                total_s = time.perf_counter() - t
                dst = work / "dst"
                shutil.rmtree(dst, ignore_errors=True)
                dst.mkdir()
                t = time.perf_counter()
                got = pull(dst, rep.addr, ident, key, key_path, PRINCIPAL, SESSION,
                           _import_running, _import_stopped)
                pull_s = time.perf_counter() - t
            finally:
                rep.stop()
            assert got["pages"] == args.pages and r["objects_sent"] == r["objects"]
            mb = r["bytes_total"] / 1e6
            runs.append({"bytes": r["bytes_total"], "push_mb_s": r["mb_per_s"],
                         "push_total_mb_s": round(mb / total_s, 1),
                         "pull_mb_s": round(mb / pull_s, 1)})
            print(json.dumps(runs[-1]), flush=True)
        rep = Replica(work, key_path, client)
        incremental = {}
        try:
            push(src, PRINCIPAL, SESSION, rep.addr, ident, key, pool)
            for n in (64, 512):
                _, head = save(src, n_tokens + n, args.page_bytes, args.state_bytes, 1,
                               head)
                before = rep.received()["bytes_received"]
                r = push(src, PRINCIPAL, SESSION, rep.addr, ident, key, pool)
                got = rep.received()["bytes_received"] - before
                new_pages = r["objects_sent"] - 3
                tokens = 4 * (n_tokens + n)
                incremental[str(n)] = {
                    "bytes_received": got, "manifest_bytes": r["manifest_bytes"],
                    "new_pages": new_pages, "page_bytes": new_pages * args.page_bytes,
                    "state_bytes": args.state_bytes, "tokens_bytes": tokens,
                    "responses_bytes": got - new_pages * args.page_bytes - args.state_bytes
                    - tokens, "session_bytes": r["bytes_total"],
                    "objects_sent": r["objects_sent"], "objects": r["objects"]}
                n_tokens += n
                print(n, json.dumps(incremental[str(n)]), flush=True)
            assert rep.received()["received_twice"] == []
        finally:
            rep.stop()
    summary = {k: {"best": max(r[k] for r in runs),
                   "median": round(statistics.median(r[k] for r in runs), 1)}
               for k in ("push_mb_s", "push_total_mb_s", "pull_mb_s")}
    return write_results("replication.py", args, work, argv, summary,
                         {"transport": "gRPC, mutual TLS (EC P-256), 127.0.0.1"}, runs=runs,
                         incremental_push=incremental)


if __name__ == "__main__":
    sys.exit(main())
