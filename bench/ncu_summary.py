"""One line per kernel launch of an Nsight Compute CSV (`ncu --csv`, as the `ncu` part of
bench/h200_session.sh writes it): grid, block, duration, DRAM throughput, waves, occupancy and
issue figures, the last launch of each run of same-shaped launches only (the warm one).

    python bench/ncu_summary.py ncu_gemv_v13.csv
"""
from __future__ import annotations

import csv
import sys

COLUMNS = [("Duration", "us", 1e-3), ("DRAM Throughput", "dram%", 1),
           ("Waves Per SM", "waves", 1), ("Achieved Occupancy", "occ%", 1),
           ("Registers Per Thread", "regs", 1), ("Issue Slots Busy", "issue%", 1),
           ("Warp Cycles Per Issued Instruction", "cyc/inst", 1),
           ("Eligible Warps Per Scheduler", "eligible", 1)]


def launches(path: str) -> list[dict]:
    rows = list(csv.reader(open(path, newline="")))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    h = rows[head]
    col = {name: h.index(name) for name in ("ID", "Kernel Name", "Grid Size", "Block Size",
                                            "Metric Name", "Metric Value")}
    out: dict[int, dict] = {}
    for r in rows[head + 1:]:
        if len(r) <= col["Metric Value"]:
            continue
        one = out.setdefault(int(r[col["ID"]]), {
            "kernel": r[col["Kernel Name"]], "grid": r[col["Grid Size"]],
            "block": r[col["Block Size"]]})
        one[r[col["Metric Name"]]] = r[col["Metric Value"]].replace(",", "")
    return [out[i] for i in sorted(out)]


STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


def top_stalls(r: dict, n: int = 4) -> str:
    """The launch's n largest stall reasons (cycles a warp waits per issued instruction, by
    reason), where the CSV has the per-issue stall metrics (the `ncu` part asks for them)."""
    found = []
    for name, value in r.items():
        if name.startswith(STALL[0]) and name.endswith(STALL[1]):
            try:
                found.append((float(value), name[len(STALL[0]):-len(STALL[1])]))
            except ValueError:
                continue
    found.sort(reverse=True)
    return ", ".join(f"{why} {v:.2f}" for v, why in found[:n])


def main() -> None:
    rows = launches(sys.argv[1])
    print(f"{'grid':>14} {'block':>12} " + " ".join(f"{c[1]:>8}" for c in COLUMNS))
    for i, r in enumerate(rows):
        nxt = rows[i + 1] if i + 1 < len(rows) else None
        if nxt and (nxt["grid"], nxt["block"], nxt["kernel"]) == (r["grid"], r["block"],
                                                                  r["kernel"]):
            continue  # a warm-up or repeat: the run's last launch stands for it
        vals = []
        for name, _, scale in COLUMNS:
            try:
                vals.append(f"{float(r[name]) * scale:8.2f}")
            except (KeyError, ValueError):
                vals.append(f"{'-':>8}")
        print(f"{r['grid']:>14} {r['block']:>12} " + " ".join(vals))
        stalls = top_stalls(r)
        if stalls:
            print(f"{'':>27} stalls per issued instruction: {stalls}")


if __name__ == "__main__":
    main()
