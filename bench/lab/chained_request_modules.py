"""Which product modules one chained `POST /v1/responses` runs code in (docs/ARCHITECTURE.md's
count): the real server in this process on the cpu lane, a first turn, then a profile hook on
every thread while the second turn (previous_response_id, streamed) runs; prints each module
under engine/, server/ and lanes/ that had a function called, with its call count (with
--functions, each function).

    .venv/bin/python bench/lab/chained_request_modules.py [--state-dir /tmp/crm] [--functions]
"""
from __future__ import annotations

import argparse
import collections
import shutil
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", default="/tmp/ninfer-chained-modules")
    ap.add_argument("--functions", action="store_true", help="count each function apart")
    ap.add_argument("--settle", type=float, default=15.0,
                    help="seconds between the first turn and the measured one, so that the "
                         "start's background work (executables saved to the store) is done")
    a = ap.parse_args()
    import httpx

    from tests.serverproc import start_server

    shutil.rmtree(a.state_dir, ignore_errors=True)
    srv = start_server(Path(a.state_dir), "--checkpoints", "off")
    srv.stop()  # the state dir (keys, compiled code) is made; now run the server in-process
    import server.cli as cli

    port = 18999
    key = srv.key
    calls: collections.Counter = collections.Counter()
    roots = tuple(str(REPO / d) for d in ("engine", "server", "lanes"))
    on = threading.Event()

    def prof(frame, event, arg):
        if event == "call" and on.is_set():
            f = frame.f_code.co_filename
            if f.startswith(roots):
                mod = str(Path(f).relative_to(REPO))
                calls[f"{mod}::{frame.f_code.co_name}" if a.functions else mod] += 1

    def client():
        import os

        try:
            run_client()
        finally:
            os._exit(0)

    def run_client():
        base = f"http://127.0.0.1:{port}/v1"
        h = {"Authorization": f"Bearer {key}"}
        for _ in range(1200):
            try:
                if httpx.get(base + "/models", headers=h, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        model = httpx.get(base + "/models", headers=h, timeout=5).json()["data"][0]["id"]
        first = httpx.post(base + "/responses", headers=h, timeout=300,
                           json={"model": model, "input": "hello",
                                 "max_output_tokens": 8}).json()
        time.sleep(a.settle)
        on.set()
        with httpx.stream("POST", base + "/responses", headers=h, timeout=300,
                          json={"model": model, "input": "and then?", "max_output_tokens": 8,
                                "previous_response_id": first["id"], "stream": True}) as r:
            for _ in r.iter_lines():
                pass
        on.clear()
        for mod, n in sorted(calls.items()):
            print(f"{n:>7}  {mod}", flush=True)
        print(f"{len({k.split('::')[0] for k in calls})} modules", flush=True)

    threading.setprofile(prof)
    sys.setprofile(prof)
    threading.Thread(target=client, daemon=True).start()
    cli.main(["serve", "--state-dir", a.state_dir, "--port", str(port), "--checkpoints", "off"])
    return 1


if __name__ == "__main__":
    sys.exit(main())
