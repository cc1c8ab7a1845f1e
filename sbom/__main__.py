"""`python -m sbom build ...` writes a lane's two SBOMs; `python -m sbom validate FILE...` checks
SBOM files (SPDX when the name ends in .spdx.json, CycloneDX when it ends in .cdx.json) and
exits 1 listing the problems."""
from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from sbom.cyclonedx import cyclonedx_document, validate_cyclonedx
from sbom.inventory import OMP_LOCK, FileEntry, ModelIdentity, inventory_for_lane
from sbom.spdx import spdx_document, validate_spdx


def _created(arg: str | None) -> str:
    if arg:
        return arg
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if not epoch:
        raise SystemExit("--created or SOURCE_DATE_EPOCH is required (the SBOM's fixed timestamp)")
    return datetime.fromtimestamp(int(epoch), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _file(spec: str) -> FileEntry:
    try:
        disk, name, kind = spec.split(":", 2)
    except ValueError:
        raise SystemExit(f"--file wants DISK_PATH:RELEASE_PATH:KIND, got {spec!r}") from None
    return FileEntry.from_path(disk, name, kind)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sbom")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write sbom.spdx.json and sbom.cdx.json for one lane")
    b.add_argument("--lane", required=True)
    b.add_argument("--version", required=True)
    b.add_argument("--lock", required=True, help="the lane's hashed requirements lock")
    b.add_argument("--created", help="ISO-8601 UTC; default: SOURCE_DATE_EPOCH")
    b.add_argument("--file", action="append", default=[], metavar="DISK:PATH:KIND")
    b.add_argument("--model", required=True, metavar="NAME,PRESET,WEIGHTS,SHA256|-,SOURCE")
    b.add_argument("--npm-lock", default=str(OMP_LOCK), help="the OMP client's package-lock.json")
    b.add_argument("--out", required=True, help="directory for the two files")
    v = sub.add_parser("validate", help="check SBOM files; exit 1 on any problem")
    v.add_argument("paths", nargs="+")
    args = ap.parse_args(argv)

    if args.cmd == "build":
        name, preset, weights, sha, source = (args.model.split(",", 4) + [""] * 5)[:5]
        model = ModelIdentity(name, preset, weights, None if sha in ("", "-") else sha, source)
        inv = inventory_for_lane(args.lane, args.lock, [_file(s) for s in args.file], model,
                                 _created(args.created), args.version, package_lock_path=args.npm_lock)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sbom.spdx.json").write_bytes(spdx_document(inv))
        (out / "sbom.cdx.json").write_bytes(cyclonedx_document(inv))
        return 0

    bad = 0
    for p in args.paths:
        if p.endswith(".spdx.json"):
            problems = validate_spdx(p)
        elif p.endswith(".cdx.json"):
            problems = validate_cyclonedx(p)
        else:
            problems = [f"{p}: name must end in .spdx.json or .cdx.json"]
        for line in problems:
            print(line)
        bad += bool(problems)
        if not problems:
            print(f"{p}: ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
