"""Trace a few C1 decode steps of the 27B shapes and keep the whole trace (host and device
planes), gzipped, for reading off the GPU: whether the device waits for the host's launches.

    python3 bench/trace_step.py --out $OUT/trace_step.xplane.pb.gz [--steps 3] [--unroll] \
        [--plan h200] [--set field=value,...] [--context 1024] [--width 1[,8,64]]

(--width: tokens a forward, at position --context: 1 is a decode step, more a prefill piece
such as a short new turn's; several widths write a trace each, FILE.wN.xplane.pb.gz.)

(the steps run the kernel plan of --plan, engine/plan.py, default h200, with --set's fields.)

Then, anywhere with jax: `python3 bench/trace_step.py --read FILE` prints the device's busy
and idle time (idle inside a step, in gaps of at most 20 us, and between steps), a histogram
of the short gaps, and how far ahead of the device the host had launched each step's work
(`gap_report`). `--diff A B` compares two traces' longest runs of device work (chained
decode steps) kernel by kernel, a step each (steps counted by a kernel that runs a known
number of times a step: `--marker paged_decode --per-step 16` for the 27B's attention
layers), largest change first (`kernel_diff`).
"""
from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def record(args) -> None:
    from bench.plan_args import plan_from_args, prepare

    plan = plan_from_args(args)
    if args.unroll:
        import dataclasses

        plan = dataclasses.replace(plan, unroll_blocks=True)
    prepare(plan)  # XLA's flags before JAX starts; the CUDA ops registered where it calls them

    import jax
    import jax.numpy as jnp

    from bench.bench_27b import random_paged_cache, random_params
    from bench.profile_summary import newest_xplane
    import engine.model.model as M
    from engine.model.config import QWEN38_27B

    cfg, dt = QWEN38_27B, jnp.bfloat16
    params = random_params(cfg, dt, "int4_g64")
    fwd = M.jit_forward()
    widths = [int(w) for w in str(args.width).split(",")]
    for width in widths:
        # a piece of `width` tokens at position `context` (1: a decode step), run again on
        # the same position each time
        cache = random_paged_cache(cfg, args.context + width, dt, 1)
        tok = jnp.ones((1, width), jnp.int32)
        n = jnp.full((1,), width, jnp.int32)

        def step(c):
            c = c._replace(pos=jnp.full((1,), args.context, jnp.int32))
            logits, _, c = fwd(params, cfg, tok, c, lengths=n, last_only=True, plan=plan)
            jax.block_until_ready(logits)
            return c

        for _ in range(3):
            cache = step(cache)
        out = args.out if len(widths) == 1 else args.out.replace(".xplane", f".w{width}.xplane")
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for _ in range(args.steps):
                    cache = step(cache)
            with open(newest_xplane(d), "rb") as src, gzip.open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
        del cache
        print(f"trace of {args.steps} steps of width {width} at {args.context}: {out} "
              f"({os.path.getsize(out)} bytes)")


def load(path: str):
    """The ProfileData of a gzipped (or plain) xplane file."""
    from jax.profiler import ProfileData

    if not path.endswith(".gz"):
        return ProfileData.from_file(path)
    with tempfile.NamedTemporaryFile(suffix=".xplane.pb") as tmp:
        with gzip.open(path, "rb") as src:
            shutil.copyfileobj(src, tmp)
        tmp.flush()
        return ProfileData.from_file(tmp.name)


def timelines(data) -> tuple[list, list]:
    """(device kernels, host events) as (start_ns, end_ns, name) sorted by start: the GPU's
    compute stream(s), and the events of the host thread that ran the program (the line with
    the most events on the host plane)."""
    dev, host = [], []
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if "Compute" in line.name or line.name.startswith("Stream"):
                    # a copy-only stream; a compute stream may list copies too, e.g.
                    # "Stream #14(MemcpyD2D,Compute,Memset,MemcpyD2H)"
                    if "Memcpy" in line.name and "Compute" not in line.name:
                        continue
                    dev += [(e.start_ns, e.end_ns, e.name) for e in line.events]
        elif plane.name == "/host:CPU":
            best = max(plane.lines, key=lambda ln: len(list(ln.events)), default=None)
            if best is not None:
                host = [(e.start_ns, e.end_ns, e.name) for e in best.events]
    return sorted(dev), sorted(host)


def gap_report(dev: list, host: list, big_us: float = 20.0, program: str = "forward") -> dict:
    """The device's idle time between kernels: in all, in gaps of at most `big_us` (inside a
    step) and in longer ones (between steps: the host's work before its next launch, which
    a pipelined dispatch would hide), a histogram of the short gaps by microsecond, and for
    each call of the jitted `program` how long the device still ran after the host had
    returned from launching it (> 0: the host was ahead, the device bound that call)."""
    short = long_ = 0.0
    hist: dict[int, int] = {}
    end = dev[0][1] if dev else 0
    for s, e, _ in dev[1:]:
        gap = (s - end) / 1e3
        if gap > 0:
            if gap > big_us:
                long_ += gap
            else:
                short += gap
                hist[int(gap)] = hist.get(int(gap), 0) + 1
        end = max(end, e)
    launches = [h for h in host if h[2].startswith("cuGraphLaunch")]
    # each call of the program (host events of that name, nested duplicates dropped): the
    # device work from its first kernel to the next call's, and when the host returned
    calls = sorted({(s, e) for s, e, name in host if name == f"PjitFunction({program})"})
    ahead = []
    for i, (s, e) in enumerate(calls):
        nxt = calls[i + 1][0] if i + 1 < len(calls) else float("inf")
        work = [d for d in dev if s <= d[0] < nxt]
        if work:
            ahead.append((max(d[1] for d in work) - e) / 1e3)
    span = (dev[-1][1] - dev[0][0]) / 1e3 if dev else 0.0
    busy = span - short - long_
    return {"kernels": len(dev), "span_us": span, "busy_us": busy, "idle_short_us": short,
            "idle_long_us": long_, "short_gap_histogram_us": dict(sorted(hist.items())),
            "graph_launches": len(launches), "host_ahead_us": ahead}


def split_runs(dev: list, gap_us: float = 100.0) -> list[list]:
    """The kernels of `dev` split where the device idles longer than `gap_us`."""
    runs, cur, end = [], [], None
    for ev in dev:
        if cur and (ev[0] - end) / 1e3 > gap_us:
            runs.append(cur)
            cur = []
        end = ev[1] if not cur else max(end, ev[1])
        cur.append(ev)
    if cur:
        runs.append(cur)
    return runs


def busy_runs(dev: list, gap_us: float = 100.0) -> list[dict]:
    """The device's runs of work: kernels split where the device idles longer than `gap_us`
    (a run of chained decode steps is one run); each with its start, span, busy time (the
    union of its kernels) and kernel count, in microseconds."""
    out = []
    for run in split_runs(dev, gap_us):
        busy, end = 0.0, run[0][0]
        for s, e, _ in run:
            busy += max(0, e - max(s, end))
            end = max(end, e)
        out.append({"start_us": (run[0][0] - dev[0][0]) / 1e3,
                    "span_us": (end - run[0][0]) / 1e3, "busy_us": busy / 1e3,
                    "kernels": len(run)})
    return out


def kernel_table(dev: list, steps: int = 1) -> list[tuple[str, float, float]]:
    """(kernel name up to its first "(", us a step, calls a step), largest first: the device's
    time by kernel over `steps` steps."""
    time_, calls = {}, {}
    for s, e, name in dev:
        key = name.split("(")[0].strip()[:80] or name[:80]
        time_[key] = time_.get(key, 0.0) + (e - s) / 1e3
        calls[key] = calls.get(key, 0) + 1
    return sorted(((k, t / steps, calls[k] / steps) for k, t in time_.items()),
                  key=lambda r: -r[1])


def longest_run(dev: list, gap_us: float = 100.0) -> list:
    """The kernels of the longest run of device work (`split_runs`), as in `dev`."""
    return max(split_runs(dev, gap_us), key=len, default=[])


def kernel_diff(dev_a: list, dev_b: list, marker: str = "paged_decode",
                per_step: int = 1) -> dict:
    """Two traces' longest runs a step each: steps = the calls of kernels named with `marker`
    over `per_step`; {"steps": (a, b), "total_us": (a, b), "kernels": (a, b) a step, "rows":
    [(name, us a step in a, in b, calls a step in a, in b)], largest |b - a| first}."""
    out = {"steps": [], "total_us": [], "kernels": []}
    tables = []
    for dev in (dev_a, dev_b):
        run = longest_run(dev)
        steps = sum(1 for e in run if marker in e[2]) / per_step
        if not steps:
            raise ValueError(f"no kernel named with {marker!r} in the longest run")
        table = {k: (t, c) for k, t, c in kernel_table(run, steps)}
        out["steps"].append(steps)
        out["total_us"].append(sum(t for t, _ in table.values()))
        out["kernels"].append(len(run) / steps)
        tables.append(table)
    a, b = tables
    names = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0]))
    out["rows"] = [(k, a.get(k, (0.0, 0.0))[0], b.get(k, (0.0, 0.0))[0], a.get(k, (0.0, 0.0))[1],
                    b.get(k, (0.0, 0.0))[1]) for k in names]
    return out


def diff(a: str, b: str, marker: str, per_step: int, top: int = 30) -> None:
    d = kernel_diff(timelines(load(a))[0], timelines(load(b))[0], marker, per_step)
    print(f"steps {d['steps'][0]:g} / {d['steps'][1]:g}; kernel time a step "
          f"{d['total_us'][0]:.0f} / {d['total_us'][1]:.0f} us; kernels a step "
          f"{d['kernels'][0]:.0f} / {d['kernels'][1]:.0f}")
    print(f"{'us a':>8} {'us b':>8} {'b - a':>8} {'calls a':>7} {'calls b':>7}  kernel")
    for name, ta, tb, ca, cb in d["rows"][:top]:
        print(f"{ta:8.1f} {tb:8.1f} {tb - ta:+8.1f} {ca:7.1f} {cb:7.1f}  {name}")


def read(path: str) -> None:
    dev, host = timelines(load(path))
    runs = busy_runs(dev)
    longest = max(runs, key=lambda r: r["kernels"])
    print(f"longest run of device work: {longest['kernels']} kernels, busy "
          f"{longest['busy_us']:.0f} of {longest['span_us']:.0f} us "
          f"({longest['busy_us'] / max(longest['span_us'], 1e-9):.1%})")
    rep = gap_report(dev, host)
    print(f"{rep['kernels']} kernels in {rep['span_us']:.0f} us: busy {rep['busy_us']:.0f}, "
          f"idle in gaps <= 20 us {rep['idle_short_us']:.0f}, in longer gaps "
          f"{rep['idle_long_us']:.0f}; {rep['graph_launches']} graph launches")
    print("short gaps (us: count):", rep["short_gap_histogram_us"])
    print("device time after the host returned from each forward call (us):",
          [round(a) for a in rep["host_ahead_us"]])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="trace_step.xplane.pb.gz")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--width", default="1", help="tokens a traced forward: 1 (a decode "
                    "step) or a prefill piece's width; several, comma-separated, a trace each")
    ap.add_argument("--unroll", action="store_true")
    from bench.plan_args import add_plan_args

    add_plan_args(ap, "h200", "the traced steps run")
    ap.add_argument("--read", default="")
    ap.add_argument("--diff", nargs=2, default=None, metavar=("A", "B"))
    ap.add_argument("--marker", default="paged_decode")
    ap.add_argument("--per-step", type=int, default=16)
    args = ap.parse_args()
    if args.diff:
        diff(*args.diff, args.marker, args.per_step)
    elif args.read:
        read(args.read)
    else:
        record(args)


if __name__ == "__main__":
    main()
