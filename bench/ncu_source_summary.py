"""Where a kernel's warps wait, instruction by instruction: the SASS page of an Nsight Compute
report (`ncu --import R.ncu-rep --page source --print-source sass --csv`, as the `ncusrc` part of
bench/h200_session.sh writes it) summed by opcode and listed by its most-sampled instructions.

A warp stalled on a load is sampled at the instruction that waits for the loaded register, so
the instruction that uses a load names the load: in the wide GEMV a `LOP3`/`PRMT` on the codes'
ring registers waits for the codes, the byte permutations of x for x (`PRMT` of the x loads),
an `FFMA` with a scale for the scales, `HMMA` for its operands.

    python bench/ncu_source_summary.py ncusrc_v19.csv [--top 25]

The page's columns differ between ncu versions: the source column and the sampling columns
are found by name ("Source"; "Warp Stall Sampling (All ..." and "(Not-issued ..."); a
report of several kernels prints a header row for each, and each is summed apart.
"""
from __future__ import annotations

import argparse
import csv
import re
from collections import Counter


def _num(cell: str) -> float:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


def blocks(path: str) -> list[dict]:
    """The page's kernels: {title, rows: [(source, all_samples, not_issued)]}."""
    out: list[dict] = []
    title, cur = "", None
    for row in csv.reader(open(path, newline="")):
        cells = [c.strip() for c in row]
        if not any(cells):
            continue
        src = next((i for i, c in enumerate(cells) if c == "Source"), None)
        alls = next((i for i, c in enumerate(cells)
                     if c.startswith("Warp Stall Sampling (All")), None)
        if src is not None and alls is not None:
            ni = next((i for i, c in enumerate(cells)
                       if c.startswith("Warp Stall Sampling (Not")), None)
            cur = {"title": title, "src": src, "all": alls, "ni": ni, "rows": []}
            out.append(cur)
            continue
        if cur is None or len(cells) <= max(cur["src"], cur["all"]):
            title = " ".join(c for c in cells if c)[:160]  # a kernel's name line, if any
            continue
        ni = _num(cells[cur["ni"]]) if cur["ni"] is not None and cur["ni"] < len(cells) else 0.0
        cur["rows"].append((cells[cur["src"]], _num(cells[cur["all"]]), ni))
    return out


def opcode(sass: str) -> str:
    """`@!P0 LDG.E.128.CONSTANT R4, desc[UR6][R2.64]` -> `LDG.E.128.CONSTANT`."""
    words = re.sub(r"^@!?U?P\w+\s+", "", sass.strip()).split()
    return words[0].rstrip(";") if words else "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    found = blocks(args.csv)
    if not found:
        print("no SASS page with stall sampling columns in", args.csv)
        return
    for b in found:
        total = sum(r[1] for r in b["rows"]) or 1.0
        print(f"== {b['title'] or 'kernel'}: {len(b['rows'])} instructions, "
              f"{total:.0f} samples")
        by_op: Counter = Counter()
        for sass, n, _ in b["rows"]:
            by_op[opcode(sass)] += n
        print("  by opcode: " + ", ".join(f"{op} {n / total:.1%}"
                                           for op, n in by_op.most_common(10)))
        for i, (sass, n, ni) in sorted(enumerate(b["rows"]), key=lambda t: -t[1][1])[:args.top]:
            print(f"  {n / total:6.1%} (not issued {ni / total:6.1%})  #{i:<5} {sass[:90]}")


if __name__ == "__main__":
    main()
