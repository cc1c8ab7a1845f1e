"""`./ninfer lock`: the hashed locks, one a platform, made with `uv pip compile`, and their check.

    requirements.lock      requirements.in      Python 3.11, Linux x86_64, CPU JAX
    requirements-dev.lock  requirements-dev.in  the same plus tests and release tools
                                                (the .in constrains it by requirements.lock)
    requirements-gpu.lock  requirements-gpu.in  Python 3.11 (the GPU images' bookworm base),
                                                manylinux_2_31 x86_64 wheels, the release's JAX
                                                with CUDA 13; every package it shares with
                                                requirements.lock (all but those the .in pins)
                                                keeps that pin

uv does not read pip's configuration, so the machine's mirrors (`pip config list`:
index-url, extra-index-url, find-links) are handed to uv on its command line; no lock ever
names them. Each compile runs in a scratch directory holding copies of the .in files and the
committed lock, whose pins uv keeps (the GPU lock's pins are kept as constraints instead), so
`./ninfer lock --check` re-resolves without touching the tree and reports a stale lock;
`--check --static` skips the re-resolution (offline). `check(path)` is the static check: no
index or find-links option, no local path or file: URL, a sha256 hash on every distribution,
and every requirement of the .in pinned.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from release.lockfile import normalize

ROOT = Path(__file__).resolve().parent.parent
UV_VERSION = "0.13.9"  # pinned in requirements-dev.in / requirements-dev.lock
# uv's --python-platform for the GPU lock, resolved from wheels only (the GPU host installs
# offline, without compilers): glibc 2.31 is the least the pinned wheels allow (llguidance
# 1.9.1 ships manylinux_2_31 x86_64 wheels only). The CPU locks are resolved for the machine
# that runs `./ninfer lock` (Linux x86_64).
CROSS_PLATFORM = "x86_64-manylinux_2_31"


@dataclass(frozen=True)
class Target:
    lock: str
    source: str
    python: str
    title: str
    base: str = ""  # a lock whose pins constrain this one (less the names `source` pins)
    base_in: str = ""  # an .in whose requirements this lock must pin too (by name)
    platform: str = ""  # uv's --python-platform (wheels only); "" resolves for this machine


TARGETS = (
    Target("requirements.lock", "requirements.in", "3.11", "CPU JAX"),
    Target("requirements-dev.lock", "requirements-dev.in", "3.11",
           "CPU JAX, tests and release tools"),
    Target("requirements-gpu.lock", "requirements-gpu.in", "3.11", "GPU lanes, JAX with CUDA",
           base="requirements.lock", base_in="requirements.in", platform=CROSS_PLATFORM),
)
_BY_LOCK = {t.lock: t for t in TARGETS}

_INDEX_OPTS = ("-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--no-index",
               "--trusted-host")
_REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*(==\s*([^\s;\\]+))?")
_ABS_PATH = re.compile(r"(?:^|[\s=@'\"(])(/[A-Za-z0-9._-]+|~/)")
_REL_PATH = re.compile(r"(?:^|[\s=@])(\.\.?/)")


class LockToolError(RuntimeError):
    pass


# ---------------------------------------------------------------- reading .in and lock files

def _logical_lines(text: str) -> list[tuple[int, str, str]]:
    """(first line number, text) of each logical line: continuations joined, comments dropped."""
    out, cur, start = [], "", 0
    for no, raw in enumerate(text.splitlines(), 1):
        code = "" if raw.lstrip().startswith("#") else raw.split(" #", 1)[0].rstrip()
        if not code.strip():
            if cur:
                out.append((start, cur.strip()))
                cur = ""
            continue
        if not cur:
            start = no
        if code.endswith("\\"):
            cur += code[:-1] + " "
        else:
            out.append((start, (cur + code).strip()))
            cur = ""
    if cur:
        out.append((start, cur.strip()))
    return out


def in_requirements(path: Path, _seen: frozenset = frozenset()) -> dict[str, Requirement]:
    """The requirements of an .in file by normalized name, following `-r` includes (a `-c`
    constraint file is not a requirement)."""
    path = Path(path)
    reqs: dict[str, Requirement] = {}
    for _, line in _logical_lines(path.read_text()):
        if line.startswith(("-r ", "--requirement ")):
            inc = path.parent / line.split(None, 1)[1].strip()
            if inc.resolve() not in _seen:
                reqs.update(in_requirements(inc, _seen | {path.resolve()}))
        elif not line.startswith("-"):
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            reqs[normalize(req.name)] = req
    return reqs


def pins(path: Path) -> dict[str, str]:
    """name -> pinned version of each `name==version` line of a lock (hashes not required)."""
    return _pins_text(Path(path).read_text())


def _pins_text(text: str) -> dict[str, str]:
    out = {}
    for _, line in _logical_lines(text):
        m = _REQ.match(line)
        if m and m.group(4) and not line.startswith("-"):
            out[normalize(m.group(1))] = m.group(4)
    return out


# ---------------------------------------------------------------- the static check

def check(path: Path | str) -> list[str]:
    """Problems of a lock, each naming the line or package: index/find-links options, local
    paths and file: URLs, distributions without a sha256 hash or not pinned with ==, and
    requirements of the matching .in (requirements-X.lock <- requirements-X.in) not pinned."""
    path = Path(path)
    name = path.name
    if not path.is_file():
        return [f"{name}: missing"]
    text = path.read_text()
    problems = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if "file:" in line:
            problems.append(f"{name}:{no}: file: URL: {line}")
        elif _ABS_PATH.search(line) or (not line.startswith("#") and _REL_PATH.search(line)):
            problems.append(f"{name}:{no}: local path: {line}")
    for no, line in _logical_lines(text):
        if line.startswith("-"):
            opt = line.split("=", 1)[0].split()[0]
            if opt in _INDEX_OPTS:
                problems.append(f"{name}:{no}: names an index or find-links: {line}")
            else:
                problems.append(f"{name}:{no}: option line in a lock: {line}")
            continue
        m = _REQ.match(line)
        pkg = m.group(1) if m else line.split()[0]
        if not m or not m.group(4):
            problems.append(f"{name}:{no}: {pkg} is not pinned with ==")
        elif "--hash=sha256:" not in line:
            problems.append(f"{name}:{no}: {pkg} has no sha256 hash")
    problems += _dirty(path)
    return problems


def _dirty(path: Path) -> list[str]:
    target = _BY_LOCK.get(path.name)
    source = path.parent / (target.source if target else path.name[:-len(".lock")] + ".in")
    if not source.is_file() or path.suffix != ".lock":
        return []
    locked = pins(path)
    out = []
    wanted = in_requirements(source)
    for key, req in sorted(wanted.items()):
        if key not in locked:
            out.append(f"{path.name}: dirty: {req.name} (from {source.name}) is not pinned")
        elif req.specifier and not req.specifier.contains(locked[key], prereleases=True):
            out.append(f"{path.name}: dirty: {req.name} is pinned {locked[key]} but "
                       f"{source.name} asks {req.specifier}")
    if target and target.base_in and (path.parent / target.base_in).is_file():
        for key, req in sorted(in_requirements(path.parent / target.base_in).items()):
            if key not in wanted and key not in locked:
                out.append(f"{path.name}: dirty: {req.name} (from {target.base_in}) is not "
                           f"pinned")
    return out


# ---------------------------------------------------------------- regeneration

def uv_binary() -> str:
    """The uv executable of this Python's environment (requirements-dev.lock pins it)."""
    try:
        from uv import find_uv_bin
        exe = find_uv_bin()
    except (ImportError, FileNotFoundError):
        exe = shutil.which("uv", path=str(Path(sys.executable).parent))
    if not exe:
        raise LockToolError(f"uv is not installed in {sys.prefix}; pip install uv=={UV_VERSION} "
                            "(it is pinned in requirements-dev.lock)")
    return str(exe)


def mirror_args() -> list[str]:
    """uv options naming the package sources of pip's machine configuration (`pip config
    list`): its index-url, extra-index-url and find-links, and best-match over all of them as
    pip does. They go on uv's command line only; the locks never carry them."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=False).stdout
    seen: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        opt = key.rsplit(".", 1)[-1]
        if opt in ("index-url", "extra-index-url", "find-links"):
            for v in value.strip().strip("'\"").split():
                if v not in seen.setdefault(opt, []):
                    seen[opt].append(v)
    args = ["--index-strategy", "unsafe-best-match"]
    for opt in ("index-url", "extra-index-url", "find-links"):
        for v in seen.get(opt, []):
            args += [f"--{opt}", v]
    return args


def _header(target: Target, body: str, uv_version: str) -> str:
    locked = {}
    for _, line in _logical_lines(body):
        m = _REQ.match(line)
        if m and m.group(4):
            locked[normalize(m.group(1))] = m.group(4)
    plat = f" ({target.platform.split('-', 1)[1]}, wheels only)" if target.platform else ""
    what = f"Python {target.python}, Linux x86_64{plat}, {target.title}"
    cuda = locked.get("nvidia-cuda-runtime")
    if cuda:
        what += f" {cuda.split('.')[0]} (nvidia-cuda-runtime {cuda})"
    return (f"# {target.lock}: {what}\n"
            f"# from {target.source} by `ninfer lock` ({uv_version}, uv pip compile "
            f"--generate-hashes); do not edit\n"
            f"# no index or find-links here: pip's machine configuration names the sources\n")


_KEPT = "constraints/kept-pins.txt"


def _write_pins(work: Path, name: str, pinned: dict[str, str]) -> str:
    (work / name).write_text("".join(f"{k}=={v}\n" for k, v in sorted(pinned.items())))
    return name


def _tidy(body: str) -> str:
    """uv's output, its annotations naming the base lock as `-c requirements.lock` and not
    naming the scratch file of kept pins (a `# via` left with one source takes it inline)."""
    lines = [ln.replace("-c constraints/", "-c ") for ln in body.splitlines()
             if ln.strip() not in (f"#   -c {_KEPT}", f"# via -c {_KEPT}")]
    out, i = [], 0
    while i < len(lines):
        ln = lines[i]
        if ln.strip() == "# via":
            items = []
            while i + 1 < len(lines) and lines[i + 1].strip().startswith("#   "):
                i += 1
                items.append(lines[i])
            if len(items) == 1:  # uv writes a single source on the `# via` line
                out.append(ln + " " + items[0].strip()[1:].strip())
            elif items:
                out += [ln, *items]
        else:
            out.append(ln)
        i += 1
    return "\n".join(out) + "\n"


def compile_lock(target: Target, root: Path, work: Path, uv: str, mirrors: list[str],
                 uv_version: str) -> str:
    """The lock text for `target`, resolved in `work` from copies of root's .in files and
    locks (earlier targets' output already in `work`), keeping the committed lock's pins."""
    for f in sorted(root.glob("requirements*.in")):
        shutil.copyfile(f, work / f.name)
    if (root / target.lock).is_file() and not target.platform:
        shutil.copyfile(root / target.lock, work / target.lock)
    cmd = [uv, "pip", "compile", "--quiet", "--no-header", "--generate-hashes",
           "--strip-extras", "--python-version", target.python, "--no-progress", *mirrors,
           "-o", target.lock, target.source]
    if target.platform:
        cmd += ["--python-platform", target.platform, "--only-binary", ":all:"]
    # the base lock's pins constrain this one, less the packages this target's .in pins itself
    own = {k for k, r in in_requirements(work / target.source).items()
           if any(s.operator in ("==", "===") for s in r.specifier)}
    cons = {k: v for k, v in pins(work / target.base).items()
            if k not in own} if target.base else {}
    kept: dict[str, str] = {}
    if target.platform and (root / target.lock).is_file():
        # uv fails to resolve for another platform when its output file exists already (it
        # takes that file's pins as preferences), so the committed lock's other pins are
        # tried as constraints first, and dropped if they no longer fit
        kept = {k: v for k, v in pins(root / target.lock).items()
                if k not in own and k not in cons}
    (work / "constraints").mkdir(exist_ok=True)
    base = cmd + (["-c", _write_pins(work, f"constraints/{target.base}", cons)] if cons else [])
    tries = [base + ["-c", _write_pins(work, _KEPT, kept)], base] if kept else [base]
    for argv in tries:
        res = subprocess.run(argv, cwd=work, capture_output=True, text=True, check=False)
        if res.returncode == 0:
            break
    if res.returncode != 0:
        raise LockToolError(f"{target.lock}: uv pip compile failed:\n{res.stderr.strip()}")
    body = _tidy((work / target.lock).read_text())
    text = _header(target, body, uv_version) + body
    (work / target.lock).write_text(text)
    return text


def regenerate(root: Path = ROOT) -> dict[str, str]:
    """Every target's freshly resolved lock text, by lock name; writes nothing under root."""
    uv = uv_binary()
    ver = subprocess.run([uv, "--version"], capture_output=True, text=True,
                         check=True).stdout.split("(")[0].strip()
    mirrors = mirror_args()
    with tempfile.TemporaryDirectory(prefix="ninfer-lock-") as tmp:
        return {t.lock: compile_lock(t, root, Path(tmp), uv, mirrors, ver) for t in TARGETS}


def _pin_changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k} {old.get(k, '-')} -> {new.get(k, '-')}" for k in keys
            if old.get(k) != new.get(k)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ninfer lock", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="verify the committed locks without writing; exit 1 naming problems")
    ap.add_argument("--static", action="store_true",
                    help="with --check: only the static check, no re-resolution (offline)")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    root = args.root
    problems = [p for t in TARGETS for p in check(root / t.lock)]
    if args.check and args.static:
        fresh = {}
    else:
        try:
            fresh = regenerate(root)
        except LockToolError as e:
            print(f"ninfer lock: {e}", file=sys.stderr)
            return 1
    for name, text in fresh.items():
        path = root / name
        old = path.read_text() if path.is_file() else ""
        if old == text:
            continue
        if args.check:
            changes = _pin_changes(pins(path) if old else {}, _pins_text(text))
            problems.append(f"{name}: stale (./ninfer lock would rewrite it)"
                            + (": " + ", ".join(changes) if changes else ""))
        else:
            path.write_text(text)
            print(f"wrote {name}")
    if not args.check:
        problems = [p for t in TARGETS for p in check(root / t.lock)]
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print("locks ok: " + ", ".join(t.lock for t in TARGETS))
    return 1 if problems else 0


def wheel_platform(lock: str) -> str | None:
    """The pip platform tag a lock was resolved for (release.wheels.fetch's `platform`), or
    None for a lock resolved for this machine."""
    t = _BY_LOCK.get(Path(lock).name)
    if not t or not t.platform:
        return None
    arch, plat = t.platform.split("-", 1)
    return f"{plat}_{arch}"
