"""Charts of a bench_27b result against its roofline and the goals (PNG, matplotlib).

  python bench/plot_27b.py docs/benchmarks/bench_27b_v3_pallas.json \
      --peer docs/benchmarks/peer_hf_fla_v3.json --out docs/benchmarks/bench_27b_v3.png

With --engine FILE (a bench/engine_27b.py result), the decode bars are the serving engine's
steady rates (C1 from its engine of one row, C2 from its engine of two; --variant picks one of
its --variants) against the rooflines of the positional result's rows of the same batch and
context (its bytes a step over its measured copy rate); prefill still comes from the
positional result (or --prefill-from).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def engine_rows(eng: dict, res: dict, variant: str = "") -> list[dict]:
    """The engine result's C1 rows (engine of one row) and C2 rows (engine of two) as decode
    rows: steady tokens/s and the roofline of `res`'s row of the same batch and context."""
    roof = {(r["batch"], r["context"]): r["roofline_tokens_per_s"] for r in res["decode"]}
    rows = []
    for s in eng["summary"]:
        if (s.get("variant", "") != variant or s.get("narrow") or s["batch"] != s["concurrency"]
                or (s["batch"], s["context"]) not in roof):
            continue
        rows.append({"weights": eng["weights"].split()[-1], "batch": s["concurrency"],
                     "context": s["context"], "tokens_per_s": s["steady_tokens_per_s_median"],
                     "roofline_tokens_per_s": roof[(s["batch"], s["context"])]})
    if not rows:
        raise SystemExit(f"no C1/C2 rows of variant {variant!r} with a roofline in the result")
    return sorted(rows, key=lambda r: (r["batch"], r["context"]))


def run_plan(res: dict) -> str:
    """What the result's forward ran: its kernel plan (preset, else digest prefix), or the
    `kernels` string of a result from before kernel plans."""
    if "plan" in res:
        p = res["plan"]
        return f"plan={p.get('preset') or p.get('digest', '?')[:8]}"
    return f"kernels={res.get('kernels', '?')}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("result")
    ap.add_argument("--peer")
    ap.add_argument("--prefill-from", help="take the prefill rows from this result instead (a "
                    "decode-only run charted beside the last prefill run)")
    ap.add_argument("--engine", help="decode from this engine_27b.py result instead")
    ap.add_argument("--variant", default="", help="the engine result's variant to chart")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = json.loads(Path(args.result).read_text())
    peer = json.loads(Path(args.peer).read_text()) if args.peer else None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    rows = engine_rows(json.loads(Path(args.engine).read_text()), res, args.variant) \
        if args.engine else res["decode"]
    labels = [f"{r['weights'].replace('_g64', '')}\nC{r['batch']} {r['context'] // 1024}K"
              for r in rows]
    x = range(len(rows))
    ax1.bar(x, [r["roofline_tokens_per_s"] for r in rows], color="#ddd", label="HBM roofline")
    ax1.bar(x, [r["tokens_per_s"] for r in rows], color="#3a7", label="measured (aggregate)")
    if peer:
        for r in peer["runs"]:
            if r["context"] in (1024, 32768):
                ax1.axhline(r["decode_tokens_per_s"], color="#c44", ls=":", lw=1)
        ax1.plot([], [], color="#c44", ls=":", label="peer HF+fla C1 (1K, 32K)")
    ax1.axhline(240, color="#333", ls="--", lw=1, label="goal int4 C1 240 tok/s")
    ax1.set_xticks(list(x), labels, fontsize=7)
    ax1.set_ylabel("tokens/s")
    ax1.set_title(f"decode, {run_plan(res)}, {res['device']}" + (
        f"\nthrough the engine, steady: {Path(args.engine).name}" if args.engine else ""))
    ax1.legend(fontsize=7)
    pre_res = json.loads(Path(args.prefill_from).read_text()) if args.prefill_from else res
    rows = [r for r in pre_res["prefill"] if "seconds" in r]
    # one weight format's rows: bf16 where the run has them, else the format it prefilled from
    fmt = "bf16" if any(r.get("weights", "bf16") == "bf16" for r in rows) else (
        rows[0]["weights"] if rows else "bf16")
    pre = [r for r in rows if r.get("weights", "bf16") == fmt]
    px = range(len(pre))
    ax2.bar(px, [r["seconds"] for r in pre], color="#37a", label="measured")
    ax2.bar(px, [r["floor_seconds"] for r in pre], color="#ddd", width=0.4,
            label="FLOP floor at measured bf16 rate")
    goals = {8192: 0.7, 131072: 22.0}
    for i, r in enumerate(pre):
        if r["tokens"] in goals:
            ax2.plot([i - 0.4, i + 0.4], [goals[r["tokens"]]] * 2, color="#333", ls="--")
    if peer:
        for r in peer["runs"]:
            for i, p in enumerate(pre):
                if p["tokens"] == r["context"]:
                    ax2.plot([i - 0.4, i + 0.4], [r["prefill_s"]] * 2, color="#c44", ls=":")
    ax2.plot([], [], color="#333", ls="--", label="goal")
    ax2.plot([], [], color="#c44", ls=":", label="peer HF+fla")
    ax2.set_xticks(list(px), [f"{r['tokens'] // 1024}K" for r in pre])
    ax2.set_yscale("log")
    ax2.set_ylabel("seconds")
    ax2.set_title(f"prefill ({fmt} weights)" + (f", from {Path(args.prefill_from).name}"
                                               if args.prefill_from else ""))
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
