"""The release build's figures: time on this machine cold (empty download and CUDA caches) and
cached, the size of each lane's parts, and whether the two builds are byte-identical.

    .venv/bin/python -m bench.release_build [--out docs/benchmarks/release.json]

Cold: a fresh cache directory (the Debian packages and the lock's wheels fetched and checked by
hash) and a fresh NINFER_CUDA_CACHE (the CUDA ops compiled). Cached: the same again. Both
builds use the commit's time as the epoch, so their bytes are compared file by file."""
from __future__ import annotations

import argparse
import datetime
import filecmp
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# What the release build takes from the machine rather than from a hash, and why.
IMPURE = {
    "bazel: host Python 3.11": "no rules_python offline; the interpreter is found on PATH",
    "bazel and release build: nvcc and its host compiler": "no CUDA toolchain as a pinned "
        "download here; the CUDA ops' library names carry nvcc's version, and two builds with "
        "one nvcc are byte-identical",
    "nix: /usr/bin/python3.11, pip, /bin/sh, coreutils": "no nixpkgs offline; they enter the "
        "sandbox through sandbox-paths (nix/README.md)",
    "OCI base layer: Debian bookworm .debs": "pinned by sha256 (release/base_debian.lock) but "
        "fetched from the Debian archive, which drops old versions: re-pin to build later",
    "wheels: the package index": "every file pinned by sha256 in the locks; the index only "
        "serves them",
}


def _sizes(lane_dir: Path) -> dict:
    oci = sum(f.stat().st_size for f in (lane_dir / "oci").rglob("*") if f.is_file())
    return {"engine_bundle": (lane_dir / "engine-bundle.tar").stat().st_size,
            "oci_layout": oci,
            "sbom_spdx": (lane_dir / "sbom.spdx.json").stat().st_size,
            "sbom_cyclonedx": (lane_dir / "sbom.cdx.json").stat().st_size}


def _same(a: Path, b: Path) -> list[str]:
    files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    return [f for f in files if not (b / f).is_file() or not filecmp.cmp(a / f, b / f, False)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench.release_build")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "release.json")
    args = ap.parse_args(argv)
    from bench.suites import machine
    from release.build import build
    from release.manifest import sha256_file

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="ninfer-release-bench-") as tmp:
        tmp = Path(tmp)
        os.environ["NINFER_CUDA_CACHE"] = str(tmp / "cuda")
        runs = []
        for name in ("cold", "cached"):
            t0 = time.monotonic()
            build(tmp / name / "v0.16.0", cache=tmp / "cache", log=print)
            runs.append((name, round(time.monotonic() - t0, 1)))
        a, b = tmp / "cold" / "v0.16.0", tmp / "cached" / "v0.16.0"
        doc = json.loads((a / "manifest.json").read_text())
        result = {
            "command": "python -m bench.release_build",
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
            "commit": commit,
            "plan": {n: e["bundle"]["platform"] for n, e in doc["lanes"].items()},
            "build_seconds": dict(runs),
            "manifest_sha256": sha256_file(a / "manifest.json"),
            "byte_identical": _same(a, b) == [],
            "differing_files": _same(a, b),
            "sizes_bytes": {n: _sizes(a / "lanes" / n) for n in doc["lanes"]},
            "total_bytes": sum(f.stat().st_size for f in a.rglob("*") if f.is_file()),
            "status": {n: e["status"] for n, e in doc["lanes"].items()},
            "impure": IMPURE,
        }
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(json.dumps({k: result[k] for k in ("build_seconds", "byte_identical", "total_bytes")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
