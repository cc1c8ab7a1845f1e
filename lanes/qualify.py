"""`./ninfer qualify`: qualify a lane on this machine and write its receipt.

    ./ninfer qualify --lane L [--out DIR] [--root DIR] [--from INSTANCE] [--synthetic-weights]
                     [--record-corpus] [--keep]

A fresh lane root (a temporary directory unless --root) gets a fresh install of this tree (or
of a packed INSTANCE), its server is started through the lane's preflight as its own process,
and the phases run against it with the real clients (lanes/qualify_phases.py, qualify_omp.py,
qualify_corpus.py hold each phase's pass rule). The receipt, DIR/<lane>.json (default
qualification/ in this tree, which `./ninfer release build` binds), records every phase's
measurements, verdict and duration, and binds the lane's engine bundle digest (built as the
release builds it), the profile hash, the model, the plan, the OMP version and the machine.

A failed phase gives a failed receipt, never a missing one. Exit 0: every phase passed; 1: a
phase failed; 78 (EX_CONFIG): an unknown lane, a failed preflight or an instance that does not
match the lane's profile (a failed receipt names the reason). The receipt is written
atomically with mode 0644: it is a public document (a release ships it), holds no key, prompt
or path of the state root, and anyone verifying a release must be able to read it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from lanes.cli import EX_CONFIG
from lanes.instance import REPO
from lanes.qualify_lane import LaneUnderTest, PhaseFailure
from lanes.root import LANE_NAME

RECEIPT_MODE = 0o644
# phases whose rule needs the real model: skipped (and listed) under --synthetic-weights
NEEDS_REAL_WEIGHTS = ("retrieval", "role_corpus", "agent_protocol", "tool_turn")


class Refused(Exception):
    """Qualification cannot start (bad input): the receipt fails with this reason, exit 78."""


def machine() -> dict:
    from lanes.preflight import probe_gpus

    cpu = None
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in
                    Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), None)
    except OSError:
        pass
    gpus = probe_gpus()
    return {"cpu": cpu or platform.processor() or None, "cpus": os.cpu_count(),
            "system": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(),
            "gpus": [{"name": g.name, "memory_mib": g.memory_mib, "driver": g.driver}
                     for g in gpus] if isinstance(gpus, list) else [], "gpu_probe":
            None if isinstance(gpus, list) else gpus}


def bundle_digest(lane: str, work: Path) -> dict:
    """The lane's engine bundle as `./ninfer release build` makes it from this tree (same
    function, same epoch rule): its sha256 is what the release binds."""
    from release.build import source_facts
    from release.bundle import build_bundle

    src = source_facts(REPO)
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    epoch = int(epoch) if epoch else src["epoch"]
    if epoch is None:
        raise Refused("no epoch for the bundle: qualify from a git checkout, or set "
                      "SOURCE_DATE_EPOCH as the release build will")
    b = build_bundle(lane, work / "engine-bundle.tar", tree=REPO, epoch=epoch)
    return {"sha256": b["sha256"], "size": b["size"], "epoch": epoch, "commit": src["commit"],
            "dirty": src["dirty"]}


def _instance(args, profile, work: Path) -> tuple[str | None, str]:
    """(the --from argument for `lane install` or None for this tree, the instance id); an
    instance whose profile for the lane is not this tree's is refused."""
    from lanes.instance import LaneError, Source

    try:
        src = Source.from_instance(Path(args.source)) if args.source else Source.from_tree()
    except LaneError as e:
        raise Refused(str(e)) from None
    have = src.manifest.get("profiles", {}).get(profile.name)
    if have != profile.canonical_hash():
        raise Refused(f"instance {src.id[:16]} does not match lane {profile.name}'s profile: "
                      f"it holds profile_sha256 {have}, the lane's is "
                      f"{profile.canonical_hash()}")
    return (str(src.dir) if args.source else None), src.id


def first_start(lane: LaneUnderTest, profile, source: str | None, iid: str) -> dict:
    t0 = time.monotonic()
    lane.command("install", "--lane", profile.name, *(["--from", source] if source else []))
    install_s = time.monotonic() - t0
    start_s = lane.start()
    st = lane.status()
    if st["current"] != iid or not st["server"]["is_current"]:
        raise PhaseFailure(f"the server runs instance {st['server']['instance'][:16]}, not the "
                           f"qualified {iid[:16]}")
    code, s = lane.call("GET", "/v1/ninfer/status")
    if code != 200:
        raise PhaseFailure(f"GET /v1/ninfer/status answered {code}")
    if s["lane"]["profile_sha256"] != profile.canonical_hash():
        raise PhaseFailure(f"the server runs profile {s['lane']['profile_sha256']}, not the "
                           f"lane's {profile.canonical_hash()}")
    if bool(s["model"].get("synthetic_weights")) != lane.synthetic:
        raise PhaseFailure(f"the server says synthetic_weights="
                           f"{s['model'].get('synthetic_weights')}, qualification asked for "
                           f"{lane.synthetic}")
    if not lane.synthetic and s["model"]["artifact_sha256"] != profile.model_sha256:
        raise PhaseFailure(f"the server's model is {s['model']['artifact_sha256']}, the "
                           f"profile pins {profile.model_sha256}")
    lane.facts = s
    return {"install_s": round(install_s, 3), "start_s": round(start_s, 3),
            "instance": iid, "synthetic_weights": bool(s["model"].get("synthetic_weights"))}


def _phases(args, profile, work: Path, key):
    from lanes import qualify_corpus, qualify_omp
    from lanes import qualify_phases as P

    return [("retrieval", P.retrieval), ("decode", P.decode), ("speculative", P.speculative),
            ("restart", P.restart), ("multisession", P.multisession),
            ("role_corpus", lambda lane, prof: qualify_corpus.role_corpus(
                lane, key(), recording=args.record_corpus)),
            ("agent_protocol", lambda lane, prof: qualify_omp.agent_protocol(lane, prof, work)),
            ("tool_turn", lambda lane, prof: qualify_omp.tool_turn(lane, prof, work)),
            ("rollback", lambda lane, prof: P.rollback(lane, prof, work)),
            ("protected_state", P.protected)]


def _run_phase(receipt: dict, name: str, fn, lane: LaneUnderTest, profile, log) -> None:
    from lanes.qualify_phases import NotApplicable

    t0 = time.monotonic()
    entry: dict = {}
    try:
        entry = {"verdict": "pass", "measurements": fn(lane, profile)}
    except NotApplicable as e:
        entry = {"verdict": "not_applicable", "reason": str(e), "measurements": {}}
    except PhaseFailure as e:
        entry = {"verdict": "fail", "reason": str(e), "measurements": e.measurements}
    except Exception as e:  # a phase that breaks is a failed phase, named, never a lost receipt
        entry = {"verdict": "fail", "reason": f"{type(e).__name__}: {e}", "measurements": {}}
    entry["seconds"] = round(time.monotonic() - t0, 3)
    receipt["phases"][name] = entry
    log(f"{name}: {entry['verdict']} in {entry['seconds']:.1f} s"
        + (f" ({entry['reason']})" if entry.get("reason") else ""))
    if entry["verdict"] == "fail" and lane.url is not None:
        try:  # a phase that stopped the server leaves the next ones a running one
            lane.refresh()
        except PhaseFailure:
            try:
                lane.start()
            except PhaseFailure:
                pass


def qualify(args, log) -> tuple[dict, int]:
    from lanes.qualify_omp import omp_version

    receipt = {"format": "ninfer-receipt/1", "lane": args.lane, "verdict": "fail",
               "reason": None, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "synthetic_weights": bool(args.synthetic_weights),
               "skipped_for_synthetic_weights": list(NEEDS_REAL_WEIGHTS)
               if args.synthetic_weights else [], "omp": {"version": omp_version()},
               "machine": machine(), "phases": {}}
    t_all = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="ninfer-qualify-"))
    root = Path(args.root).absolute() if args.root else work / "root"
    lane = None
    try:
        from lanes.preflight import preflight
        from lanes.profile import ProfileError, load_profile

        if not LANE_NAME.match(args.lane):
            raise Refused(f"unknown lane {args.lane!r}")
        try:
            profile = load_profile(args.lane)
        except ProfileError as e:
            raise Refused(f"unknown lane {args.lane!r}: {e}") from None
        receipt["profile_sha256"] = profile.canonical_hash()
        receipt["plan"] = profile.plan.to_dict()
        problems = preflight(profile, state_dir=work, checkpoints=True,
                             synthetic=args.synthetic_weights)
        if problems:
            raise Refused("preflight refused: " + "; ".join(problems))
        source, iid = _instance(args, profile, work)
        b = bundle_digest(profile.name, work)
        receipt["bundle_sha256"], receipt["bundle"] = b["sha256"], b
        lane = LaneUnderTest(root, profile.name, synthetic=args.synthetic_weights)
        _run_phase(receipt, "first_start", lambda ln, p: first_start(ln, p, source, iid),
                   lane, profile, log)
        if receipt["phases"]["first_start"]["verdict"] != "pass":
            raise PhaseFailure("the first managed start failed: "
                               + receipt["phases"]["first_start"]["reason"])
        s = lane.facts
        receipt["model"] = {"id": s["model"]["id"], "sha256": s["model"]["artifact_sha256"],
                            "config_hash": s["model"]["config_hash"]}
        receipt["plan"] = s["plan"]
        from lanes.qualify_corpus import corpus_key

        key = lambda: corpus_key(s["model"]["artifact_sha256"], s["plan"], profile.name)  # noqa
        for name, fn in _phases(args, profile, work, key):
            if args.synthetic_weights and name in NEEDS_REAL_WEIGHTS:
                receipt["phases"][name] = {"verdict": "skipped", "reason": "synthetic weights",
                                           "measurements": {}, "seconds": 0.0}
                continue
            _run_phase(receipt, name, fn, lane, profile, log)
        failed = [n for n, p in receipt["phases"].items() if p["verdict"] == "fail"]
        receipt["verdict"] = "fail" if failed else "pass"
        receipt["reason"] = ("failed phases: " + ", ".join(failed)) if failed else None
        code = 1 if failed else 0
    except Refused as e:
        receipt["reason"], code = str(e), EX_CONFIG
    except PhaseFailure as e:
        receipt["reason"], code = str(e), 1
    except Exception as e:
        receipt["reason"], code = f"{type(e).__name__}: {e}", 1
    finally:
        if lane is not None and (lane.root / ".ninfer-lanes").exists():
            try:
                lane.stop()
            except PhaseFailure as e:
                log(f"stopping the server: {e}")
        if not args.keep:
            from lanes.instance import force_rmtree

            force_rmtree(work)
    receipt["seconds"] = round(time.monotonic() - t_all, 3)
    return scrub(receipt, {str(REPO): "<tree>", str(work): "<work>", str(root): "<root>"}), code


def scrub(obj, paths: dict[str, str]):
    """The receipt without this machine's paths (each of `paths` by its name) and without
    anything a release's verifier refuses as private or a placeholder (release/verify.py):
    a receipt is published inside the release."""
    from release.verify import PRIVATE

    if isinstance(obj, dict):
        return {k: scrub(v, paths) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v, paths) for v in obj]
    if isinstance(obj, str):
        for path, name in sorted(paths.items(), key=lambda kv: -len(kv[0])):
            obj = obj.replace(path, name)
        return PRIVATE.sub("[private]", obj)
    return obj


def write_receipt(receipt: dict, out: Path) -> Path:
    """Atomically: a temporary file in `out`, fsync'd, renamed over <lane>.json."""
    lane = receipt["lane"] if LANE_NAME.match(str(receipt["lane"])) else "invalid-lane"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{lane}.json"
    tmp = out / f".{lane}.json.tmp-{os.getpid()}"
    data = (json.dumps(receipt, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, RECEIPT_MODE)
    try:
        os.fchmod(fd, RECEIPT_MODE)  # whatever the umask
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ninfer qualify", description=__doc__.splitlines()[0])
    ap.add_argument("--lane", required=True, help="the lane to qualify (a profile name)")
    ap.add_argument("--out", default=str(REPO / "qualification"),
                    help="where <lane>.json goes (default: qualification/ in this tree)")
    ap.add_argument("--root", help="the lane root to install into (new or empty; default: a "
                                   "temporary one, removed afterwards)")
    ap.add_argument("--from", dest="source", help="qualify this packed instance (default: "
                                                  "this tree)")
    ap.add_argument("--synthetic-weights", action="store_true",
                    help="serve random weights of the lane's shapes; the phases that need the "
                         "real model are skipped and the receipt can never make a lane ready")
    ap.add_argument("--record-corpus", action="store_true",
                    help="record the role corpus's outputs for this (model, plan, lane) in "
                         "qualification/corpus/golden.json instead of comparing them")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return EX_CONFIG if e.code else 0

    def log(line: str) -> None:
        print(f"ninfer qualify: {line}", file=sys.stderr, flush=True)

    receipt, code = qualify(args, log)
    path = write_receipt(receipt, Path(args.out))
    log(f"lane {args.lane}: {receipt['verdict']}"
        + (f" ({receipt['reason']})" if receipt["reason"] else "")
        + f"; receipt {path} in {receipt['seconds']:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
