"""The wheels of a hashed lock, for one Python and platform, fetched by pip and checked by hash.

`fetch(lock, dest)` returns every distribution's wheel (name -> path in dest) for the target:
this machine (platform=None) or a manylinux platform tag (pip's --platform, --python-version,
--implementation cp). Files already in dest whose sha256 the lock admits are used again; a file
of the distribution with any other hash is deleted and fetched anew. The OCI image, Bazel and
Nix take the lock's wheels from here.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging import tags
from packaging.markers import Marker, default_environment
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import Version

from release.lockfile import Dist, parse

DEFAULT_PLATFORM = "manylinux_2_28_x86_64"


class WheelError(RuntimeError):
    pass


def sha256(path: Path) -> str:
    from release.manifest import sha256_file

    return sha256_file(path)


def _platforms(platform: str) -> list[str]:
    """The platform tags a `manylinux_2_N_arch` target accepts: it and every older manylinux
    tag with the legacy aliases (pip takes each --platform literally, so all are named)."""
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    major, minor, arch = int(m.group(1)), int(m.group(2)), m.group(3)
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    out = []
    for n in range(minor, 4, -1):
        out.append(f"manylinux_{major}_{n}_{arch}")
        if n in legacy:
            out.append(f"{legacy[n]}_{arch}")
    return out


def target_tags(python: str, platform: str | None) -> list[tags.Tag]:
    """The wheel tags pip accepts for CPython `python` on `platform` (None: this machine)."""
    version = tuple(int(x) for x in python.split(".")[:2])
    if platform is None and version == sys.version_info[:2]:
        return list(tags.sys_tags())
    plats = list(tags.platform_tags()) if platform is None else _platforms(platform)
    return [*tags.cpython_tags(version, platforms=plats),
            *tags.compatible_tags(version, "cp", platforms=plats)]


def _environment(python: str, platform: str | None) -> dict[str, str]:
    """The marker environment of CPython `python` on `platform` (None: this machine)."""
    env = dict(default_environment())
    env.update(python_version=python, python_full_version=python + ".0",
               implementation_name="cpython", platform_python_implementation="CPython")
    if platform is not None:
        m = re.fullmatch(r"(?:many|musl)linux_\d+_\d+_(\w+)|manylinux\d+_(\w+)", platform)
        arch = (m.group(1) or m.group(2)) if m else platform.rsplit("_", 1)[-1]
        env.update(sys_platform="linux", platform_system="Linux", os_name="posix",
                   platform_machine=arch)
    return env


def wanted(dists: list[Dist], python: str, platform: str | None) -> list[Dist]:
    """The lock's distributions whose environment marker holds for the target."""
    env = _environment(python, platform)
    return [d for d in dists if not d.marker or Marker(d.marker).evaluate(env)]


def _cached(dist: Dist, dest: Path, accept: set[tags.Tag]) -> Path | None:
    """dest's wheel of `dist` for the target, if its hash is one the lock admits; a file of
    the distribution with another hash is removed."""
    found = None
    for f in sorted(dest.glob("*.whl")):
        try:
            name, version, _, wtags = parse_wheel_filename(f.name)
        except InvalidWheelFilename:
            continue
        if name != dist.name or version != Version(dist.version):
            continue
        if sha256(f) not in dist.hashes:
            f.unlink()  # corrupted or from another lock: fetched anew
        elif found is None and wtags & accept:
            found = f
    return found


def _pip_download(dists: list[Dist], into: Path, python: str,
                  platform: str | None) -> subprocess.CompletedProcess:
    req = into / "requirements.txt"
    req.write_text("".join(f"{d.name}=={d.version} " + " ".join(f"--hash=sha256:{h}"
                                                                 for h in d.hashes) + "\n"
                           for d in dists))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--require-hashes", "--disable-pip-version-check", "--no-input", "-q",
           "--python-version", python, "--implementation", "cp", "-d", str(into / "dl"),
           "-r", str(req)]
    if platform is not None:
        # pip takes a PEP 600 tag literally: every older manylinux tag is named as well
        for plat in _platforms(platform):
            cmd += ["--platform", plat]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _reason(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines()
             if ln.strip() and "is ignored: it is neither a file nor a directory" not in ln]
    return lines[-1] if lines else "pip download failed"


def fetch(lock_path: Path | str, dest_dir: Path | str, *, python: str = "3.11",
          platform: str | None = DEFAULT_PLATFORM) -> dict[str, Path]:
    """Every distribution's wheel of the lock for CPython `python` on `platform` (None: this
    machine), by normalized name, as files in dest_dir. A distribution without a wheel for the
    target, or whose download does not match the lock's hashes, is a WheelError naming it."""
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    dists = wanted(parse(lock_path), python, platform)
    accept = set(target_tags(python, platform))
    out: dict[str, Path] = {}
    missing = []
    for d in dists:
        f = _cached(d, dest, accept)
        if f is not None:
            out[d.name] = f
        else:
            missing.append(d)
    if not missing:
        return out
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest) as tmp:
        stage = Path(tmp)
        res = _pip_download(missing, stage, python, platform)
        if res.returncode != 0:
            # one at a time, to name every distribution that fails
            failed = []
            (stage / "dl").mkdir(exist_ok=True)
            for d in missing:
                one = stage / "one" / d.name
                one.mkdir(parents=True)
                r = _pip_download([d], one, python, platform)
                if r.returncode != 0:
                    failed.append(f"{d.name}=={d.version}: {_reason(r.stderr)}")
                for f in (one / "dl").glob("*.whl"):
                    shutil.move(str(f), str(stage / "dl" / f.name))
            if failed:
                raise WheelError(f"{Path(lock_path).name}: no wheel for Python {python} on "
                                 f"{platform or 'this machine'}, or a hash mismatch: "
                                 + "; ".join(failed))
        for d in missing:
            got = [f for f in sorted((stage / "dl").glob("*.whl"))
                   if parse_wheel_filename(f.name)[0] == d.name]
            if not got:
                raise WheelError(f"{d.name}=={d.version}: pip downloaded no wheel")
            f = got[0]
            digest = sha256(f)
            if digest not in d.hashes:
                raise WheelError(f"{d.name}=={d.version}: {f.name} has sha256 {digest}, "
                                 "which the lock does not admit")
            final = dest / f.name
            shutil.move(str(f), final)
            out[d.name] = final
    return dict(sorted(out.items()))
