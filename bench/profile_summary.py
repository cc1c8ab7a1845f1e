"""Where the GPU time of a traced JAX program goes, kernel by kernel.

Reads the XSpace that ``jax.profiler.trace`` writes (``*.xplane.pb``) with JAX's own reader
(``jax.profiler.ProfileData``) and sums the device planes' events by name: count, total time,
share of the busy time, plus the span from the first kernel's start to the last one's end and
the time no kernel ran (launch gaps, host waits). Each kernel also gets its time alone on
the device (no other kernel running) and its time overlapped with another: kernels chained
by programmatic dependent launch overlap, and a kernel that gets faster only in its
overlapped part does not shorten the busy time.

    python3 bench/profile_summary.py /tmp/trace_dir [--top 25]
"""
from __future__ import annotations

import argparse
import glob
import os
from collections import defaultdict

from jax.profiler import ProfileData


def newest_xplane(trace_dir: str) -> str:
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    return max(paths, key=os.path.getmtime)


def exposure(events: list[tuple[str, int, int]]) -> dict[str, list[float]]:
    """Per name, [time alone, time overlapped] of (name, start, end) intervals: a sweep over
    their boundaries; a stretch where one interval runs is its alone time, a stretch where
    several run is overlapped time for each of them."""
    marks = sorted([(s, 1, i) for i, (_, s, _) in enumerate(events)]
                   + [(e, -1, i) for i, (_, _, e) in enumerate(events)],
                   key=lambda m: (m[0], m[1]))
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    active: set[int] = set()
    last = None
    for t, kind, i in marks:
        if last is not None and t > last and active:
            seg = t - last
            if len(active) == 1:
                out[events[next(iter(active))][0]][0] += seg
            else:
                for j in active:
                    out[events[j][0]][1] += seg
        last = t
        if kind == 1:
            active.add(i)
        else:
            active.discard(i)
    return out


def summarize(path: str, steps: int = 1) -> dict:
    """Kernel time by name on the device planes, per step when ``steps`` traced steps."""
    data = ProfileData.from_file(path)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    intervals = []
    events: list[tuple[str, int, int]] = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            # one line per stream; XLA's op-level lines repeat the kernels: keep streams only
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                slot = by_name[ev.name]
                slot[0] += 1
                slot[1] += ev.duration_ns
                intervals.append((ev.start_ns, ev.end_ns))
                events.append((ev.name, ev.start_ns, ev.end_ns))
    busy = 0.0
    span = 0.0
    if intervals:
        intervals.sort()
        cur_s, cur_e = intervals[0]
        for s, e in intervals[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        span = max(e for _, e in intervals) - intervals[0][0]
    total = sum(v[1] for v in by_name.values())
    exp = exposure(events)
    rows = sorted(({"kernel": k, "calls": v[0] / steps, "us": v[1] / 1e3 / steps,
                    "share": v[1] / total if total else 0.0,
                    "alone_us": exp[k][0] / 1e3 / steps,
                    "overlapped_us": exp[k][1] / 1e3 / steps} for k, v in by_name.items()),
                  key=lambda r: -r["us"])
    return {"steps": steps, "span_us": span / 1e3 / steps, "busy_us": busy / 1e3 / steps,
            "kernel_us": total / 1e3 / steps, "kernels_per_step": sum(v[0] for v in
                                                                      by_name.values()) / steps,
            "by_kernel": rows}


def table(summary: dict, top: int = 25) -> str:
    out = [f"per step: span {summary['span_us']:.0f} us, busy {summary['busy_us']:.0f} us, "
           f"kernel sum {summary['kernel_us']:.0f} us, {summary['kernels_per_step']:.0f} "
           f"kernels"]
    for r in summary["by_kernel"][:top]:
        out.append(f"  {r['us']:9.1f} us {r['share'] * 100:5.1f}% {r['calls']:7.1f}x "
                   f"alone {r['alone_us']:8.1f} overlapped {r['overlapped_us']:7.1f}  "
                   f"{r['kernel'][:90]}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace_dir")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    print(table(summarize(newest_xplane(args.trace_dir), args.steps), args.top))


if __name__ == "__main__":
    main()
