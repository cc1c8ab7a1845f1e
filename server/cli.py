"""`./ninfer <command>`: serve, test, convert."""
from __future__ import annotations

import argparse
import ipaddress
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


def _check_plan_early(profile) -> None:
    """Before anything starts: the lane's process settings (its plan's XLA flags, a GPU lane's
    allocator share: JAX reads both when its backend starts) and what can be told without a
    device: a plan with the CUDA ops needs nvcc. The device itself is checked by the load
    (server/model_load.py)."""
    from engine.plan import PlanError
    from lanes.planner import apply_process_settings

    try:
        apply_process_settings(profile)
    except PlanError as e:
        raise SystemExit(f"ninfer: lane {profile.name}: {e}") from None
    if profile.plan.uses_cuda:
        from engine.kernels.cuda_ops import _nvcc

        if _nvcc() is None:
            raise SystemExit(f"ninfer: lane {profile.name}: its kernel plan runs the CUDA ops, "
                             "and no nvcc was found (NVCC, PATH, /usr/local/cuda/bin/nvcc)")


def cmd_serve(args) -> int:
    t_start = time.monotonic()
    from lanes.profile import ProfileError, load_profile
    from server.auth import KeyFileError, ReloadingKeyRing, ensure_key_file

    args.bundle_forwards = None
    if getattr(args, "bundle", None):  # the lane and its forwards from an engine bundle
        from server.model_load import open_for_serving

        args.lane, args.bundle_forwards, refusal = open_for_serving(args.bundle, args.lane)
        if refusal:
            print(f"ninfer: refused: {refusal}", file=sys.stderr, flush=True)
            return 78
    args.lane = args.lane or "cpu"
    try:
        profile = load_profile(args.lane)
    except ProfileError as e:  # before anything starts: EX_CONFIG, naming the file and key
        print(f"ninfer: {e}", file=sys.stderr, flush=True)
        return 78
    _check_plan_early(profile)
    host = args.host or profile.host
    port = profile.port if args.port is None else args.port
    args.state_dir = Path(args.state_dir or default_state_dir())
    # every file and directory this process creates (state, checkpoints, logs, the compilation
    # cache JAX writes) is its owner's alone: 0600 / 0700
    os.umask(0o077)
    from lanes.preflight import EX_CONFIG, preflight, refuse

    problems = preflight(profile, state_dir=args.state_dir,
                         checkpoints=getattr(args, "checkpoints", "on") == "on",
                         synthetic=args.synthetic_weights, model_override=args.model)
    if problems:  # before the state directory is made or anything is bound
        print(refuse(profile, problems), file=sys.stderr, flush=True)
        return EX_CONFIG
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
    from server.response_store import ResponseStore, StoreError
    from server.runtime import Runtime

    try:  # a damaged file is refused here, with what to do, before anything is served
        store = ResponseStore(args.state_dir / "responses.db")
    except StoreError as e:
        raise SystemExit(f"ninfer: storage fault: {e}") from None
    rt = Runtime(keys=ReloadingKeyRing(key_file, keys), max_output_tokens=profile.max_output_tokens,
                 context_tokens=profile.context_tokens, response_store=store, profile=profile,
                 synthetic_weights=args.synthetic_weights)
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
    from server.model_load import load_in_background

    threading.Thread(target=load_in_background, args=(rt, profile, args, t_start),
                     daemon=True, name="ninfer-loader").start()
    life = checkpoint_setup.serve_control(rt, app, args.state_dir)
    app.run(sock=sock, single_process=True, access_log=False, motd=False)
    # SIGTERM, SIGINT or `ninfer ctl stop`: the listener is closed; save, report, exit.
    life.stop_report()
    _exit_after_stop(rt)


def _exit_after_stop(rt) -> None:
    """Close what holds data (the response store, its WAL checkpointed into the database;
    the request log), flush, and leave without the interpreter's finalization. Daemon threads
    may still be inside XLA (a background compile, an executable being serialized): at
    finalization they are unwound from C++ code that cannot be, and the process aborted
    ("FATAL: exception not rethrown", SIGABRT) after a clean stop. Nothing they do is state
    that must survive: a background save writes a new file and renames it last."""
    for close in (rt.response_store.close, rt.obs.log.close):
        try:
            close()
        except Exception as e:  # noqa: BLE001 (reported; the stop is still clean)
            print(f"ninfer: at stop: {type(e).__name__}: {e}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _configure_jax_cache(state_dir: Path) -> None:
    import jax

    cache = os.environ.get("NINFER_JAX_CACHE") or str(state_dir / "jax-cache")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # LRU-bounded, and so under JAX's file lock: another process on the same cache (a second
    # server, `./ninfer qualify`, the tests) never reads an entry half-written
    jax.config.update("jax_compilation_cache_max_size", 8 << 30)


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

    argv = (["-q", "-p", "no:cacheprovider"] + (["--slow"] if args.slow else [])
            + (["--release"] if args.release else []))
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
    s.add_argument("--lane", default=None,
                   help="lane profile name or TOML path (default cpu, or the bundle's lane)")
    s.add_argument("--bundle", help="an engine bundle (release/bundle.py): serve its lane with "
                   "its exported forwards instead of compiling them")
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
    s.add_argument("--synthetic-weights", action="store_true",
                   help="serve the lane's model shapes with random weights (generated once into "
                        "the state dir); the status route and every receipt say so")
    s.add_argument("--verify-artifact", choices=("full", "stamp"), default="stamp",
                   help="stamp (default): skip re-hashing an artifact whose verified-artifact "
                        "stamp in the state dir matches the file exactly; full: always re-hash")
    from server.checkpoints.setup import add_arguments as add_checkpoint_arguments

    add_checkpoint_arguments(s)
    t = sub.add_parser("test", help="run the test suite")
    t.add_argument("--slow", action="store_true", help="include the slow tier")
    t.add_argument("--release", action="store_true",
                   help="run the release tier instead: build the release twice, verify, run it")
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
    sub.add_parser("checkpoints", help="move a session: transfer-key | export | import | replica",
                   add_help=False)
    sub.add_parser("backup", help="back up the whole state while the server runs",
                   add_help=False)
    sub.add_parser("restore", help="bring back lost state from a backup", add_help=False)
    sub.add_parser("lane", help="install, start, stop, upgrade and roll back a lane",
                   add_help=False)
    sub.add_parser("qualify", help="qualify a lane on this machine and write its receipt",
                   add_help=False)
    sub.add_parser("lock", help="regenerate the hash-locked requirements (one lock a platform)",
                   add_help=False)
    sub.add_parser("release", help="build or verify a release: build | verify DIR",
                   add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        return cmd_convert(argv[1:])
    if argv[:1] == ["ctl"]:
        from server.ctl import main as ctl_main

        return ctl_main(argv[1:], default_state_dir())
    if argv[:2] == ["checkpoints", "replica"]:
        from server.replica_cli import main as replica_main

        return replica_main(argv[2:], default_state_dir())
    if argv[:1] == ["checkpoints"]:
        from server.checkpoints_cli import main as checkpoints_main

        return checkpoints_main(argv[1:], default_state_dir())
    if argv[:1] in (["backup"], ["restore"]):
        from server.backup import main as backup_main

        return backup_main(argv, default_state_dir())
    if argv[:1] == ["plan"]:
        from lanes.cli import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["lane"]:
        from lanes.lifecycle import main as lane_main

        return lane_main(argv[1:])
    if argv[:1] == ["qualify"]:
        from lanes.qualify import main as qualify_main

        return qualify_main(argv[1:])
    if argv[:1] == ["lock"]:
        from release.lock import main as lock_main

        return lock_main(argv[1:])
    if argv[:1] == ["release"]:
        from release.cli import main as release_main

        return release_main(argv[1:])
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
