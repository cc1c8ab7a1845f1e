"""The model's load for `./ninfer serve`, on a thread of its own while the server already
answers (`/health` says loading): the lane's artifact (pinned, embedded or synthetic), the
engine with its checkpoint hooks and keep-warm, the compile (from the executable store where it
can), the constraint tables, the checkpoints attached, then ready. Any failure is fatal: the
server says why and exits, never serving without the model it was asked for."""
from __future__ import annotations

import concurrent.futures
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

def load_in_background(rt, profile, args, t_start: float) -> None:
    from engine.engine import Engine
    from engine.io.loader import embedded_pin, ensure_embedded, start_load

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
        if args.synthetic_weights and not model_arg.startswith("embedded:"):
            path, expected = _synthetic_artifact(profile, args.state_dir), None
        elif model_arg.startswith("embedded:"):
            # the lane's own model is pinned by its profile, another embedded one by the code
            expected = (profile.model_sha256 if model_arg == profile.model
                        else embedded_pin(model_arg.split(":", 1)[1]))
            path = ensure_embedded(args.state_dir, model_arg.split(":", 1)[1], expected,
                                   stamps=stamps, verify=mode)
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
                        keep_warm=_keep_warm(profile),
                        speculative=profile.speculative_config())
        phases["engine_init_s"] = round(time.monotonic() - t, 3)
        loading.start()
        # Token tables (~1-2 s, mostly Python) on a thread of their own, beside the compile
        # (loading stored executables is native work) and the copy (which releases the GIL).
        tables_pool = concurrent.futures.ThreadPoolExecutor(1, "ninfer-tables")
        tables = tables_pool.submit(_constraint_tables, loading.abstract.tokenizer)
        if getattr(args, "bundle_forwards", None) is not None:
            compile_s = _load_bundle_forwards(engine, args)
        else:
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
        # everything loaded so far lives as long as the server: out of the collector's view,
        # so a full collection (which a request's churn of small objects triggers) walks only
        # what requests made, not JAX's and the loader's millions of objects (~100 ms, every
        # thread stopped: /health waited that long while a 32 MB prompt was tokenized)
        gc.collect()
        gc.freeze()
        rt.model, rt.engine = model, engine
        rt.sampling_defaults = model.generation
        if rt.checkpointer is not None:
            threading.Thread(target=_prepare_restore, args=(engine,), daemon=True,
                             name="ninfer-prepare-restore").start()
        rt.obs.on_server_start(lane=profile.name, synthetic_weights=rt.synthetic_weights,
                               host=args.host_bound, port=args.port_bound,
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


def open_for_serving(path, lane: str | None):
    """(lane, forwards, refusal) of `serve --bundle PATH [--lane L]`: the bundle verified
    (release/bundle.py), its lane (L must be it), and its forwards for its platform; refusal is
    None, or why this process cannot serve from it (a bundle that fails verification, another
    lane, JAX version, plan or platform than this tree's)."""
    import jax

    from lanes.profile import ProfileError, load_profile
    from release.bundle import BundleError, lane_platform, open_bundle

    try:
        bundle = open_bundle(path, expect_lane=lane)
        profile = load_profile(bundle.lane)
    except (BundleError, ProfileError) as e:
        return lane, None, str(e)
    m = bundle.manifest
    import jaxlib

    ran = (m.get("jax"), m.get("jaxlib"))
    if ran != (jax.__version__, jaxlib.__version__):
        return bundle.lane, None, (f"{path}: the bundle was exported with jax {ran[0]} "
                                   f"(jaxlib {ran[1]}); this process runs jax {jax.__version__} "
                                   f"(jaxlib {jaxlib.__version__})")
    if m.get("plan_digest") != profile.plan.digest():
        return bundle.lane, None, (f"{path}: the bundle's kernel plan differs from lane "
                                   f"{bundle.lane}'s plan in this tree")
    if bundle.platform != lane_platform(profile):
        return bundle.lane, None, (f"{path}: the bundle is for platform {bundle.platform!r}; "
                                   f"lane {bundle.lane} runs on {lane_platform(profile)!r}")
    _install_cuda_libraries(bundle)
    return bundle.lane, (str(path), bundle.forwards(bundle.platform)), None


def _install_cuda_libraries(bundle) -> None:
    """The bundle's CUDA ops into the CUDA cache under their own names (a digest of source,
    headers, nvcc, arch and flags): a start whose build would have that name uses them
    instead of running nvcc; any other start builds its own."""
    libs = bundle.cuda_libraries()
    if not libs:
        return
    from engine.kernels.cuda_build import cache_dir

    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name, data in sorted(libs.items()):
        dest = d / name
        if dest.is_file():
            continue
        tmp = d / f".{name}.{os.getpid()}"
        tmp.write_bytes(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)


def _load_bundle_forwards(engine, args) -> float:
    """The engine's forwards from the bundle (Engine.load_exported) instead of compiling them;
    a bundle not made for this engine or machine is refused: exit 78, never a compile."""
    from engine.runtime.exported import ExportMismatch

    path, blobs = args.bundle_forwards
    try:
        seconds = engine.load_exported(blobs)
    except ExportMismatch as e:
        print(f"ninfer: refused: {path}: {e}", file=sys.stderr, flush=True)
        os._exit(78)
    print(f"ninfer: {len(blobs)} forwards loaded from bundle {path} ({seconds:.1f}s)",
          file=sys.stderr, flush=True)
    return seconds


def _check_plan_device(profile) -> None:
    """The lane's kernel plan against this machine's JAX backend: a plan it cannot run is
    refused (never served by other kernels)."""
    import jax

    from engine.plan import machine_problems

    problems = machine_problems(profile.plan, jax.default_backend())
    if problems:
        raise RuntimeError(f"lane {profile.name}: its kernel plan cannot run here: "
                           + "; ".join(problems))


def _synthetic_artifact(profile, state_dir: Path) -> Path:
    """The lane's model shapes and weight format with random values (generated once into the
    state directory, then reused): `serve --synthetic-weights`."""
    from engine.io.synthetic import RECIPE_FORMAT, synth_artifact
    from lanes.profile import model_config

    fmt = RECIPE_FORMAT.get(profile.weights)
    if fmt is None:
        raise RuntimeError(f"--synthetic-weights makes {sorted(RECIPE_FORMAT)} weights; lane "
                           f"{profile.name} uses {profile.weights}")
    cfg = model_config(profile)
    path = state_dir / "models" / f"synthetic-{cfg.name}-{fmt}.ninfer"
    if not path.exists():
        print(f"ninfer: writing synthetic {cfg.name} {fmt} weights to {path} (first use)",
              file=sys.stderr, flush=True)
        synth_artifact(path, cfg.name, fmt)
    return path


def _keep_warm(profile):
    """The lane's [keep_warm] table as the engine's config (off when the table is absent)."""
    from engine.runtime.keep_warm import KeepWarmConfig

    return KeepWarmConfig(**profile.table("keep_warm"))


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
