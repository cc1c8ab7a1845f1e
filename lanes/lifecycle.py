"""`./ninfer lane`: the managed lane lifecycle, on a state root (--root, default
~/.local/share/ninfer-lanes; layout in lanes/root.py).

    ./ninfer lane pack [--out DIR]             this tree as an immutable instance DIR/<id>
    ./ninfer lane install [--from DIR] [--lane L] [--enable] [--allow-no-rollback]
                                               copy, verify, write the unit, make it current
    ./ninfer lane start [--python PY] [--port N] [--synthetic-weights]
                                               run current's server, wait for /health
    ./ninfer lane stop                         graceful stop: live sessions saved
    ./ninfer lane status [--json]              current/previous ids, server, health
    ./ninfer lane rollback                     switch current and previous (restarting)
    ./ninfer lane repair                       finish or undo an interrupted install

Every command but pack first repairs an interrupted one (lanes/txn.py). Exit 78 (EX_CONFIG):
bad input (an unknown lane, a missing root, a refused schema upgrade); 1: a failure (a
tampered instance, a server that does not come up)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from lanes import runner, schema, txn
from lanes.cli import EX_CONFIG
from lanes.instance import LaneError, Source, pack
from lanes.root import DEFAULT_ROOT, LaneRoot, kill_after, validate_lane

DEFAULT_PACKS = Path.home() / ".cache" / "ninfer" / "packs"


def _say(*lines: str, err: bool = False) -> None:
    for line in lines:
        print(f"ninfer lane: {line}", file=sys.stderr if err else sys.stdout, flush=True)


@contextmanager
def _locked(args, create: bool = False):
    """The root, locked and repaired; the test fault hook armed after the repair."""
    root = LaneRoot(args.root)
    root.init() if create else root.require()
    with root.lock():
        _say(*(f"repair: {x}" for x in txn.recover(root)), err=True)
        if getattr(args, "test_kill_after", None):
            root.journal.fault = kill_after(args.test_kill_after)
        yield root


def _restart(root, running: dict | None, iid: str, lane: str, timeout: float) -> None:
    if running is None:
        return
    info = runner.start(root, iid, lane, python=running["python"], port=running["port"],
                        timeout=timeout, synthetic=running.get("synthetic", False))
    _say(f"restarted the server: pid {info['pid']}, {info['url']} (healthy)")


def cmd_pack(args) -> int:
    iid, path = pack(Path(args.out).expanduser().absolute() if args.out else DEFAULT_PACKS)
    print(f"{iid} {path}")
    return 0


def cmd_install(args) -> int:
    src = Source.from_instance(Path(args.source)) if args.source else Source.from_tree()
    probe = LaneRoot(args.root)
    lane = args.lane or (probe.lane() if probe.exists() else None) or "cpu"
    validate_lane(lane, src.manifest["profiles"])
    with _locked(args, create=True) as root:
        cur = root.pointer("current")
        if cur == src.id and root.lane() == lane:
            _say(f"instance {src.id} is already current")
            return 0
        current = Source.from_instance(root.instance(cur)) if cur else None
        notes = schema.check_install(root, src, current, args.allow_no_rollback)
        running = runner.record(root)
        notes += txn.install(root, src, lane, enable=args.enable, before_switch=(
            (lambda: runner.stop(root, args.timeout)) if running else None))
        _say(*notes, f"installed {src.id}: current (lane {lane}); previous "
             f"{root.pointer('previous') or '(none)'}")
        _restart(root, running, src.id, lane, args.timeout)
    return 0


def cmd_start(args) -> int:
    with _locked(args) as root:
        cur = root.pointer("current")
        if cur is None:
            raise LaneError(f"nothing is installed in {root.path}: ./ninfer lane install "
                            f"--root {root.path}", EX_CONFIG)
        src = txn.check_instance(root, cur)
        lane = validate_lane(root.lane(), src.manifest["profiles"])
        info = runner.record(root)
        if info is not None:
            _say(f"already running: pid {info['pid']}, instance {info['instance'][:16]}, "
                 f"{info['url']}")
            return 0
        python = None
        if args.python:
            python = shutil.which(args.python)
            if python is None:
                raise LaneError(f"--python {args.python}: not an executable", EX_CONFIG)
        info = runner.start(root, cur, lane, python=python, port=args.port,
                            timeout=args.timeout, synthetic=args.synthetic_weights)
        _say(f"started lane {lane} from instance {cur[:16]}: pid {info['pid']}, "
             f"{info['url']} (healthy)")
    return 0


def cmd_stop(args) -> int:
    with _locked(args) as root:
        info = runner.stop(root, args.timeout)
        _say("the server was not running" if info is None else
             f"stopped pid {info['pid']}; stop report: {runner.stop_report(root)}")
    return 0


def cmd_rollback(args) -> int:
    with _locked(args) as root:
        prev = root.pointer("previous")
        if prev is None:
            raise LaneError(f"nothing to roll back to: {root.path} has no previous instance")
        target = txn.check_instance(root, prev)
        lane = validate_lane(root.lane(), target.manifest["profiles"])
        schema.check_rollback(root, target)
        running = runner.record(root)
        new, old = txn.rollback(root, before_switch=(
            (lambda: runner.stop(root, args.timeout)) if running else None))
        _say(f"rolled back: current {new}, previous {old}")
        _restart(root, running, new, lane, args.timeout)
    return 0


def cmd_repair(args) -> int:
    with _locked(args) as root:
        cur = root.pointer("current")
        if cur is not None:
            txn.check_instance(root, cur)
        _say(f"current {cur or '(none)'}: complete and verified" if cur else
             "nothing is installed")
    return 0


def status(root: LaneRoot, busy: bool = False) -> dict:
    cur, prev = root.pointer("current"), root.pointer("previous")
    problems = None
    if cur is not None:
        try:
            txn.check_instance(root, cur)
        except LaneError as e:
            problems = str(e)
    info = runner.record(root)
    lane = root.lane()
    unit = root.systemd / f"ninfer-{lane}.service" if lane else None
    return {"root": str(root.path), "lane": lane, "current": cur, "previous": prev,
            "current_problems": problems,
            "unit": str(unit) if unit and unit.exists() else None,
            "unfinished": root.journal.pending() if busy else None,
            "server": None if info is None else {
                "pid": info["pid"], "instance": info["instance"], "url": info["url"],
                "is_current": info["instance"] == cur, "health": runner.health(info["url"])}}


def cmd_status(args) -> int:
    root = LaneRoot(args.root).require()
    with root.lock(wait=False) as held:
        repaired = txn.recover(root) if held else []
        st = status(root, busy=not held)
    st["repaired"] = repaired
    if args.json:
        print(json.dumps(st, indent=1))
    else:
        srv = st["server"]
        print("\n".join([
            f"root      {st['root']}", f"lane      {st['lane'] or '(none)'}",
            f"current   {st['current'] or '(none)'}"
            + (" (TAMPERED: see `./ninfer lane repair`)" if st["current_problems"] else ""),
            f"previous  {st['previous'] or '(none)'}", f"unit      {st['unit'] or '(none)'}",
            "server    " + ("not running" if srv is None else
                            f"pid {srv['pid']}, instance {srv['instance'][:16]}"
                            + ("" if srv["is_current"] else " (not current)")
                            + f", {srv['url']}, health {srv['health']}")]
            + [f"repaired  {x}" for x in repaired]
            + (["busy      another lane command holds the root"] if not held else [])))
    return 1 if st["current_problems"] else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer lane", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def cmd(name, fn, help_, root=True):
        s = sub.add_parser(name, help=help_)
        s.set_defaults(fn=fn)
        if root:
            s.add_argument("--root", default=str(DEFAULT_ROOT),
                           help=f"the lane state root (default {DEFAULT_ROOT})")
        return s

    s = cmd("pack", cmd_pack, "pack this tree as an immutable instance", root=False)
    s.add_argument("--out", help=f"where to put <id>/ (default {DEFAULT_PACKS})")
    s = cmd("install", cmd_install, "install an instance and make it current")
    s.add_argument("--from", dest="source", help="a packed instance (default: this tree)")
    s.add_argument("--lane", help="the lane to serve (default: the root's, else cpu)")
    s.add_argument("--enable", action="store_true",
                   help="also install and enable the unit in ~/.config/systemd/user")
    s.add_argument("--allow-no-rollback", action="store_true",
                   help="accept a store schema upgrade the previous instance cannot read")
    s.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to stop and restart a running server (default 600)")
    s.add_argument("--test-kill-after", choices=txn.INSTALL_STEPS, help=argparse.SUPPRESS)
    s = cmd("start", cmd_start, "start the current instance's server")
    s.add_argument("--python", help="run `PY -m server.cli serve` in the instance with this "
                                    "Python (one that has the locked requirements) instead of "
                                    "the instance's ./ninfer, which builds its own .venv")
    s.add_argument("--port", type=int, help="port (default: the lane's; 0: any free one)")
    s.add_argument("--synthetic-weights", action="store_true",
                   help="serve random weights of the lane's shapes "
                        "(serve --synthetic-weights)")
    s.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for /health (default 600)")
    s = cmd("stop", cmd_stop, "stop the server gracefully (live sessions are saved)")
    s.add_argument("--timeout", type=float, default=180.0, help="seconds (default 180)")
    s = cmd("status", cmd_status, "current and previous instances, the server, its health")
    s.add_argument("--json", action="store_true")
    s = cmd("rollback", cmd_rollback, "make the previous instance current again")
    s.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to stop and restart a running server (default 600)")
    s.add_argument("--test-kill-after", choices=txn.ROLLBACK_STEPS, help=argparse.SUPPRESS)
    cmd("repair", cmd_repair, "finish or undo an interrupted install or rollback")
    return p


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return EX_CONFIG if e.code else 0
    try:
        return args.fn(args)
    except LaneError as e:
        _say(str(e), err=True)
        return e.code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
