"""A lane served for real, measured from outside: the H200 issue's runs 2 (lane and planner) and
5 (keep-warm), each one command that prints a table and writes JSON.

    python3 bench/lane_server.py memory --lane h200 --out lane_memory.json
        serve --lane L --synthetic-weights through the preflight; the planner's device bytes
        against what the device reports after load (the KV pool is allocated whole at start, so
        "after load" is "at full KV"), and after a prompt of --tokens; ./ninfer plan's table
    python3 bench/lane_server.py keepwarm --lane h200 --idle 10,30,60 --out keep_warm.json
        time to first token of a short turn after each idle gap, keep-warm as the lane has it
        and off (a copy of the profile with window_ms = 0), outputs compared byte for byte

Both run on the CPU lane too (`--lane cpu`, no device figures; keep-warm is a no-op there).
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.suites import commit, machine  # noqa: E402
from tests.serverproc import start_server  # noqa: E402


def _status(srv) -> dict:
    return httpx.get(srv.api_url + "/ninfer/status", timeout=60,
                     headers={"Authorization": f"Bearer {srv.key}"}).json()


def _turn(srv, model: str, text: str, tokens: int) -> dict:
    t0 = time.perf_counter()
    first, out = None, []
    with httpx.stream("POST", srv.api_url + "/responses", timeout=900,
                      headers={"Authorization": f"Bearer {srv.key}"},
                      json={"model": model, "input": text, "max_output_tokens": tokens,
                            "temperature": 0, "stream": True, "store": False}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"response.output_text.delta"' in line:
                first = first or time.perf_counter()
                out.append(json.loads(line[6:])["delta"])
    return {"ttft_s": None if first is None else first - t0, "text": "".join(out)}


def memory(a) -> dict:
    srv = start_server(Path(a.state_dir), "--lane", a.lane, "--synthetic-weights",
                       "--checkpoints", "off", timeout=1200)
    try:
        st = _status(srv)
        after_load = st["device_memory"]
        model = st["model"]["id"]
        words = " ".join(f"item_{i % 997}" for i in range(a.tokens // 2))
        _turn(srv, model, words, 4)
        after_prompt = _status(srv)["device_memory"]
    finally:
        srv.stop()
    plan = subprocess.run([sys.executable, "-m", "server.cli", "plan", "--lane", a.lane],
                          cwd=REPO, capture_output=True, text=True)
    res = {"lane": a.lane, "synthetic_weights": st["model"]["synthetic_weights"],
           "plan": st.get("plan"),
           "after_load": after_load, "after_prompt": after_prompt,
           "plan_table": plan.stdout, "plan_rc": plan.returncode}
    if after_load and after_load.get("bytes_in_use"):
        for k, d in (("after_load", after_load), ("after_prompt", after_prompt)):
            res[f"{k}_over_plan"] = d["peak_bytes_in_use"] / d["planned_bytes"]
    print(plan.stdout)
    for k in ("after_load", "after_prompt"):
        print(f"{k}: {json.dumps(res[k])}; peak/planned "
              f"{res.get(k + '_over_plan', float('nan')):.3f}")
    return res


def keepwarm(a) -> dict:
    from lanes.profile import PROFILE_DIR

    src = Path(a.lane) if Path(a.lane).suffix else PROFILE_DIR / f"{a.lane}.toml"
    off = Path(a.state_dir) / "keep-warm-off.toml"
    off.parent.mkdir(parents=True, exist_ok=True)
    text = src.read_text()
    text, n = re.subn(r"(?m)^window_ms = \d+$", "window_ms = 0", text)
    if n == 0:
        text += "\n[keep_warm]\nwindow_ms = 0\n"
    off.write_text(text)
    idles = [float(x) for x in a.idle.split(",") if x]
    res = {"lane": a.lane, "idle_s": idles, "runs": {}}
    for name, lane in (("on", str(src)), ("off", str(off))):
        srv = start_server(Path(a.state_dir) / name, "--lane", lane, "--synthetic-weights",
                           "--checkpoints", "off", timeout=1200)
        try:
            st = _status(srv)
            model = st["model"]["id"]
            res.setdefault("plan", st.get("plan"))
            _turn(srv, model, "warm up", 4)
            rows = []
            for gap in idles:
                time.sleep(gap)
                r = _turn(srv, model, "Summarise the change in one line.", a.tokens)
                rows.append({"idle_s": gap, **r})
                print(f"keep-warm {name}: after {gap:>5.0f} s idle TTFT {r['ttft_s']:.4f} s",
                      flush=True)
            res["runs"][name] = rows
        finally:
            srv.stop()
    res["identical_outputs"] = all(x["text"] == y["text"] for x, y in
                                   zip(res["runs"]["on"], res["runs"]["off"]))
    print(f"outputs identical on and off: {res['identical_outputs']}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("memory", "keepwarm"))
    ap.add_argument("--lane", default="h200")
    ap.add_argument("--state-dir", default="/tmp/ninfer-lane-bench")
    ap.add_argument("--tokens", type=int, default=8192, help="memory: the prompt; keepwarm: "
                    "the output tokens of each turn")
    ap.add_argument("--idle", default="10,30,60")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.what == "keepwarm" and a.tokens == 8192:
        a.tokens = 16
    res = {"memory": memory, "keepwarm": keepwarm}[a.what](a)
    res.update({"command": "bench/lane_server.py " + " ".join(argv or sys.argv[1:]),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {**machine(), "node": platform.node()}, "commit": commit()})
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
