r"""Where a server's start goes, piece by piece, on the machine it runs on: the compile of each
prefill width and the decode step (trace, lower, compile, with the persistent compilation
cache cold and warm) and the copy of an artifact's weights to the device against the rates
beneath it (reading the page cache, host-to-device copies). No server.

    # on the H200 (writes the 27B's synthetic artifact into --work-dir first: ~17 GB, ~45 s)
    python3 bench/startup_micro.py --work-dir /tmp/r27 --out startup_micro.json
    # on a CPU, the tiny shapes
    .venv/bin/python bench/startup_micro.py --preset tiny --prefill-chunk 256 \
        --context 4096 --plan reference --work-dir /tmp/sm --out /tmp/sm.json

The engine runs the kernel plan of --plan (engine/plan.py; default h200) with --set's fields;
each part's process sets the plan's XLA flags before JAX starts, as the server does.

Parts (each in a fresh process, so nothing is cached in memory between them):
- `compile_cold` / `compile_warm`: Engine.compile() as the server calls it (its thread pool),
  on an empty and then on the warm persistent cache, in the server's configuration
  (server/cli.py's cache settings, the lane's context, chunk and batch); then
  `compile_store_first` / `compile_store_warm` with an executable store
  (engine/runtime/exec_store.py): the first stores every width (compiled afresh past JAX's
  cache on its background thread, `background_save_s`), the second loads them.
- `widths_warm`: every width alone, one after the other, warm: jit trace, lower, compile
  (a cache hit: key + load of the executable).
- `load`: ModelLoad's copy pass (the artifact's stacked leaves built on the host and put on
  the device, verification skipped as a warm start's stamp does) on the loader's threads and
  on 8 and 16, then the rates beneath it: the artifact read from the page cache into memory
  on 1 and 8 threads, one 1 GiB host array put on the device (pageable, and from pinned host
  memory), 8 such puts at once, and 16 puts of 512 MiB through pinned host memory twice (is
  freed pinned memory reused?).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GiB = 1 << 30


def _setup_cache(cache_dir: str) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _plan(args):
    from bench.plan_args import plan_from_args

    return plan_from_args(args)


def _prepare(args) -> None:
    """The plan's XLA flags, before JAX starts its backend (server/cli.py does the same)."""
    from engine.plan import apply_process_settings

    apply_process_settings(_plan(args))


def _engine(args, loading):
    from engine.engine import Engine

    return Engine(loading.abstract, context_tokens=args.context, prefill_chunk=args.prefill_chunk,
                  max_concurrency=args.batch, max_queue=4, queue_timeout_s=60.0,
                  capacity_tokens=args.context * args.batch, state_slots=4,
                  host_state_bytes=0, plan=_plan(args))


def part_compile(args) -> dict:
    """Engine.compile() as the server runs it, its seconds and the process's before it."""
    t0 = time.monotonic()
    _setup_cache(args.cache_dir)
    import jax

    from engine.io.loader import start_load

    jax.devices()
    t_init = time.monotonic() - t0
    loading = start_load(Path(args.artifact), compute_dtype=args.compute_dtype,
                         kv_dtype=args.compute_dtype, verify="full")
    eng = _engine(args, loading)
    t_engine = time.monotonic() - t0 - t_init
    store = None
    if args.exec_store:
        import secrets

        from engine.runtime.exec_store import ExecStore

        key = Path(args.exec_store) / "secret"
        if not key.exists():
            Path(args.exec_store).mkdir(parents=True, exist_ok=True)
            key.write_bytes(secrets.token_bytes(32))
        store = ExecStore(Path(args.exec_store), key.read_bytes())
    compile_s = eng.compile(store=store)
    t = time.monotonic()
    if eng.exec_saving is not None:
        eng.exec_saving.join()
    loading._art.close()
    return {"jax_init_s": round(t_init, 3), "abstract_and_engine_s": round(t_engine, 3),
            "compile_s": round(compile_s, 3), **{f"exec_{k}": v for k, v in
                                                   eng.exec_counts.items()},
            "background_save_s": round(time.monotonic() - t, 3)}


def part_widths(args) -> dict:
    """Each width alone, in turn: trace, lower, compile."""
    _setup_cache(args.cache_dir)
    import jax
    import jax.numpy as jnp

    plan = _plan(args)
    if plan.uses_cuda:  # the CUDA ops' FFI targets registered before a compile calls them
        from engine.kernels import cuda_ops

        cuda_ops.require(plan)

    from engine.io.loader import start_load
    import engine.model.model as M
    from engine.runtime.scheduler import piece_widths

    loading = start_load(Path(args.artifact), compute_dtype=args.compute_dtype,
                         kv_dtype=args.compute_dtype, verify="full")
    eng = _engine(args, loading)
    cfg = eng.model.cfg
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), eng.model.params)
    cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), eng.mem.cache)
    zero = jax.ShapeDtypeStruct((eng.B,), jnp.int32)
    fwd = M.jit_forward()
    rows = []
    for w in piece_widths(args.prefill_chunk) + [1]:
        t0 = time.monotonic()
        traced = fwd.trace(params, cfg, jax.ShapeDtypeStruct((eng.B, w), jnp.int32), cache,
                           lengths=zero, last_only=True, plan=plan)
        t1 = time.monotonic()
        lowered = traced.lower()
        t2 = time.monotonic()
        text_chars = len(lowered.as_text())
        t3 = time.monotonic()
        lowered.compile()
        t4 = time.monotonic()
        rows.append({"width": w, "trace_s": round(t1 - t0, 3), "lower_s": round(t2 - t1, 3),
                     "compile_s": round(t4 - t3, 3), "stablehlo_chars": text_chars})
    loading._art.close()
    return {"widths": rows}


def _rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def part_load(args) -> dict:
    """ModelLoad's copy pass, then the rates beneath it."""
    import concurrent.futures

    import jax
    import numpy as np

    import engine.io.loader as L

    out = {}
    size = os.path.getsize(args.artifact)
    # Page cache read rates (the file was just written or read: it is cached when memory allows).
    buf = np.empty(size, np.uint8)
    for threads in (1, 8):
        step = -(-size // threads)

        def read(i, step=step):
            fd = os.open(args.artifact, os.O_RDONLY)
            try:
                lo, hi = i * step, min(size, (i + 1) * step)
                pos = lo
                while pos < hi:
                    n = os.preadv(fd, [memoryview(buf)[pos:min(hi, pos + (64 << 20))]], pos)
                    if n <= 0:
                        raise OSError("short read")
                    pos += n
            finally:
                os.close(fd)
        t = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(threads)))
        out[f"page_cache_read_{threads}t_GBps"] = _rate(size, time.monotonic() - t)
    buf = None  # free it before the copies

    # The loader's copy pass, verification skipped (a warm start's stamp).
    def no_verify(art, expected, *, stamps=None, mode="full"):
        return "stamp"
    L.verify_artifact = no_verify
    for threads in sorted({L.copy_threads(), 8, 16}):
        L.copy_threads = lambda threads=threads: threads
        timings = {}
        load = L.start_load(Path(args.artifact), compute_dtype=args.compute_dtype,
                            kv_dtype=args.compute_dtype, timings=timings, verify="full")
        load.result()
        out[f"model_load_{threads}t"] = {**timings, "GBps": _rate(size, timings["to_device_s"])}
        print(threads, out[f"model_load_{threads}t"], file=sys.stderr, flush=True)
        load = None  # the device copy goes with it

    # Host-to-device rates.
    dev = jax.devices()[0]
    host = np.random.default_rng(0).integers(0, 255, GiB, np.uint8)
    jax.device_put(host[:1 << 20], dev).block_until_ready()
    best = min(_timed(lambda: jax.device_put(host, dev).block_until_ready()) for _ in range(3))
    out["device_put_1GiB_pageable_GBps"] = _rate(GiB, best)
    # Pinned host memory a first time and again once freed (does the runtime reuse it?):
    # 16 puts of 512 MiB each, one after the other, each to the device and freed.
    if jax.default_backend() == "gpu":
        from jax.sharding import SingleDeviceSharding

        half = host[:GiB // 2]
        pinned_kind = SingleDeviceSharding(dev, memory_kind="pinned_host")
        on_dev = SingleDeviceSharding(dev, memory_kind="device")
        for label in ("first", "again"):
            t = time.monotonic()
            for _ in range(16):
                pinned = jax.device_put(half, pinned_kind)
                jax.device_put(pinned, on_dev).block_until_ready()
                pinned = None
            out[f"pinned_{label}_16x512MiB_GBps"] = _rate(8 * GiB, time.monotonic() - t)
    try:
        from jax.sharding import SingleDeviceSharding

        pinned = jax.device_put(host, SingleDeviceSharding(dev, memory_kind="pinned_host"))
        pinned.block_until_ready()
        on_dev = SingleDeviceSharding(dev, memory_kind="device")
        best = min(_timed(lambda: jax.device_put(pinned, on_dev).block_until_ready())
                   for _ in range(3))
        out["device_put_1GiB_pinned_GBps"] = _rate(GiB, best)
        best = min(_timed(lambda: jax.device_put(host, SingleDeviceSharding(
            dev, memory_kind="pinned_host")).block_until_ready()) for _ in range(3))
        out["host_to_pinned_1GiB_GBps"] = _rate(GiB, best)
        pinned = None
    except Exception as e:  # a backend without pinned host memory: say so
        out["pinned_error"] = f"{type(e).__name__}: {e}"[:300]
    hosts = [np.random.default_rng(i).integers(0, 255, GiB, np.uint8) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        t = time.monotonic()
        outs = list(pool.map(lambda h: jax.device_put(h, dev), hosts))
        jax.block_until_ready(outs)
        out["device_put_8x1GiB_8t_GBps"] = _rate(8 * GiB, time.monotonic() - t)
        outs = None
    return out


def _timed(fn) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


PARTS = {"compile": part_compile, "widths": part_widths, "load": part_load}


def _child(args) -> None:
    _prepare(args)
    res = PARTS[args.child](args)
    print("RESULT " + json.dumps(res), flush=True)


def _run_child(part: str, argv: list[str], timeout: float) -> dict:
    t = time.monotonic()
    p = subprocess.run([sys.executable, __file__, "--child", part, *argv], capture_output=True,
                       text=True, timeout=timeout)
    wall = round(time.monotonic() - t, 3)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[7:]), "process_s": wall}
    return {"error": f"rc {p.returncode}: {p.stderr[-1500:]}", "process_s": wall}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="qwen3.8-27b")
    ap.add_argument("--format", default="int4_g64")
    ap.add_argument("--context", type=int, default=135168)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    from bench.plan_args import add_plan_args

    add_plan_args(ap, "h200", "the engine runs")
    ap.add_argument("--compute-dtype", default="bfloat16")
    ap.add_argument("--parts", default="compile,widths,load")
    ap.add_argument("--child", choices=sorted(PARTS))
    ap.add_argument("--artifact")
    ap.add_argument("--cache-dir")
    ap.add_argument("--exec-store", help="(child) an ExecStore directory for the compile")
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    artifact = work / "models" / f"{args.preset}-{args.format}.ninfer"
    if not artifact.exists():
        artifact.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(REPO / "bench" / "synth_artifact.py"), "--preset",
                        args.preset, "--format", args.format, "--out", str(artifact)],
                       check=True)
    cache = work / "startup_micro_cache"
    import shutil
    for d in (cache, work / "startup_micro_exec"):
        if d.exists():
            shutil.rmtree(d)
    common = ["--work-dir", str(work), "--out", args.out, "--preset", args.preset,
              "--context", str(args.context), "--prefill-chunk", str(args.prefill_chunk),
              "--batch", str(args.batch), "--plan", args.plan, "--set", args.set,
              "--compute-dtype",
              args.compute_dtype, "--artifact", str(artifact), "--cache-dir", str(cache)]
    parts = args.parts.split(",")
    res = {"command": "python3 bench/startup_micro.py " + " ".join(sys.argv[1:]),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"host": platform.node(), "cpus": os.cpu_count(),
                       "python": platform.python_version()},
           "artifact_bytes": artifact.stat().st_size, "plan": _plan(args).describe()}
    if "compile" in parts:
        res["compile_cold"] = _run_child("compile", common, 600)
        res["compile_warm"] = _run_child("compile", common, 300)
        # with an executable store: the first start stores (from JAX's cache, so afresh), the
        # second loads
        store = ["--exec-store", str(work / "startup_micro_exec")]
        res["compile_store_first"] = _run_child("compile", common + store, 600)
        res["compile_store_warm"] = _run_child("compile", common + store, 300)
        for k in ("compile_cold", "compile_warm", "compile_store_first", "compile_store_warm"):
            print(f"{k} {res[k]}", flush=True)
    if "widths" in parts:
        res["widths_warm"] = _run_child("widths", common, 300)
        print(f"{'width':>6} {'trace':>7} {'lower':>7} {'compile':>8} {'hlo chars':>10}")
        for r in res["widths_warm"].get("widths", []):
            print(f"{r['width']:>6} {r['trace_s']:>7.2f} {r['lower_s']:>7.2f} "
                  f"{r['compile_s']:>8.2f} {r['stablehlo_chars']:>10}")
        if "error" in res["widths_warm"]:
            print(res["widths_warm"]["error"])
    if "load" in parts:
        res["load"] = _run_child("load", common, 400)
        print(json.dumps(res["load"], indent=1), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
