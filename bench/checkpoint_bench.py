"""Checkpoint costs on the CPU lane (embedded tiny model), through real server processes.

    .venv/bin/python bench/checkpoint_bench.py --state-dir /tmp/ckbench --lengths 2048,8192,32768

Server 1 builds one session per length (autosave) and stops gracefully; server 2 continues
each session with a short turn (restored from disk) and, as a different principal, prefills the
same transcript cold. Reported from the request log: save and restore bytes, seconds and MB/s;
restore TTFT vs cold re-prefill TTFT. Next to them, a plain sequential write (+fsync) and read
of the same number of bytes in the same directory.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.serverproc import start_server  # noqa: E402

WORDS = ["parse", "tree", "vector", "merge", "cache", "queue", "graph", "token", "shard",
         "index", "lambda", "socket", "buffer", "thread", "kernel", "branch"]


def text_of(n_tokens: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    # about 11 tokens per line with the tiny model's tokenizer
    return "\n".join(f"{i}. {' '.join(rng.choice(WORDS, 6))}" for i in range(n_tokens * 10 // 111))


def post(srv, key, body, path="/responses"):
    """Responses are streamed: a long prefill must not meet the HTTP response timeout."""
    headers = {"Authorization": f"Bearer {key}"}
    if path != "/responses":
        r = httpx.post(srv.api_url + path, json=body, timeout=3600, headers=headers)
        r.raise_for_status()
        return r.json()
    last = None
    with httpx.stream("POST", srv.api_url + path, json={**body, "stream": True},
                      timeout=3600, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                if ev.get("type") in ("response.completed", "response.incomplete"):
                    last = ev["response"]
    if last is None:
        raise RuntimeError("the stream ended without a response")
    return last


def log_records(state: Path) -> list[dict]:
    return [json.loads(x) for x in (state / "logs" / "requests.jsonl").read_text().splitlines()]


def plain_io(directory: Path, nbytes: int) -> tuple[float, float]:
    """MB/s of a sequential write + fsync and a read of `nbytes` in `directory`."""
    path = directory / "plain.bin"
    data = os.urandom(min(nbytes, 1 << 20)) * (nbytes // min(nbytes, 1 << 20) + 1)
    data = data[:nbytes]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    w = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = path.read_bytes()
    r = time.perf_counter() - t0
    assert len(back) == nbytes
    path.unlink()
    return nbytes / w / 1e6, nbytes / r / 1e6


def store_io(directory: Path, n_tokens: int, page_bytes: int = 64 * 2048,
             state_bytes: int = 116736) -> dict:
    """The store alone, tiny-model sizes: the first save of an n-token state (every page new),
    a load with full verification, then a turn adding 64 tokens."""
    from server.checkpoints.checkpoint_store import CheckpointStore
    from server.checkpoints.publish import SaveInput

    root = directory / f"store-{n_tokens}"
    shutil.rmtree(root, ignore_errors=True)
    store = CheckpointStore(root, quota_bytes=1 << 40)
    fp = {"bench": 1}
    n_pages = -(-n_tokens // 64)
    pages = [os.urandom(page_bytes) for _ in range(n_pages)]
    inp = SaveInput(np.arange(n_tokens, dtype=np.int32), 64, pages, [None] * n_pages,
                    os.urandom(state_bytes), "resp_bench")
    t0 = time.perf_counter()
    r = store.save("owner", "bench", inp, fp)
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = store.load("owner", "bench", fp, np.arange(n_tokens + 1, dtype=np.int32))
    load_s = time.perf_counter() - t0
    assert got.state == "available"
    full = n_tokens // 64
    n2 = n_tokens + 64
    pages2 = [None] * full + [os.urandom(page_bytes) for _ in range(-(-n2 // 64) - full)]
    inp2 = SaveInput(np.arange(n2, dtype=np.int32), 64, pages2,
                     inp.digests[:full] + [None] * (len(pages2) - full), os.urandom(state_bytes))
    t0 = time.perf_counter()
    r2 = store.save("owner", "bench", inp2, fp)
    turn_s = time.perf_counter() - t0
    store.close()
    pw, pr = plain_io(directory, got.bytes_read)
    shutil.rmtree(root)
    return {"context_tokens": n_tokens, "bytes": got.bytes_read,
            "save_s": round(save_s, 4), "save_MBps": round(r.bytes_written / save_s / 1e6, 1),
            "load_s": round(load_s, 4), "load_MBps": round(got.bytes_read / load_s / 1e6, 1),
            "plain_write_MBps": round(pw, 1), "plain_read_MBps": round(pr, 1),
            "turn_of_64_bytes_written": r2.bytes_written, "turn_of_64_s": round(turn_s, 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--models-from", default=None, help="a state dir whose models/ to reuse")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--store-only", action="store_true",
                    help="only the store's save/load against plain I/O (no server, no model)")
    args = ap.parse_args()
    if args.store_only:
        d = Path(args.state_dir)
        d.mkdir(parents=True, exist_ok=True)
        rows = [store_io(d, int(n)) for n in args.lengths.split(",")]
        print(json.dumps(rows, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        return 0
    state = Path(args.state_dir)
    os.environ.setdefault("SANIC_RESPONSE_TIMEOUT", "3600")  # long cold prefills on a CPU
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    if args.models_from:
        (state / "models").symlink_to(Path(args.models_from) / "models")
    (state / "keys").write_text("owner nk-owner-0123456789abcdef\ncold nk-cold-0123456789abcdef\n")
    (state / "keys").chmod(0o600)
    owner, cold = "nk-owner-0123456789abcdef", "nk-cold-0123456789abcdef"
    lengths = [int(x) for x in args.lengths.split(",")]
    srv = start_server(state, "--checkpoint-quota", "64G")
    first = {}
    try:
        for n in lengths:
            first[n] = post(srv, owner, {"model": "tiny", "input": text_of(n, n),
                                         "max_output_tokens": 1, "temperature": 0,
                                         "prompt_cache_key": f"bench-{n}"})
            post(srv, owner, {"prompt_cache_key": f"bench-{n}"}, "/ninfer/checkpoints")
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait()
    srv = start_server(state, "--checkpoint-quota", "64G")
    second, cold_r = {}, {}
    try:
        for n in lengths:
            second[n] = post(srv, owner, {"model": "tiny", "input": "Continue.",
                                          "previous_response_id": first[n]["id"],
                                          "max_output_tokens": 1, "temperature": 0,
                                          "prompt_cache_key": f"bench-{n}"})
            cold_r[n] = post(srv, cold, {"model": "tiny", "max_output_tokens": 1,
                                         "temperature": 0, "input": [
                                             {"role": "user", "content": text_of(n, n)},
                                             {"role": "assistant",
                                              "content": first[n]["output_text"]},
                                             {"role": "user", "content": "Continue."}]})
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait()
    recs = log_records(state)
    done = {r["request_id"]: r for r in recs if r["event"] == "request_done"}
    saves = [r for r in recs if r["event"] == "checkpoint_saved"]
    restores = [r for r in recs if r["event"] == "checkpoint_restore" and r["state"] ==
                "available"]
    rows = []
    for i, n in enumerate(lengths):
        sv = next(s for s in saves if s["frontier_tokens"] == first[n]["usage"]["input_tokens"])
        rs = restores[i]
        pw, pr = plain_io(state, rs["read_bytes"])
        d2, dc = done[second[n]["id"]], done[cold_r[n]["id"]]
        rows.append({
            "context_tokens": rs["restored_tokens"],
            "checkpoint_bytes": rs["read_bytes"],
            "bytes_per_token": round(rs["read_bytes"] / rs["restored_tokens"], 1),
            "save_s": sv["seconds"], "save_MBps": round(sv["written_bytes"] / sv["seconds"] / 1e6, 1),
            "restore_s": rs["seconds"],
            "restore_MBps": round(rs["read_bytes"] / rs["seconds"] / 1e6, 1),
            "plain_write_MBps": round(pw, 1), "plain_read_MBps": round(pr, 1),
            "restore_ttft_s": d2["ttft_s"], "restore_path": d2["path"],
            "restore_computed_tokens": d2["computed_tokens"],
            "cold_ttft_s": dc["ttft_s"], "cold_computed_tokens": dc["computed_tokens"],
            "ttft_ratio": round(dc["ttft_s"] / d2["ttft_s"], 1),
        })
    print(json.dumps(rows, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
