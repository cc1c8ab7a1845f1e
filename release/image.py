"""The lane images: OCI image layouts of base, deps and app layers (release/oci.py).

Base layer: a Debian bookworm Python 3.11 runtime, made of the .deb files pinned in
release/base_debian.lock (package, version, arch, sha256, pool filename). The pins come from
this machine's apt sources (deb.debian.org bookworm and bookworm-security), written by
`pin_base_packages()`: the dependency closure of BASE_ROOTS (the interpreter, its standard
library with ssl, sqlite3, ctypes, zlib, lzma, bz2, uuid, decimal; libstdc++ and libgcc for
jaxlib and numpy), minus BASE_EXCLUDED (package tooling a runtime never calls), each at the
version apt would install and with the sha256 of its .deb from the archive index. A build
fetches each with `apt-get download` into a cache, refuses any whose sha256 differs from its
pin, unpacks them with `dpkg-deb -x` (no maintainer scripts run) and adds /etc/passwd,
/etc/group, /root and /tmp. To move the base, run `python -m release.image pin` and commit
the lock.

Deps layer: the runtime lock's wheels, installed by pip (hashes required, binaries only, no
bytecode, for CPython 3.11 manylinux x86_64 whatever the build host) into
/opt/ninfer/site-packages; console-script shebangs are rewritten to /usr/bin/python3.11 (pip
writes the build host's interpreter path) and their RECORD rows updated.

App layer: the product files (lanes.instance.product_files) under /opt/ninfer/app, the lane
name in /opt/ninfer/lane, and the empty state directory /var/lib/ninfer.

gzip level: GZIP_LEVEL (1). Measured on the CPU image's deps layer (666 MB of tar, one core of
a loaded 2-core machine): level 1 gives 204 MB in 20 s, level 6 179 MB in 51 s, level 9 177 MB
in 113 s; level 6 would push a warm build (~80 s at level 1) past two minutes for 12% less.
"""
from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from release.manifest import IMAGE_PYTHON
from release.oci import Layer, write_layout

LOCK_PATH = Path(__file__).resolve().parent / "base_debian.lock"
BASE_ROOTS = (f"python{IMAGE_PYTHON}-minimal", f"libpython{IMAGE_PYTHON}-stdlib", "libstdc++6",
              "libgcc-s1")
BASE_EXCLUDED = frozenset({"dpkg", "install-info", "tar", "perl", "perl-base",
                           "perl-modules-5.36", "libperl5.36", "mailcap", "mime-support",
                           "debconf"})
BASE_DROPPED = ("usr/share/man", "usr/share/info", "usr/share/lintian")  # docs pages only
PYTHON = f"/usr/bin/python{IMAGE_PYTHON}"
SITE = "opt/ninfer/site-packages"
APP = "opt/ninfer/app"
STATE = "var/lib/ninfer"
GZIP_LEVEL = 1
# glibc 2.36 (bookworm): every manylinux tag up to it, as pip does not expand them itself
PIP_PLATFORM = tuple(a for glibc in range(36, 4, -1)
                     for a in ("--platform", f"manylinux_2_{glibc}_x86_64")) + (
    "--platform", "manylinux2014_x86_64", "--platform", "manylinux2010_x86_64",
    "--platform", "manylinux1_x86_64", "--implementation", "cp", "--python-version", IMAGE_PYTHON,
    "--abi", "cp" + IMAGE_PYTHON.replace(".", ""))
LABEL_DEPS = "org.ninfer.dependencies"


class ImageError(RuntimeError):
    pass


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    arch: str
    sha256: str
    filename: str  # the pool path in the archive


def _run(cmd: list[str], **kw) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode:
        raise ImageError(f"{' '.join(cmd[:4])}...: exit {r.returncode}: {r.stderr.strip()[-800:]}")
    return r.stdout


def _depends(pkg: str) -> list[str]:
    """The first alternative of each Depends/Pre-Depends group of `pkg` (virtual packages:
    their first provider)."""
    out = _run(["apt-cache", "depends", "--no-recommends", "--no-suggests", "--no-conflicts",
                "--no-breaks", "--no-replaces", "--no-enhances", pkg]).splitlines()
    deps, in_alt, i = [], False, 0
    while i < len(out):
        line = out[i].strip()
        i += 1
        alt = line.startswith("|")
        kind, _, name = line.lstrip("|").partition(": ")
        if kind not in ("Depends", "PreDepends"):
            continue
        if not in_alt:
            if name.startswith("<"):  # virtual: the providers follow, indented
                if i < len(out) and out[i].startswith("    "):
                    deps.append(out[i].strip())
            else:
                deps.append(name.split(":")[0])
        in_alt = alt
    return deps


def _archive_record(pkg: str) -> Pin:
    version = _run(["apt-cache", "policy", pkg]).split("Candidate:")[1].split()[0]
    for rec in _run(["apt-cache", "show", f"{pkg}={version}"]).split("\n\n"):
        fields = dict(ln.split(": ", 1) for ln in rec.splitlines() if ": " in ln and ln[0] != " ")
        if fields.get("SHA256") and fields.get("Filename"):
            return Pin(pkg, version, fields["Architecture"], fields["SHA256"], fields["Filename"])
    raise ImageError(f"{pkg} {version}: no archive record with a SHA256 (apt-get update?)")


def pin_base_packages(out: Path = LOCK_PATH, roots=BASE_ROOTS,
                      excluded=BASE_EXCLUDED) -> list[Pin]:
    """Resolve the base closure with apt-cache and write the pins to `out`, sorted."""
    todo, seen = list(roots), set()
    while todo:
        pkg = todo.pop()
        if pkg in seen or pkg in excluded:
            continue
        seen.add(pkg)
        todo += _depends(pkg)
    pins = [_archive_record(p) for p in sorted(seen)]
    lines = ["# The image base layer's Debian packages (release/image.py pin_base_packages).",
             "# package version arch sha256 filename"]
    lines += [f"{p.package} {p.version} {p.arch} {p.sha256} {p.filename}" for p in pins]
    Path(out).write_text("\n".join(lines) + "\n")
    return pins


def read_pins(path: Path = LOCK_PATH) -> list[Pin]:
    pins = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            parts = line.split()
            if len(parts) != 5 or len(parts[3]) != 64:
                raise ImageError(f"{path}:{n}: not 'package version arch sha256 filename'")
            pins.append(Pin(*parts))
    return pins


def _sha256(path: Path) -> str:
    from release.manifest import sha256_file

    return sha256_file(path)


def fetch_debs(pins: list[Pin], cache: Path) -> list[Path]:
    """Each pinned .deb, from `cache` or `apt-get download`ed into it, checked against its
    pin; a package that cannot be fetched, or whose sha256 differs, is an error naming it."""
    cache.mkdir(parents=True, exist_ok=True)
    want = {p.package: cache / Path(p.filename).name for p in pins}
    missing = [p for p in pins if not want[p.package].is_file()]
    if missing:
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            for p in missing:
                r = subprocess.run(["apt-get", "download", f"{p.package}={p.version}"],
                                   cwd=tmp, capture_output=True, text=True)
                got = sorted(Path(tmp).glob(f"{p.package}_*.deb"))
                if r.returncode or len(got) != 1:
                    raise ImageError(f"{p.package} {p.version}: apt-get download failed: "
                                     f"{r.stderr.strip()[-300:]}")
                got[0].rename(want[p.package])
    for p in pins:
        actual = _sha256(want[p.package])
        if actual != p.sha256:
            raise ImageError(f"{p.package} {p.version}: {want[p.package].name} has sha256 "
                             f"{actual}, the pin says {p.sha256}")
    return [want[p.package] for p in pins]


def base_layer(staging: Path, cache: Path, lock: Path = LOCK_PATH) -> Layer:
    root = staging / "base"
    root.mkdir(parents=True)
    for deb in fetch_debs(read_pins(lock), cache / "debs"):
        _run(["dpkg-deb", "-x", str(deb), str(root)])
    for rel in BASE_DROPPED:
        shutil.rmtree(root / rel, ignore_errors=True)
    extra = Layer.from_items([("etc/passwd", b"root:x:0:0:root:/root:/usr/sbin/nologin\n", 0o644),
                              ("etc/group", b"root:x:0:\n", 0o644),
                              ("root", None, 0o755), ("tmp", None, 0o755)])
    return Layer.from_tree(root) + extra


def install_deps(requirements: Path, target: Path, cache: Path) -> None:
    """pip-install the lock's wheels into `target` (see the module docstring)."""
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--require-hashes",
          "--only-binary=:all:", "--no-compile", "--disable-pip-version-check", "--no-input",
          "--quiet", *PIP_PLATFORM, "--cache-dir", str(cache / "pip"), "--target", str(target),
          "-r", str(requirements)])
    bindir = target / "bin"
    fixed = {}
    for script in sorted(bindir.iterdir()) if bindir.is_dir() else []:
        data = script.read_bytes()
        if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
            new = b"#!" + PYTHON.encode() + b"\n" + data.split(b"\n", 1)[1]
            script.write_bytes(new)
            digest = base64.urlsafe_b64encode(hashlib.sha256(new).digest()).rstrip(b"=")
            fixed[f"bin/{script.name}"] = f"sha256={digest.decode()},{len(new)}"
    for record in sorted(target.glob("*.dist-info/RECORD")) if fixed else []:
        rows = record.read_text().splitlines()
        out = []
        for row in rows:
            # pip --target records scripts relative to its temporary prefix: ../../../bin/x
            path = row.split(",", 1)[0]
            rel = "/".join(p for p in path.split("/") if p != "..")
            out.append(f"{path},{fixed[rel]}" if rel in fixed else row)
        record.write_text("\n".join(out) + "\n")


def deps_layer(staging: Path, requirements: Path, cache: Path) -> Layer:
    root = staging / "deps"
    install_deps(requirements, root / SITE, cache)
    return Layer.from_tree(root)


BUNDLE = "opt/ninfer/engine-bundle.tar"


def app_layer(tree: Path, profile_name: str, bundle: Path | None = None) -> Layer:
    """The product files, the lane's name and, given one, its engine bundle (BUNDLE)."""
    from lanes.instance import product_files

    tree = Path(tree)
    items = [(f"{APP}/{rel}", tree / rel, (tree / rel).stat().st_mode)
             for rel in product_files(tree)]
    items += [("opt/ninfer/lane", f"{profile_name}\n".encode(), 0o644), (STATE, None, 0o755)]
    if bundle is not None:
        items.append((BUNDLE, Path(bundle), 0o644))
    return Layer.from_items(items)


def lane_port(tree: Path, profile_name: str) -> int:
    path = Path(tree) / "lanes" / "profiles" / f"{profile_name}.toml"
    if not path.is_file():
        raise ImageError(f"no lane profile {profile_name!r} in {path.parent}")
    return int(tomllib.loads(path.read_text()).get("port", 18089))


def image_config(profile_name: str, port: int, labels: dict, bundle: bool = False) -> dict:
    """The entrypoint serves the lane on loopback; from the image's engine bundle (its
    exported forwards) when it has one."""
    serve = [PYTHON, "-m", "server.cli", "serve", "--lane", profile_name]
    serve += ["--bundle", f"/{BUNDLE}"] if bundle else []
    return {"architecture": "amd64", "os": "linux",
            "config": {"Entrypoint": serve + ["--host", "127.0.0.1", "--port", str(port),
                                              "--state-dir", f"/{STATE}"],
                       "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root",
                               f"PYTHONPATH=/{APP}:/{SITE}", "LANG=C.UTF-8"],
                       "WorkingDir": f"/{APP}", "Labels": labels}}


def lane_image(out_dir: Path, *, tree: Path, lock: Path, profile_name: str, epoch: int,
               with_dependencies: bool = True, cache_dir: Path | None = None,
               base_lock: Path = LOCK_PATH, level: int = GZIP_LEVEL,
               bundle: Path | None = None, serve_bundle: bool = False) -> dict:
    """Build one lane's image layout at `out_dir` (ref name: the lane); returns write_layout's
    digests plus `timings_s` {base, deps, app, total} (staging and writing each layer)."""
    cache = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "ninfer-release"
    tree, lock = Path(tree), Path(lock)
    port = lane_port(tree, profile_name)
    labels = {"org.opencontainers.image.title": f"ninfer-{profile_name}",
              "org.ninfer.lane": profile_name,
              "org.ninfer.lock.sha256": _sha256(lock),
              "org.ninfer.base-lock.sha256": _sha256(base_lock),
              LABEL_DEPS: "built" if with_dependencies else "not-built"}
    t0 = time.monotonic()
    times = {}
    with tempfile.TemporaryDirectory(prefix="ninfer-oci-") as tmp:
        staging = Path(tmp)
        layers = [base_layer(staging, cache, base_lock)]
        times["fetch_base"] = round(time.monotonic() - t0, 2)
        if with_dependencies:
            t1 = time.monotonic()
            layers.append(deps_layer(staging, lock, cache))
            times["fetch_deps"] = round(time.monotonic() - t1, 2)
        layers.append(app_layer(tree, profile_name, bundle))
        config = image_config(profile_name, port, labels, bundle is not None and serve_bundle)
        digests = write_layout(out_dir, layers, config, profile_name, epoch=epoch, level=level)
    times["total"] = round(time.monotonic() - t0, 2)
    digests["timings_s"].update(times)
    return digests


def cpu_image(out_dir: Path, *, tree: Path, lock: Path, profile_name: str = "cpu",
              epoch: int, **kw) -> dict:
    """The CPU lane's image: base, deps (the runtime lock) and app layers."""
    return lane_image(out_dir, tree=tree, lock=lock, profile_name=profile_name, epoch=epoch,
                      with_dependencies=True, **kw)


def gpu_image(out_dir: Path, *, tree: Path, lock: Path, profile_name: str, epoch: int,
              with_dependencies: bool = False, **kw) -> dict:
    """A GPU lane's image: base and app layers, and the deps layer of `lock` (GBs of CUDA
    wheels) only with `with_dependencies`; otherwise the config's label
    org.ninfer.dependencies says "not-built" (the lock's sha256 is labelled either way)."""
    return lane_image(out_dir, tree=tree, lock=lock, profile_name=profile_name, epoch=epoch,
                      with_dependencies=with_dependencies, **kw)


def main(argv=None) -> int:
    """`python -m release.image pin` rewrites the base pins; `python -m release.image build
    OUT --lane cpu --epoch N [--lock requirements.lock] [--with-dependencies]` builds an image
    from this checkout (a GPU lane's deps layer only with --with-dependencies)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m release.image")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("pin", help="rewrite release/base_debian.lock from the apt sources")
    b = sub.add_parser("build", help="build a lane's OCI image layout")
    b.add_argument("out")
    b.add_argument("--lane", default="cpu")
    b.add_argument("--epoch", type=int, required=True, help="the layers' mtime (seconds)")
    b.add_argument("--lock", default=None, help="default: the checkout's requirements.lock")
    b.add_argument("--with-dependencies", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "pin":
        for pin in pin_base_packages():
            print(pin.package, pin.version)
        return 0
    tree = LOCK_PATH.parent.parent
    lock = Path(args.lock) if args.lock else tree / "requirements.lock"
    build = cpu_image if args.lane == "cpu" else gpu_image
    kw = {} if args.lane == "cpu" else {"with_dependencies": args.with_dependencies}
    digests = build(Path(args.out), tree=tree, lock=lock, profile_name=args.lane,
                    epoch=args.epoch, **kw)
    print(json.dumps(digests, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
