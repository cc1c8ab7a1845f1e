"""`./ninfer release build`: the whole release, every lane, into one directory.

    ./ninfer release build [--out dist/v0.16.0] [--version 0.16.0] [--lanes cpu,h200,...]
                           [--epoch SECONDS] [--cache DIR] [--gpu-layers] [--cuda-ops DIR]

The build writes into a sibling staging directory and renames it into place when every part is
written, so a reader never sees half a release. Every timestamp inside is the epoch: the
commit time of the source tree, receipts aside (or SOURCE_DATE_EPOCH, or --epoch), so two
builds of one commit are byte-identical. Per lane it writes the resolved profile, the engine bundle, the OCI image
and both SBOMs; then the compatibility file, the qualification receipts that exist
(qualification/<lane>.json in the tree), manifest.json and SHA256SUMS (release/manifest.py).
Exit 0: built; 1: a part failed (the message names it); 2: bad arguments.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from release import manifest as M

REPO = Path(__file__).resolve().parent.parent
VERSION = "0.16.0"
DEFAULT_CACHE = Path.home() / ".cache" / "ninfer" / "release"
CPU_LOCK, GPU_LOCK = "requirements.lock", "requirements-gpu.lock"


class BuildError(RuntimeError):
    pass


def source_facts(tree: Path) -> dict:
    """The commit the release is built from, its time, and whether the tree had changes."""
    def git(*args):
        out = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "epoch": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    # the newest commit that changed anything but the receipts: a receipt binds the bundle
    # built at this epoch, so committing it must not move the epoch (and the bundle's digest)
    epoch = git("log", "-1", "--format=%ct", "--", ".", ":(exclude)qualification")
    return {"commit": commit, "epoch": int(epoch or git("log", "-1", "--format=%ct")),
            "dirty": bool(status)}


def lane_lock(profile) -> str:
    return GPU_LOCK if profile.gpu else CPU_LOCK


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def build_lane(stage: Path, tree: Path, name: str, *, epoch: int, version: str, cache: Path,
               gpu_layers: bool, log, cuda_ops: Path | None = None) -> dict:
    """One lane's profile, bundle, image and SBOMs under stage/lanes/<name>; its manifest
    entry."""
    from lanes.profile import load_profile
    from release.bundle import build_bundle, open_bundle
    from release import image
    from sbom.cyclonedx import cyclonedx_document
    from sbom.inventory import FileEntry, ModelIdentity, inventory_for_lane
    from sbom.spdx import spdx_document

    profile = load_profile(name)
    rel = Path("lanes") / name
    out = stage / rel
    out.mkdir(parents=True)
    resolved = M.resolved_profile(profile)
    _write(out / "profile.json", M.dumps(resolved))
    lock = tree / lane_lock(profile)
    if not lock.exists():
        raise BuildError(f"lane {name}: its lock {lock.name} is missing (./ninfer lock)")

    t0 = time.monotonic()
    bundle = build_bundle(name, out / "engine-bundle.tar", tree=tree, epoch=epoch,
                          cuda_ops=cuda_ops)
    log(f"lane {name}: engine bundle {bundle['size']:,} bytes in {time.monotonic() - t0:.1f} s")
    opened = open_bundle(out / "engine-bundle.tar", expect_lane=name)
    bundle.update(platform=opened.platform, jax=opened.manifest["jax"],
                  cuda_ops=[{"path": f"cuda/{n}", "sha256": M.sha256_bytes(b),
                             "sha1": M.sha1_bytes(b)}
                            for n, b in sorted(opened.cuda_libraries().items())])
    cuda_libs = sorted(opened.cuda_libraries())
    del opened
    # the image installs the lock over its base and runs the bundle: both must fit
    problems = M.lock_problems(lock, bundle["jax"])
    if problems:
        raise BuildError(f"lane {name}: " + "; ".join(problems))
    t0 = time.monotonic()
    # every image carries its lane's bundle, exported with the JAX its lock installs, and
    # serves from it (CUDA exports run on a GPU: tests/test_engine_gpu.py)
    common = dict(tree=tree, lock=lock, profile_name=name, epoch=epoch, cache_dir=cache,
                  bundle=out / "engine-bundle.tar", serve_bundle=True)
    if profile.gpu:
        digests = image.gpu_image(out / "oci", with_dependencies=gpu_layers, **common)
    else:
        digests = image.cpu_image(out / "oci", **common)
    log(f"lane {name}: OCI image in {time.monotonic() - t0:.1f} s")

    # paths relative to the lane's directory; a CUDA op library by its path inside the bundle
    files = [FileEntry(path="engine-bundle.tar", sha256=bundle["sha256"],
                       sha1=M.sha1_file(out / "engine-bundle.tar"), kind="engine-bundle")]
    files += [FileEntry(path=f"engine-bundle.tar/{f['path']}", sha256=f["sha256"],
                        sha1=f["sha1"], kind="cuda-op") for f in bundle.get("cuda_ops", [])]
    p = resolved["profile"]
    model = ModelIdentity(name=p["model"], preset=p.get("model_preset"), weights=p["weights"],
                          sha256=p["model_sha256"],
                          source=json.dumps(p.get("model_source"), sort_keys=True))
    created = datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    inv = inventory_for_lane(name, lock, files, model, created, version,
                             package_lock_path=tree / "tests" / "omp" / "package-lock.json")
    _write(out / "sbom.spdx.json", spdx_document(inv))
    _write(out / "sbom.cdx.json", cyclonedx_document(inv))

    cuda = cuda_libs[0] if cuda_libs else None  # the library name the fingerprint records
    fp = M.checkpoint_fingerprint(profile, bundle["jax"], bundle["platform"], cuda)
    entry = {
        "profile": {"path": (rel / "profile.json").as_posix(),
                    "profile_sha256": resolved["profile_sha256"]},
        "lock": lock.name,
        "bundle": {"path": (rel / "engine-bundle.tar").as_posix(), "sha256": bundle["sha256"],
                   "size": bundle["size"], "platform": bundle["platform"],
                   "jax": bundle["jax"]},
        "oci": {"path": (rel / "oci").as_posix(), "ref": name,
                "index": digests["index"], "manifest": digests["manifest"],
                "config": digests["config"], "layers": digests["layers"],
                "dependency_layer": "built" if not profile.gpu or gpu_layers else "not-built"},
        "sboms": {"spdx": (rel / "sbom.spdx.json").as_posix(),
                  "cyclonedx": (rel / "sbom.cdx.json").as_posix()},
        "model": {"name": p["model"], "preset": p.get("model_preset"), "weights": p["weights"],
                  "sha256": p["model_sha256"]},
    }
    compat = {"card": M.lane_card(profile), "context_tokens": profile.context_tokens,
              "weights": profile.weights, "kv_dtype": profile.kv_dtype, "fingerprint": fp}
    return {"entry": entry, "compat": compat}


def lane_status(name: str, entry: dict, stage: Path, tree: Path) -> dict:
    """Copy the lane's receipt if the tree has one; the lane's status and blockers."""
    src = tree / "qualification" / f"{name}.json"
    receipt = None
    if src.exists():
        dst = stage / "qualification" / f"{name}.json"
        _write(dst, src.read_bytes())
        entry["receipt"] = {"path": f"qualification/{name}.json", "sha256": M.sha256_file(dst)}
        try:
            receipt = json.loads(src.read_bytes())
        except ValueError:
            receipt = {}
    else:
        entry["receipt"] = None
    blockers = M.receipt_blockers(name, receipt, entry["bundle"]["sha256"],
                                  entry["profile"]["profile_sha256"], entry["model"]["sha256"])
    if entry["model"]["sha256"] is None:
        blockers.append(f"lane {name}: its model artifact is not pinned (model_sha256)")
    entry["blockers"] = blockers
    entry["status"] = "candidate" if blockers else "ready"
    return entry


def build(out: Path, *, tree: Path = REPO, version: str = VERSION, lanes: list[str] | None = None,
          epoch: int | None = None, cache: Path = DEFAULT_CACHE, gpu_layers: bool = False,
          log=print, cuda_ops: Path | None = None) -> dict:
    from lanes.profile import PROFILE_DIR

    src = source_facts(tree)
    epoch = epoch if epoch is not None else src["epoch"]
    if epoch is None:
        raise BuildError("no epoch: build from a git checkout, or give --epoch/SOURCE_DATE_EPOCH")
    lanes = lanes or sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))
    out = out.resolve()
    stage = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        from release.lock import check as check_lock

        entries, compat = {}, {}
        for lock in (CPU_LOCK, GPU_LOCK):
            if (tree / lock).exists():
                # a dirty lock (an index or local path, an unhashed or unpinned package)
                # stops the build, naming the package
                problems = check_lock(tree / lock)
                if problems:
                    raise BuildError(f"{lock}: " + "; ".join(problems))
                _write(stage / "locks" / lock, (tree / lock).read_bytes())
        for name in lanes:
            part = build_lane(stage, tree, name, epoch=epoch, version=version, cache=cache,
                              gpu_layers=gpu_layers, log=log, cuda_ops=cuda_ops)
            entries[name], compat[name] = part["entry"], part["compat"]
        omp = M.omp_versions(tree / "tests" / "omp" / "package-lock.json")
        _write(stage / "compatibility.json", M.dumps(M.compatibility(compat, omp)))
        for name, entry in entries.items():
            lane_status(name, entry, stage, tree)
        ready = all(e["status"] == "ready" for e in entries.values()) and not src["dirty"]
        files = M.listing(stage)
        doc = {"format": M.FORMAT, "version": version,
               "status": "ready" if ready else "candidate",
               "source": {"commit": src["commit"], "dirty": src["dirty"], "epoch": epoch},
               "locks": {Path(f).name: M.sha256_file(stage / f) for f in files
                         if f.startswith("locks/")},
               "compatibility": {"path": "compatibility.json",
                                 "sha256": M.sha256_file(stage / "compatibility.json")},
               "lanes": entries,
               "files": {f: M.sha256_file(stage / f) for f in files}}
        _write(stage / "manifest.json", M.dumps(doc))
        _write(stage / "SHA256SUMS", M.sums(stage, files + ["manifest.json"]))
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            stage.rename(out)
            shutil.rmtree(old)
        else:
            stage.rename(out)
        return doc
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ninfer release build")
    ap.add_argument("--out", type=Path, help=f"default dist/v{VERSION}")
    ap.add_argument("--version", default=VERSION)
    ap.add_argument("--lanes", help="comma-separated lanes (default: every lane profile)")
    ap.add_argument("--epoch", type=int, help="timestamp inside every artefact "
                    "(default: SOURCE_DATE_EPOCH, else the commit time)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                    help="downloaded wheels and Debian packages, checked by hash on use")
    ap.add_argument("--gpu-layers", action="store_true",
                    help="also build the GPU lanes' dependency layers (CUDA wheels, GBs)")
    ap.add_argument("--cuda-ops", type=Path, metavar="DIR",
                    help="take the CUDA ops from DIR (int4_gemv-sm<arch>.so, as Bazel's "
                         "//engine:cuda_ops builds them) instead of building them here")
    args = ap.parse_args(argv)
    epoch = args.epoch
    if epoch is None and os.environ.get("SOURCE_DATE_EPOCH"):
        epoch = int(os.environ["SOURCE_DATE_EPOCH"])
    out = args.out or REPO / "dist" / f"v{args.version}"
    lanes = args.lanes.split(",") if args.lanes else None
    t0 = time.monotonic()
    try:
        doc = build(out, version=args.version, lanes=lanes, epoch=epoch, cache=args.cache,
                    gpu_layers=args.gpu_layers, cuda_ops=args.cuda_ops)
    except (BuildError, OSError, ValueError) as e:
        print(f"ninfer release build: {e}", file=sys.stderr)
        return 1
    print(f"release {args.version} ({doc['status']}) written to {out} in "
          f"{time.monotonic() - t0:.1f} s; manifest sha256 {M.sha256_file(out / 'manifest.json')}")
    for name, e in doc["lanes"].items():
        print(f"  {name}: {e['status']}" + "".join(f"\n    - {b}" for b in e["blockers"]))
    return 0
