"""Which published OMP versions newer than the pinned one install, unmodified, from the registry.

The pinned client (tests/omp) needed hand-added lock entries, so "installs" here means what a
user gets from a plain `npm install` of the package and Bun, scripts off: first resolution alone
(`--package-lock-only`, ~15 s), which is where a release with an unpublished dependency fails,
then, for the newest version that resolves, the whole install and `omp --version`. The pinned
version goes through the same resolution first, as the control: a survey in which nothing
resolves says something only if the pinned version does.

    .venv/bin/python -m tests.omp_versions [--out docs/benchmarks/omp_versions.json]

prints the survey (JSON: each version tried, newest first, and npm's reason for each one that did
not install) and writes it with --out. The slow tier runs the same survey and then a turn against
the server with the newest version that installs (tests/test_omp_client.py).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.omp_client import BUN, NODE_MODULES, OMP_CLI, OMP_DIR, OMP_VERSION

PACKAGE = "@oh-my-pi/pi-coding-agent"
BUN_PACKAGE = "@oven/bun-linux-x64"
_STABLE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


def version_key(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a release version; None for a pre-release or anything else."""
    m = _STABLE.match(version)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def _npm() -> str:
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not on PATH: the OMP version survey needs Node.js and npm")
    return npm


def newer_versions(pinned: str = OMP_VERSION, timeout: float = 120.0) -> list[str]:
    """The registry's release versions of OMP above `pinned`, newest first."""
    proc = subprocess.run([_npm(), "view", PACKAGE, "versions", "--json"], capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"npm view {PACKAGE} versions failed ({proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    floor = version_key(pinned)
    found = [v for v in json.loads(proc.stdout) if (k := version_key(v)) is not None and k > floor]
    return sorted(found, key=version_key, reverse=True)


def bun_version() -> str:
    """Bun as pinned beside OMP in tests/omp/package.json."""
    return json.loads((OMP_DIR / "package.json").read_text())["dependencies"][BUN_PACKAGE]


@dataclass
class Attempt:
    version: str
    step: str  # "resolve" or "install": how far it was taken
    ok: bool
    reason: str  # npm's own error lines when not ok; "" when ok
    seconds: float


def _npm_errors(stderr: str) -> str:
    """npm's error lines, without the pointer to its debug log and the generic hint."""
    keep = [line.removeprefix("npm error").strip() for line in stderr.splitlines()
            if line.startswith("npm error") and "complete log" not in line
            and "In most cases" not in line]
    return " | ".join(line for line in keep if line) or stderr.strip()[-500:]


def _project(dest: Path, version: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "package.json").write_text(json.dumps(
        {"name": "omp-survey", "version": "0.0.0", "private": True,
         "dependencies": {PACKAGE: version, BUN_PACKAGE: bun_version()}}, indent=1) + "\n")
    (dest / ".npmrc").write_text("ignore-scripts=true\n")


def resolve(version: str, dest: Path, timeout: float = 600.0) -> Attempt:
    """Does OMP `version`'s whole dependency tree resolve from the registry?"""
    _project(dest, version)
    t0 = time.monotonic()
    proc = subprocess.run([_npm(), "install", "--package-lock-only", "--ignore-scripts",
                           "--no-audit", "--no-fund"], cwd=dest, capture_output=True, text=True,
                          timeout=timeout)
    ok = proc.returncode == 0 and (dest / "package-lock.json").is_file()
    return Attempt(version, "resolve", ok, "" if ok else _npm_errors(proc.stderr),
                   round(time.monotonic() - t0, 1))


def install(version: str, dest: Path, timeout: float = 1200.0) -> tuple[Attempt, Path]:
    """Install OMP `version` and Bun into `dest` and run `omp --version`; returns the attempt
    and the node_modules directory (tests.omp_client.OmpClient's `modules`)."""
    _project(dest, version)
    t0 = time.monotonic()
    proc = subprocess.run([_npm(), "install", "--ignore-scripts", "--no-audit", "--no-fund"],
                          cwd=dest, capture_output=True, text=True, timeout=timeout)
    modules = dest / "node_modules"
    reason = "" if proc.returncode == 0 else _npm_errors(proc.stderr)
    if not reason:
        # the same layout as the pinned install's
        bun, cli = (modules / p.relative_to(NODE_MODULES) for p in (BUN, OMP_CLI))
        ran = subprocess.run([str(bun), str(cli), "--version"], capture_output=True, text=True,
                             timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(dest)})
        if ran.returncode != 0 or version not in ran.stdout:
            reason = (f"installed, but `omp --version` exited {ran.returncode}: "
                      f"{(ran.stdout + ran.stderr).strip()[-500:]}")
    return (Attempt(version, "install", not reason, reason, round(time.monotonic() - t0, 1)),
            modules)


def survey(work: Path, pinned: str = OMP_VERSION) -> dict:
    """The control (the pinned version resolves), then each newer version, newest first, until
    one resolves. Installs nothing: `install` is the caller's next step for `newest`."""
    control = resolve(pinned, work / pinned)
    tried: list[Attempt] = []
    newest = None
    for version in newer_versions(pinned):
        tried.append(attempt := resolve(version, work / version))
        if attempt.ok:
            newest = version
            break
    npm = subprocess.run([_npm(), "--version"], capture_output=True, text=True).stdout.strip()
    return {"package": PACKAGE, "pinned": pinned, "bun": bun_version(), "npm": npm,
            "date": time.strftime("%Y-%m-%d"), "control": asdict(control),
            "tried": [asdict(a) for a in tried], "newest_resolving": newest}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="also write the survey (JSON) here")
    ap.add_argument("--install", action="store_true",
                    help="install the newest version that resolves and run `omp --version`")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="omp-survey-") as tmp:
        record = survey(Path(tmp))
        if a.install and record["newest_resolving"]:
            attempt, _ = install(record["newest_resolving"], Path(tmp) / "install")
            record["install"] = asdict(attempt)
    record["command"] = "python -m tests.omp_versions" + (" --install" if a.install else "")
    text = json.dumps(record, indent=1) + "\n"
    if a.out:
        a.out.write_text(text)
    sys.stdout.write(text)
    return 0 if record["control"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
