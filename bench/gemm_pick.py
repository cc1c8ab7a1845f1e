"""The widest piece (M) at which the int4 GEMM's default config beat the dequantize + matmul
reference on every shape of a gemm_micro.py run: prints it (0 if at none), for a kernel plan's
`int4_gemm_rows` (engine/plan.py; a lane profile's [plan] table, or a benchmark's --set).

  python3 bench/bench_27b.py --plan h200 --set int4_gemm_rows=$(python3 bench/gemm_pick.py \
      gemm_micro.json) ...
"""
from __future__ import annotations

import json
import sys


def pick(res: dict, config: list | None = None) -> int:
    rows = [r for r in res["rows"] if config is None or r["config"] == config]
    if config is None and rows:
        first = rows[0]["config"]  # the micro times its default config first
        rows = [r for r in rows if r["config"] == first]
    best = 0
    for m in sorted({r["m"] for r in rows}):
        at = [r for r in rows if r["m"] == m]
        if at and all(r["speedup"] > 1.0 for r in at):
            best = m
        else:
            break
    return best


if __name__ == "__main__":
    print(pick(json.loads(open(sys.argv[1]).read())))
