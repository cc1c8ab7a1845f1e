"""Where a kernel's warps wait, instruction by instruction: the SASS page of an Nsight Compute
report (`ncu --import R.ncu-rep --page source --print-source sass --csv`, as the `ncusrc` part of
bench/h200_session.sh writes it) summed by opcode and listed by its most-sampled instructions.

A warp stalled on a load is sampled at the instruction that waits for the loaded register, so
the instruction that uses a load names the load: in the wide GEMV a `LOP3`/`PRMT` on the codes'
ring registers waits for the codes, the byte permutations of x for x (`PRMT` of the x loads),
an `FFMA` with a scale for the scales, `HMMA` for its operands.

    python bench/ncu_source_summary.py ncusrc_v19.csv [--top 25]

The page's columns differ between ncu versions: the source column and the sampling columns
are found by name ("Source"; "Warp Stall Sampling (All ..." and "(Not-issued ..."; the stall
reasons "stall_<reason>", when the page has them); a report of several launches prints a
header row for each, and the launches of one kernel (its name up to the argument list) are
summed together: the kernel's samples by stall reason, by opcode, and its most-sampled
instructions with their main reasons (long_sb: waiting for a global load's register).
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
    """The page's launches: {title, rows: [(source, all_samples, not_issued, reasons)]}, where
    reasons is a Counter of the row's samples by stall reason (empty without those columns)."""
    out: list[dict] = []
    title, cur = "", None
    for row in csv.reader(open(path, newline="")):
        cells = [c.strip() for c in row]
        if not any(cells):
            continue
        if cells[0] == "Kernel Name":  # a launch's name row: ["Kernel Name", name, ...]
            title, cur = " ".join(c for c in cells[1:] if c), None
            continue
        src = next((i for i, c in enumerate(cells) if c == "Source"), None)
        alls = next((i for i, c in enumerate(cells)
                     if c.startswith("Warp Stall Sampling (All")), None)
        if src is not None and alls is not None:
            ni = next((i for i, c in enumerate(cells)
                       if c.startswith("Warp Stall Sampling (Not")), None)
            reasons = {i: c[len("stall_"):] for i, c in enumerate(cells)
                       if c.startswith("stall_") and "Not Issued" not in c}
            cur = {"title": title, "src": src, "all": alls, "ni": ni, "reasons": reasons,
                   "rows": []}
            out.append(cur)
            continue
        if cur is None or len(cells) <= max(cur["src"], cur["all"]):
            title = " ".join(c for c in cells if c)[:160]  # a kernel's name line, if any
            continue
        ni = _num(cells[cur["ni"]]) if cur["ni"] is not None and cur["ni"] < len(cells) else 0.0
        why = Counter({r: _num(cells[i]) for i, r in cur["reasons"].items()
                       if i < len(cells) and _num(cells[i])})
        cur["rows"].append((cells[cur["src"]], _num(cells[cur["all"]]), ni, why))
    return out


def kernel_name(title: str) -> str:
    """`Kernel Name void <unnamed>::k<(int)2>(const uint4 *, ...)` -> `k<(int)2>`."""
    name = re.sub(r"^Kernel Name\s+", "", title).replace("void ", "").replace("<unnamed>::", "")
    depth = 0
    for i, ch in enumerate(name):  # cut at the argument list's "(" (outside template <>)
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            return name[:i]
    return name


def merged(found: list[dict]) -> dict:
    """Launches of one kernel summed: name -> {rows: [(source, all, not_issued, reasons)]},
    rows in SASS order (launches of one kernel have the same code)."""
    out: dict = {}
    for b in found:
        k = out.setdefault(kernel_name(b["title"]) or "kernel", {"rows": [], "launches": 0})
        k["launches"] += 1
        if not k["rows"]:
            k["rows"] = [(s, n, ni, Counter(w)) for s, n, ni, w in b["rows"]]
            continue
        if len(b["rows"]) != len(k["rows"]):  # other code under one name: listed apart
            out[f"{kernel_name(b['title'])} #{k['launches']}"] = {"rows": b["rows"],
                                                                   "launches": 1}
            continue
        for i, (s, n, ni, w) in enumerate(b["rows"]):
            s0, n0, ni0, w0 = k["rows"][i]
            k["rows"][i] = (s0, n0 + n, ni0 + ni, w0 + w)
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
    for name, k in merged(found).items():
        rows = k["rows"]
        total = sum(r[1] for r in rows) or 1.0
        print(f"== {name}: {k['launches']} launch(es), {len(rows)} instructions, "
              f"{total:.0f} samples")
        reasons: Counter = Counter()
        for r in rows:
            reasons += r[3]
        if reasons:
            rt = sum(reasons.values())
            print("  by stall reason: " + ", ".join(f"{w} {n / rt:.1%}"
                                                    for w, n in reasons.most_common(8)))
        by_op: Counter = Counter()
        for sass, n, _, _ in rows:
            by_op[opcode(sass)] += n
        print("  by opcode: " + ", ".join(f"{op} {n / total:.1%}"
                                           for op, n in by_op.most_common(10)))
        for i, (sass, n, ni, why) in sorted(enumerate(rows), key=lambda t: -t[1][1])[:args.top]:
            main_why = ", ".join(f"{w} {c / (sum(why.values()) or 1):.0%}"
                                 for w, c in why.most_common(2))
            print(f"  {n / total:6.1%} (not issued {ni / total:6.1%})  #{i:<5} {sass[:60]:60s}"
                  f"  {main_why}")

if __name__ == "__main__":
    main()
