"""The hardening run: the API fuzzed with 10,000 cases (tests/fuzz_api.py) and a load of chained
clients (tests/load_run.py), each against a real server of the cpu lane, into
docs/benchmarks/hardening_fuzz_load.json (the command, date, machine and commit with them).

    .venv/bin/python -m bench.hardening_fuzz_load [--cases 10000] [--clients 32] [--turns 10]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.suites import commit, machine

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "benchmarks" / "hardening_fuzz_load.json"
BATCH = 40


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from engine.io.loader import embedded_pin, ensure_embedded
    from tests.load_run import run_load
    from tests.serverproc import start_server
    from tests.test_fuzz_api import run_fuzz
    from tests.test_load import tight_lane

    root = Path(tempfile.mkdtemp(prefix="ninfer-hardening-"))
    ensure_embedded(root / "shared", "tiny", embedded_pin("tiny"))
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    fuzz_dir = root / "fuzz"
    fuzz_dir.mkdir()
    (fuzz_dir / "models").symlink_to(root / "shared" / "models")
    srv = start_server(fuzz_dir)
    try:
        fz = run_fuzz(srv.base_url, srv.key, batches=args.cases // BATCH, batch_size=BATCH,
                      at=4646)
    finally:
        srv.stop()
    fuzz = {**fz.summary(), "failure_samples": fz.failures[:10]}
    print(json.dumps(fuzz), flush=True)

    load_dir = root / "load"
    load_dir.mkdir()
    (load_dir / "models").symlink_to(root / "shared" / "models")
    srv = start_server(load_dir, "--lane", str(tight_lane(load_dir)))
    try:
        load = run_load(srv.base_url, srv.key, clients=args.clients, turns=args.turns)
    finally:
        srv.stop()
    print(json.dumps(load), flush=True)

    res = {"suite": "hardening_fuzz_load",
           "command": " ".join([".venv/bin/python -m bench.hardening_fuzz_load", *argv]),
           "date": started, "machine": machine(), "commit": commit(),
           "fuzz": {"server": "cpu lane (tiny model), 4 clients at a time",
                    "batch_size": BATCH, **fuzz},
           "load": {"server": "cpu lane, max_concurrency 2, max_queue 4, context 4096",
                    "latency_note": "seconds from the accepted attempt's request to its "
                                    "last byte; shed attempts waited Retry-After (<= 2 s)",
                    **load}}
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    ok = fuzz["fivexx"] == 0 and not fuzz["failures"] and not load["problems"] \
        and load["retrievable"] == load["requests_acknowledged"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
