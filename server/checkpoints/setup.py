"""Wiring for `./ninfer serve`: open the store at start, build the checkpointer before the
engine (which takes its hooks) and attach it once the model is loaded, serve the control plane,
and parse the size flags."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

DEFAULT_QUOTA = "8G"


def parse_size(text: str) -> int:
    """'512M', '8G', '1.5T', or plain bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(text), re.I)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 800M, 8G)")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def add_arguments(parser) -> None:
    parser.add_argument("--checkpoints", choices=["on", "off"], default="on",
                        help="durable session checkpoints (default on)")
    parser.add_argument("--checkpoint-quota", default=DEFAULT_QUOTA,
                        help=f"disk quota of the checkpoint store (default {DEFAULT_QUOTA})")
    parser.add_argument("--checkpoint-autosave", choices=["on", "off"], default="on",
                        help="save after every completed response (default on); saves on "
                             "request, before eviction and at a graceful stop happen anyway")


def open_store(rt, args) -> None:
    """Open <state-dir>/checkpoints (exclusive to this process) before the model loads."""
    if getattr(args, "checkpoints", "on") == "off":
        return
    from server.checkpoints.files import Faults
    from server.checkpoints.checkpoint_store import CheckpointStore, StoreBusy

    try:
        rt.checkpoint_store = CheckpointStore(
            Path(args.state_dir) / "checkpoints", quota_bytes=parse_size(args.checkpoint_quota),
            faults=Faults(os.environ.get("NINFER_CHECKPOINT_FAULTS", "")))
    except StoreBusy as e:  # another server on this state dir: serve without checkpoints
        print(f"ninfer: checkpoints off: {e}", file=sys.stderr, flush=True)
    except (PermissionError, ValueError) as e:
        raise SystemExit(f"ninfer: checkpoints: {e}") from None


def checkpointer(rt, args):
    """The checkpointer, built before the engine (`Engine(hooks=ck.engine_hooks())`); None
    without a store."""
    store = rt.checkpoint_store
    if store is None:
        return None
    from server.checkpoints.manager import Checkpointer

    return Checkpointer(store, log=rt.obs.on_event,
                        autosave=getattr(args, "checkpoint_autosave", "on") == "on")


def attach(rt, ck, model, profile, engine) -> None:
    """Attach the checkpointer `ck` (or None) to the loaded runtime (before the engine
    starts)."""
    if ck is None:
        return
    from server.checkpoints.fingerprint import fingerprint_digest, runtime_fingerprint

    from server.checkpoints.transfer import record_runtime

    fp = runtime_fingerprint(model, profile, engine)
    try:  # a stopped-server import checks bundles against it
        record_runtime(ck.store.root, fp)
    except OSError as e:
        print(f"ninfer: could not record the runtime fingerprint: {e}", file=sys.stderr)
    ck.attach(engine, fp, staging_bytes=getattr(profile, "checkpoint_staging_bytes", 0))
    rt.fingerprint_sha256 = fingerprint_digest(fp)
    rt.checkpointer = ck


def serve_control(rt, app, state_dir):
    """The Lifecycle (drain, graceful stop) and the gRPC control socket."""
    from server.ctl import Lifecycle, start_ctl_server

    box = {}

    @app.after_server_start
    async def _remember_loop(app_):
        import asyncio

        box["loop"] = asyncio.get_running_loop()

    def request_stop():
        loop = box.get("loop")
        if loop is not None:
            loop.call_soon_threadsafe(app.stop)

    life = Lifecycle(rt, Path(state_dir), request_stop)
    try:
        rt.ctl_server = start_ctl_server(life)
    except Exception as e:  # the API still serves; only `ninfer ctl` is unavailable
        print(f"ninfer: control socket unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    return life
