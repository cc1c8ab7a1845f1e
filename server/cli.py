"""`./ninfer <command>`: serve, test, convert."""
from __future__ import annotations

import argparse
import concurrent.futures
import ipaddress
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def default_state_dir() -> Path:
    env = os.environ.get("NINFER_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ninfer"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_loopback(host: str, port: int) -> socket.socket:
    if not _is_loopback(host):
        raise SystemExit(f"ninfer: refusing to listen on {host!r}: only loopback addresses "
                         "(127.0.0.0/8, ::1, localhost) are allowed")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1" if host == "localhost" else host, port))
    except OSError as e:
        raise SystemExit(f"ninfer: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _load_in_background(rt, profile, args, t_start: float) -> None:
    from engine.engine import Engine
    from engine.io.loader import ensure_embedded, start_load

    phases = {"boot_s": round(time.monotonic() - t_start, 3)}  # start -> this thread
    try:
        _check_plan_device(profile)
    except RuntimeError as e:  # fail closed: the lane's plan, or nothing
        rt.load_error = str(e)
        print(f"ninfer: refused: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    try:
        from server.artifact_stamps import ArtifactStamps

        stamps = ArtifactStamps(args.state_dir)  # a loose key mode fails closed, like the others
        mode = args.verify_artifact
        model_arg = args.model or profile.model
        if model_arg.startswith("embedded:"):
            path = ensure_embedded(args.state_dir, model_arg.split(":", 1)[1],
                                   profile.model_sha256, stamps=stamps, verify=mode)
            expected = profile.model_sha256
        else:
            # The lane's own artifact must be the one its profile pins (fail closed); an
            # artifact named on the command line is the operator's choice and is only hashed.
            if args.model is None:  # the lane's artifact, pinned by its profile or here
                from lanes.models import artifact_path, pinned_sha256

                path, expected = (artifact_path(profile, args.state_dir),
                                  pinned_sha256(profile, args.state_dir))
                if expected is None:
                    raise RuntimeError(f"lane {profile.name}'s model is not pinned on this "
                                        f"installation (./ninfer convert --lane {profile.name})")
            else:
                path, expected = Path(model_arg), None
        # The engine (its device allocations first, on an idle machine) and its compile need
        # only the params' shapes: the compile runs while the weights are copied and verified
        # on the loader's threads (which release the GIL), and so do the constraint tables;
        # the decode step then runs once the model is on the device.
        load = {}
        t = time.monotonic()
        loading = start_load(path, compute_dtype=profile.compute_dtype,
                             kv_dtype=profile.kv_dtype, expected_sha256=expected, timings=load,
                             stamps=stamps, verify=mode)
        phases["load_start_s"] = round(time.monotonic() - t, 3)
        from server.checkpoints import setup as checkpoint_setup

        ck = checkpoint_setup.checkpointer(rt, args)  # the engine takes its hooks
        t = time.monotonic()
        engine = Engine(loading.abstract, context_tokens=profile.context_tokens,
                        prefill_chunk=profile.prefill_chunk,
                        max_concurrency=profile.max_concurrency, max_queue=profile.max_queue,
                        queue_timeout_s=profile.queue_timeout_s,
                        capacity_tokens=profile.kv_capacity_tokens,
                        state_slots=profile.state_slots,
                        host_state_bytes=profile.host_state_bytes,
                        hooks=None if ck is None else ck.engine_hooks(), plan=profile.plan,
                        keep_warm=_keep_warm(profile))
        phases["engine_init_s"] = round(time.monotonic() - t, 3)
        loading.start()
        # Token tables (~1-2 s, mostly Python) on a thread of their own, beside the compile
        # (loading stored executables is native work) and the copy (which releases the GIL).
        tables_pool = concurrent.futures.ThreadPoolExecutor(1, "ninfer-tables")
        tables = tables_pool.submit(_constraint_tables, loading.abstract.tokenizer)
        compile_s = engine.compile(store=_exec_store(args.state_dir, rt))
        phases["compile_s"] = round(compile_s, 3)
        phases.update({f"exec_{k}": v for k, v in engine.exec_counts.items()})
        t = time.monotonic()
        rt.constraints, phases["constraints_s"] = tables.result()
        tables_pool.shutdown()
        phases["constraints_wait_s"] = round(time.monotonic() - t, 3)  # left after compile
        t = time.monotonic()
        model = loading.result()  # raises if any byte differs: fail closed
        phases["load_wait_s"] = round(time.monotonic() - t, 3)  # left after compile, tables
        phases["load_s"] = load.pop("ready_s")  # the load itself, beside the compile
        phases.update({f"load_{k}": v for k, v in load.items()})
        engine.attach(model)
        warm_s = engine.warm_run()
        phases["warm_run_s"] = round(warm_s, 3)
        compile_s += warm_s
        t = time.monotonic()
        checkpoint_setup.attach(rt, ck, model, profile, engine)
        phases["checkpoints_attach_s"] = round(time.monotonic() - t, 3)
        engine.start()
        rt.model, rt.engine = model, engine
        if rt.checkpointer is not None:
            threading.Thread(target=_prepare_restore, args=(engine,), daemon=True,
                             name="ninfer-prepare-restore").start()
        rt.obs.on_server_start(lane=profile.name, host=args.host_bound, port=args.port_bound,
                               model=model.model_id, model_sha256=model.sha256,
                               compile_s=round(compile_s, 3),
                               ready_s=round(time.monotonic() - t_start, 3),
                               plan=profile.plan.preset_name() or profile.plan.digest()[:16],
                               startup_phases=phases)
        print(f"ninfer: startup phases: {json.dumps(phases)}", file=sys.stderr, flush=True)
        print(f"ninfer: ready: model {model.model_id} sha256 {model.sha256[:16]}... "
              f"(compile {compile_s:.1f}s, ready {time.monotonic() - t_start:.1f}s after start)",
              file=sys.stderr, flush=True)
    except Exception as e:  # fail closed: say why and stop, never serve without the model
        rt.load_error = f"{type(e).__name__}: {e}"
        print(f"ninfer: model failed to load: {rt.load_error}", file=sys.stderr, flush=True)
        os._exit(3)


def _check_plan_early(profile) -> None:
    """Before anything starts: the lane's kernel plan's process settings (XLA's flags, which
    JAX reads when its backend starts) and what can be told without a device: a plan with the
    CUDA ops needs nvcc. The device itself is checked by the loader (`_check_plan_device`)."""
    from engine.plan import PlanError, apply_process_settings

    try:
        apply_process_settings(profile.plan)
    except PlanError as e:
        raise SystemExit(f"ninfer: lane {profile.name}: {e}") from None
    if profile.plan.uses_cuda:
        from engine.kernels.cuda_ops import _nvcc

        if _nvcc() is None:
            raise SystemExit(f"ninfer: lane {profile.name}: its kernel plan runs the CUDA ops, "
                             "and no nvcc was found (NVCC, PATH, /usr/local/cuda/bin/nvcc)")


def _keep_warm(profile):
    """The lane's [keep_warm] table as the engine's config (off when the table is absent)."""
    from engine.runtime.keep_warm import KeepWarmConfig

    return KeepWarmConfig(**profile.table("keep_warm"))


def _check_plan_device(profile) -> None:
    """The lane's kernel plan against this machine's JAX backend: a plan it cannot run is
    refused (never served by other kernels)."""
    import jax

    from engine.plan import machine_problems

    problems = machine_problems(profile.plan, jax.default_backend())
    if problems:
        raise RuntimeError(f"lane {profile.name}: its kernel plan cannot run here: "
                           + "; ".join(problems))


def cmd_serve(args) -> int:
    t_start = time.monotonic()
    from lanes.profile import ProfileError, load_profile
    from server.auth import KeyFileError, ReloadingKeyRing, ensure_key_file

    try:
        profile = load_profile(args.lane)
    except ProfileError as e:
        raise SystemExit(f"ninfer: {e}") from None
    _check_plan_early(profile)
    host = args.host or profile.host
    port = profile.port if args.port is None else args.port
    args.state_dir = Path(args.state_dir or default_state_dir())
    from lanes.preflight import EX_CONFIG, preflight, refuse

    problems = preflight(profile, state_dir=args.state_dir,
                         checkpoints=getattr(args, "checkpoints", "on") == "on",
                         model_override=args.model)
    if problems:  # before the state directory is made or anything is bound
        print(refuse(profile, problems), file=sys.stderr, flush=True)
        return EX_CONFIG
    from lanes.planner import allocator_fraction

    fraction = allocator_fraction(profile)
    if fraction is not None:  # read by JAX when its backend starts, below
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"
    args.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_file = Path(args.key_file or args.state_dir / "keys")
    sock = bind_loopback(host, port)
    try:
        keys, created = ensure_key_file(key_file)
    except KeyFileError as e:
        raise SystemExit(f"ninfer: {e}") from None
    print(f"ninfer: {'created' if created else 'using'} key file {key_file} (mode 0600)",
          file=sys.stderr, flush=True)
    _configure_jax_cache(args.state_dir)
    # The device backend starts (~3 s on the H200: the CUDA context and the allocator) while
    # the rest of the server is imported and the artifact opened; the loader's first device
    # call waits for it (JAX initializes its backends under a lock). An error here is raised
    # again, and reported, by that first call.
    threading.Thread(target=_start_backend, name="ninfer-backend", daemon=True).start()

    from server.app import create_app
    from server.observability import Metrics, Observability, RequestLog, engine_stats
    from server.response_store import ResponseStore
    from server.runtime import Runtime

    rt = Runtime(keys=ReloadingKeyRing(key_file, keys), max_output_tokens=profile.max_output_tokens,
                 context_tokens=profile.context_tokens,
                 response_store=ResponseStore(args.state_dir / "responses.db"), profile=profile)
    rt.retention = (args.retain_responses or None,
                    args.retain_days * 86400.0 if args.retain_days else None)
    from server.reasoning_seal import ReasoningSeal

    rt.seal = ReasoningSeal.from_state_dir(args.state_dir)
    from server.checkpoints import setup as checkpoint_setup

    checkpoint_setup.open_store(rt, args)
    log_dir = args.state_dir / "logs"
    log_dir.mkdir(mode=0o700, exist_ok=True)
    rt.obs = Observability(Metrics(stats=lambda: engine_stats(rt.engine)),
                           RequestLog(log_dir / "requests.jsonl"))
    app = create_app(rt)
    actual_port = sock.getsockname()[1]
    args.host_bound, args.port_bound = host, actual_port
    print(f"ninfer: lane {profile.name} listening on http://{host}:{actual_port}",
          file=sys.stderr, flush=True)
    threading.Thread(target=_load_in_background, args=(rt, profile, args, t_start),
                     daemon=True, name="ninfer-loader").start()
    life = checkpoint_setup.serve_control(rt, app, args.state_dir)
    app.run(sock=sock, single_process=True, access_log=False, motd=False)
    # SIGTERM, SIGINT or `ninfer ctl stop`: the listener is closed; save, report, exit.
    life.stop_report()
    return 0


def _prepare_restore(engine) -> None:
    """Once serving: compile what the first checkpoint restore would compile on its way to
    the first token (engine/runtime/checkpoint_io.py prepare_restore), off the request path."""
    t = time.monotonic()
    try:
        n = engine.checkpoint.prepare_restore()
    except Exception as e:  # noqa: BLE001 - a restore then compiles them itself
        print(f"ninfer: restore path not prepared: {type(e).__name__}", file=sys.stderr,
              flush=True)
        return
    print(f"ninfer: restore path prepared ({n} executables, {time.monotonic() - t:.2f}s)",
          file=sys.stderr, flush=True)


def _constraint_tables(tokenizer):
    """(the ConstraintCompiler of `tokenizer`, seconds it took)."""
    from engine.constrain.compiler import ConstraintCompiler

    t = time.monotonic()
    compiler = ConstraintCompiler(tokenizer)
    return compiler, round(time.monotonic() - t, 3)


def _exec_store(state_dir, rt):
    """The compiled forwards kept between restarts (engine/runtime/exec_store.py), in
    <state-dir>/executables, tagged under <state-dir>/secrets/executable.key (0600, created
    once); NINFER_EXEC_STORE=off: none (every start traces and lowers, then asks JAX's
    persistent cache)."""
    if os.environ.get("NINFER_EXEC_STORE", "on") == "off":
        return None
    from engine.runtime.exec_store import ExecStore
    from server.checkpoints.tags import state_secret

    return ExecStore(Path(state_dir) / "executables",
                     state_secret(state_dir, "executable.key"), log=rt.obs.on_event)


def _configure_jax_cache(state_dir: Path) -> None:
    import jax

    cache = os.environ.get("NINFER_JAX_CACHE") or str(state_dir / "jax-cache")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _start_backend() -> None:
    import jax

    try:
        jax.devices()
    except Exception:  # noqa: BLE001 (the loader's own device call reports it)
        pass


def worker_count(requested: int | None, rest: list[str]) -> int:
    """How many pytest-xdist workers `./ninfer test` runs: --workers if given; 1 when the
    arguments pick the workers themselves (-n, -p no:xdist) or select the GPU tests (one
    device); otherwise one a core, at most 2 (a worker holds JAX, torch and the servers its
    modules start: a few GiB)."""
    if requested is not None:
        return max(1, requested)
    picks = any(a.startswith(("-n", "--numprocesses")) or a == "no:xdist" for a in rest)
    gpu = any(a == "gpu" and i > 0 and rest[i - 1] == "-m" for i, a in enumerate(rest))
    if picks or gpu:
        return 1
    return max(1, min(2, len(os.sched_getaffinity(0))))


def cmd_test(args, rest: list[str]) -> int:
    import pytest

    argv = ["-q", "-p", "no:cacheprovider"] + (["--slow"] if args.slow else [])
    workers = worker_count(args.workers, rest)
    if workers > 1:
        # Whole files to a worker: a module's shared server and engine fixtures stay in one
        # process. The workers share the run's JAX compilation cache (tests/conftest.py).
        argv += ["-n", str(workers), "--dist", "loadfile"]
    return pytest.main(argv + rest)


def cmd_convert(rest: list[str]) -> int:
    if any(a == "--lane" or a.startswith("--lane=") for a in rest):
        from lanes.models import convert_for_lane

        return convert_for_lane(rest, default_state_dir())
    from engine.io.convert import main

    return main(rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer", description="Local Qwen3.8 inference appliance")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the Responses API server")
    s.add_argument("--lane", default="cpu", help="lane profile name or TOML path (default cpu)")
    s.add_argument("--model", help="a .ninfer artifact, or embedded:<name> (default: the lane's)")
    s.add_argument("--host", help="loopback address to bind (default: the lane's, 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default: the lane's, 18089; 0 = any free)")
    s.add_argument("--state-dir", help="state directory (default $NINFER_STATE_DIR or "
                                       "~/.local/state/ninfer)")
    s.add_argument("--key-file", help="bearer key file (default <state-dir>/keys)")
    s.add_argument("--retain-days", type=float, default=90.0,
                   help="delete stored responses older than this (default 90; 0 = keep)")
    s.add_argument("--retain-responses", type=int, default=200_000,
                   help="keep at most this many responses per principal, the newest "
                        "(default 200000; 0 = no limit)")
    s.add_argument("--verify-artifact", choices=("full", "stamp"), default="stamp",
                   help="stamp (default): skip re-hashing an artifact whose verified-artifact "
                        "stamp in the state dir matches the file exactly; full: always re-hash")
    from server.checkpoints.setup import add_arguments as add_checkpoint_arguments

    add_checkpoint_arguments(s)
    t = sub.add_parser("test", help="run the test suite")
    t.add_argument("--slow", action="store_true", help="include the slow tier")
    t.add_argument("--workers", type=int, default=None,
                   help="test processes (pytest-xdist); default: one a core, at most 2")
    sub.add_parser("convert", help="convert a Hugging Face checkpoint to .ninfer",
                   add_help=False)
    sub.add_parser("omp-config", help="write the Oh My Pi client config for this server",
                   add_help=False)
    sub.add_parser("plan", help="the memory planner's fit table for a lane (or every lane)",
                   add_help=False)
    sub.add_parser("ctl", help="control a running server: status | save | drain | stop",
                   add_help=False)
    sub.add_parser("lane", help="install, start, stop, upgrade and roll back a lane",
                   add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        return cmd_convert(argv[1:])
    if argv[:1] == ["ctl"]:
        from server.ctl import main as ctl_main

        return ctl_main(argv[1:], default_state_dir())
    if argv[:1] == ["plan"]:
        from lanes.cli import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["lane"]:
        from lanes.lifecycle import main as lane_main

        return lane_main(argv[1:])
    if argv[:1] == ["omp-config"]:
        from server.omp_config import main as omp_config_main

        return omp_config_main(argv[1:], default_state_dir())
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "test":
        return cmd_test(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return cmd_serve(args)


if __name__ == "__main__":
    sys.exit(main())
