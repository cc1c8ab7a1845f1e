"""Chart of a bench/chain_lab.cu run (its JSON lines): each form's time for the C1 step's
GEMVs against the read ceiling of the same bytes (PNG, matplotlib).

  python bench/plot_chain.py docs/benchmarks/chain_lab_v30.jsonl --engine-us 6387 \
      --out docs/benchmarks/chain_lab_v30.png

--engine-us draws the engine's own time for the same GEMVs (a trace's sum of its GEMV
kernels) as a second line, for the body's comparison.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def forms(path: Path) -> tuple[dict, list[dict]]:
    """The run's setup record and its timed forms (the read ceiling first)."""
    setup, times = {}, []
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r["kind"] == "setup":
            setup = r
        elif r["kind"] == "time":
            times.append(r)
    if not times or times[0]["variant"] != "read ceiling":
        raise SystemExit(f"{path}: no read ceiling record first; not a chain_lab run")
    return setup, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--engine-us", type=float, default=0.0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    setup, times = forms(a.result)
    ceiling = times[0]["us"]
    rows = times[1:]
    labels = [f"{r['variant']}\n{r['ring_steps']} steps in flight a warp" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 2.2))
    y = range(len(rows))
    ax.barh(list(y), [r["us"] / 1000 for r in rows], color="#4477aa")
    for i, r in enumerate(rows):
        ax.text(r["us"] / 1000 + 0.1, i, f"{r['us'] / 1000:.2f} ms ({r['of_ceiling']:.0%})",
                va="center", fontsize=8)
    ax.axvline(ceiling / 1000, color="#228833", ls="--",
               label=f"read ceiling of the same bytes {ceiling / 1000:.2f} ms")
    if a.engine_us:
        ax.axvline(a.engine_us / 1000, color="#ee6677", ls=":",
                   label=f"the engine's GEMVs, same bytes {a.engine_us / 1000:.2f} ms")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms for the step's GEMVs")
    gb = setup.get("bytes", 0) / 1e9
    ax.set_title(f"{setup.get('gemvs', '?')} int4 GEMVs, {gb:.1f} GB, "
                 f"{setup.get('device', '')}: one body, several forms", fontsize=10)
    ax.set_xlim(0, max(r["us"] for r in rows) / 1000 * 1.25)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
