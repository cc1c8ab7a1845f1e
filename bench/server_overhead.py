"""Server overhead per request: wall time at the client minus the engine's own time.

Starts the real server (CPU lane, embedded model) on a free loopback port, sends N short
non-streaming requests one after another with the OpenAI SDK, and reads the engine's queue,
prefill and decode time of each from the request log. Overhead = client wall time - engine time:
HTTP, JSON, validation, prompt rendering and tokenization, the store write, event hand-off.

    .venv/bin/python bench/server_overhead.py --state-dir DIR [--n 100] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import openai  # noqa: E402

from tests.serverproc import start_server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--out", default="server_overhead.json")
    args = ap.parse_args()
    srv = start_server(Path(args.state_dir))
    try:
        client = openai.OpenAI(base_url=srv.api_url, api_key=srv.key, max_retries=0)
        walls = {}
        for i in range(args.n + 5):
            t0 = time.perf_counter()
            r = client.responses.create(model="tiny", input=f"ping {i}", max_output_tokens=1,
                                        temperature=0)
            if i >= 5:  # the first few warm the compiled shapes
                walls[r.id] = time.perf_counter() - t0
    finally:
        srv.stop()
    engine = {}
    for line in (Path(args.state_dir) / "logs" / "requests.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev["event"] == "request_done" and ev["request_id"] in walls:
            engine[ev["request_id"]] = ev["queue_s"] + ev["prefill_s"] + ev["decode_s"]
    over = np.array([walls[k] - engine[k] for k in engine]) * 1e3
    wall = np.array([walls[k] for k in engine]) * 1e3
    res = {"date": time.strftime("%Y-%m-%d"), "machine": "2-core CPU dev machine",
           "requests": len(over), "overhead_ms_p50": float(np.percentile(over, 50)),
           "overhead_ms_p99": float(np.percentile(over, 99)),
           "wall_ms_p50": float(np.percentile(wall, 50)),
           "wall_ms_p99": float(np.percentile(wall, 99))}
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"{len(over)} requests: overhead p50 {res['overhead_ms_p50']:.1f} ms, p99 "
          f"{res['overhead_ms_p99']:.1f} ms (wall p50 {res['wall_ms_p50']:.1f} ms)")


if __name__ == "__main__":
    main()
