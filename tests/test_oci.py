"""OCI image layouts (release/oci.py) and the lane images (release/image.py).

Default tier: small layouts from temp trees are byte-identical, and verify_layout catches each
kind of corruption. Release tier: the CPU image, built twice, is byte-identical; skopeo and
umoci read it; its entrypoint, run in a chroot of the unpacked rootfs, answers /health.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from release.oci import Layer, canonical_json, verify_layout, write_layout

EPOCH = 1_700_000_000
ROOT = Path(__file__).resolve().parent.parent


def _tree(base: Path) -> Path:
    t = base / "src"
    (t / "bin").mkdir(parents=True)
    (t / "lib" / "deep").mkdir(parents=True)
    (t / "bin" / "tool").write_text("#!/bin/sh\necho hi\n")
    os.chmod(t / "bin" / "tool", 0o700)
    (t / "lib" / "deep" / "data.txt").write_text("data\n" * 100)
    os.chmod(t / "lib" / "deep" / "data.txt", 0o600)
    (t / "lib" / ("n" * 120)).write_bytes(b"\0" * 10)
    os.symlink("deep/data.txt", t / "lib" / "link")
    return t


def _layout(base: Path, name: str, tree: Path) -> dict:
    layers = [Layer.from_tree(tree, "usr"),
              Layer.from_items([("etc/app.conf", b"x=1\n", 0o600),
                                ("etc/run", tree / "bin" / "tool", 0o755),
                                ("var/empty", None, 0o700)])]
    cfg = {"architecture": "amd64", "os": "linux", "config": {"Entrypoint": ["/usr/bin/tool"]}}
    return write_layout(base / name, layers, cfg, "test:1", epoch=EPOCH)


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file()}


@pytest.fixture
def layout(tmp_path):
    digests = _layout(tmp_path, "a", _tree(tmp_path))
    return tmp_path / "a", digests


def test_layout_is_byte_identical_and_normalized(tmp_path, layout):
    a, digests = layout
    # a second tree with other mtimes and the same content: the same bytes
    os.utime(a.parent / "src" / "bin" / "tool", (1, 1))
    time.sleep(0.01)
    digests_b = _layout(tmp_path, "b", a.parent / "src")
    assert digests == digests_b | {"timings_s": digests["timings_s"]}
    assert _files(a) == _files(tmp_path / "b")
    assert verify_layout(a) == []
    blob = a / "blobs" / "sha256" / digests["layers"][0].split(":")[1]
    raw = blob.read_bytes()
    assert raw[4:8] == b"\0\0\0\0" and raw[3] & 0x08 == 0  # gzip: mtime 0, no file name
    with tarfile.open(blob) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names) and names[0] == "usr" and "usr/lib/deep" in names
    by = {m.name: m for m in members}
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(EPOCH, 0, 0, "", "")}
    assert by["usr/bin/tool"].mode == 0o755 and by["usr/lib/deep/data.txt"].mode == 0o644
    assert by["usr/lib"].isdir() and by["usr/lib"].mode == 0o755
    assert by["usr/lib/link"].issym() and by["usr/lib/link"].linkname == "deep/data.txt"
    assert by["usr/lib/" + "n" * 120].size == 10  # a long name: a PAX header
    index = json.loads((a / "index.json").read_bytes())
    assert index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"] == "test:1"
    cfg = json.loads((a / "blobs/sha256" / digests["config"].split(":")[1]).read_bytes())
    assert cfg["rootfs"]["diff_ids"] == digests["diff_ids"]
    assert cfg["created"] == "2023-11-14T22:13:20Z"


def _blob(a: Path, digest: str) -> Path:
    return a / "blobs" / "sha256" / digest.split(":")[1]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_catches_a_flipped_layer_byte(layout):
    a, d = layout
    _flip(_blob(a, d["layers"][1]), 40)
    problems = verify_layout(a)
    assert any(d["layers"][1].split(":")[1] in p and "sha256 mismatch" in p and "layer 1" in p
               for p in problems), problems


def test_verify_catches_a_flipped_config_byte(layout):
    a, d = layout
    _flip(_blob(a, d["config"]), 5)
    problems = verify_layout(a)
    assert any("sha256 mismatch (config" in p for p in problems), problems


def test_verify_catches_a_flipped_manifest_byte(layout):
    a, d = layout
    _flip(_blob(a, d["manifest"]), 3)
    problems = verify_layout(a)
    assert any(d["manifest"].split(":")[1] in p and "sha256 mismatch (manifest" in p
               for p in problems), problems


def test_verify_catches_missing_and_extra_blobs(layout):
    a, d = layout
    _blob(a, d["layers"][0]).unlink()
    (a / "blobs" / "sha256" / ("0" * 64)).write_bytes(b"stray")
    problems = verify_layout(a)
    assert any("missing (layer 0" in p for p in problems), problems
    assert any(("0" * 64) in p and "unreferenced" in p for p in problems), problems


def test_verify_catches_a_diff_id_mismatch(layout):
    """A layer whose blob digest is right (manifest and config rewritten to match) but whose
    uncompressed content is not what the config's diff_ids say."""
    a, d = layout
    old = _blob(a, d["layers"][0])
    with open(old, "rb") as f:
        plain = gzip.GzipFile(fileobj=f).read()
    new = gzip.compress(plain + b"\0" * 1024, mtime=0)
    new_hex = hashlib.sha256(new).hexdigest()
    old.unlink()
    (a / "blobs/sha256" / new_hex).write_bytes(new)
    man_path = _blob(a, d["manifest"])
    man = json.loads(man_path.read_bytes())
    man["layers"][0].update(digest=f"sha256:{new_hex}", size=len(new))
    man_bytes = canonical_json(man)
    man_path.unlink()
    man_hex = hashlib.sha256(man_bytes).hexdigest()
    (a / "blobs/sha256" / man_hex).write_bytes(man_bytes)
    index = json.loads((a / "index.json").read_bytes())
    index["manifests"][0].update(digest=f"sha256:{man_hex}", size=len(man_bytes))
    (a / "index.json").write_bytes(canonical_json(index))
    problems = verify_layout(a)
    assert len(problems) == 1 and "differs from the config's diff_ids[0]" in problems[0], problems
    assert new_hex in problems[0]


def test_verify_catches_layout_file_problems(layout):
    a, _ = layout
    (a / "oci-layout").write_text('{"imageLayoutVersion": "2.0.0"}')
    (a / "index.json").write_text("{not json")
    problems = verify_layout(a)
    assert any(p.startswith("oci-layout: imageLayoutVersion") for p in problems), problems
    assert any(p.startswith("index.json: index does not parse") for p in problems), problems


def test_base_debs_are_checked_against_their_pins(tmp_path):
    """A cached .deb whose sha256 is not its pin's, and a pin apt cannot fetch, are errors
    naming the package."""
    from release.image import ImageError, Pin, fetch_debs, read_pins

    pins = read_pins()
    assert {"python3.11-minimal", "libpython3.11-stdlib", "libstdc++6", "libc6",
            "libssl3", "libsqlite3-0"} <= {p.package for p in pins}
    assert not {"dpkg", "perl-base", "tar"} & {p.package for p in pins}
    p = pins[0]
    (tmp_path / Path(p.filename).name).write_bytes(b"not the package")
    with pytest.raises(ImageError, match=f"^{re.escape(p.package)} {re.escape(p.version)}: "
                                         f".* has sha256"):
        fetch_debs([p], tmp_path)
    ghost = Pin("libc6", "0.0-0", "amd64", "0" * 64, "pool/main/g/glibc/libc6_0.0-0_amd64.deb")
    with pytest.raises(ImageError, match="^libc6 0.0-0: apt-get download failed"):
        fetch_debs([ghost], tmp_path)


# ---- release tier: the real CPU image -------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_images(tmp_path_factory):
    """The release tier's CPU image, from both builds of the release (tests/release_build.py):
    (layout dir, its digests as the release manifest binds them)."""
    from tests.release_build import shared_release

    a, b, _ = shared_release(tmp_path_factory)
    out = []
    for d in (a, b):
        lane = json.loads((d / "manifest.json").read_text())["lanes"]["cpu"]["oci"]
        out.append((d / lane["path"], lane))
    return out


@pytest.mark.release
def test_cpu_image_is_byte_identical_and_verifies(cpu_images):
    (a, da), (b, db) = cpu_images
    assert _files(a) == _files(b) and da == db
    assert verify_layout(a) == []
    assert len(da["layers"]) == 3
    cfg = json.loads(_blob(a, da["config"]).read_bytes())
    assert cfg["config"]["Entrypoint"][:4] == ["/usr/bin/python3.11", "-m", "server.cli", "serve"]
    assert "--bundle" in cfg["config"]["Entrypoint"]  # it serves the bundle's forwards
    assert cfg["config"]["Labels"]["org.ninfer.dependencies"] == "built"


@pytest.mark.release
def test_skopeo_and_umoci_read_the_cpu_image(cpu_images, tmp_path):
    a, d = cpu_images[0]
    info = json.loads(subprocess.run(["skopeo", "inspect", f"oci:{a}:cpu"], check=True,
                                     capture_output=True, text=True).stdout)
    assert info["Digest"] == d["manifest"] and info["Layers"] == d["layers"]
    subprocess.run(["umoci", "unpack", "--image", f"{a}:cpu", str(tmp_path / "bundle")],
                   check=True, capture_output=True)
    rootfs = tmp_path / "bundle" / "rootfs"
    assert (rootfs / "usr/bin/python3.11").is_file()
    assert (rootfs / "opt/ninfer/app/server/cli.py").is_file()
    assert (rootfs / "opt/ninfer/lane").read_text() == "cpu\n"
    assert (rootfs / "opt/ninfer/engine-bundle.tar").is_file()


@pytest.mark.release
def test_gpu_images_without_dependencies(cpu_images):
    release = cpu_images[0][0].parents[2]
    for lane in ("h200", "rtx3090", "rtx4090", "rtx5090"):
        d = json.loads((release / "manifest.json").read_text())["lanes"][lane]["oci"]
        layout = release / d["path"]
        assert verify_layout(layout) == [] and len(d["layers"]) == 2
        cfg = json.loads(_blob(layout, d["config"]).read_bytes())["config"]
        assert cfg["Labels"]["org.ninfer.dependencies"] == "not-built"
        assert cfg["Entrypoint"][cfg["Entrypoint"].index("--lane") + 1] == lane
        assert cfg["Entrypoint"][cfg["Entrypoint"].index("--bundle") + 1] \
            == "/opt/ninfer/engine-bundle.tar"  # it serves its bundle's CUDA forwards


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


# In new mount and PID namespaces (same network namespace): /proc and /dev mounted into the
# rootfs, then the entrypoint run chrooted there with the config's Env and WorkingDir. The
# mounts live only in the mount namespace, so they go when its last process exits.
_CHROOT = ('mount -t proc proc "$0/proc" && mount --rbind /dev "$0/dev" && '
           'exec unshare --root="$0" --wd="$1" "${@:2}"')


@pytest.mark.release
def test_cpu_image_entrypoint_serves_health_in_a_chroot(cpu_images, tmp_path):
    a, d = cpu_images[0]
    bundle = tmp_path / "bundle"
    subprocess.run(["umoci", "unpack", "--image", f"{a}:cpu", str(bundle)], check=True,
                   capture_output=True)
    rootfs = bundle / "rootfs"
    (rootfs / "proc").mkdir()
    (rootfs / "dev").mkdir()
    cfg = json.loads(_blob(a, d["config"]).read_bytes())["config"]
    port = _free_port()
    argv = cfg["Entrypoint"] + ["--port", str(port)]  # argparse: the last --port wins
    env = dict(e.split("=", 1) for e in cfg["Env"])
    log = open(tmp_path / "server.log", "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--pid",
                             "--fork", "--kill-child", "bash", "-c", _CHROOT, str(rootfs),
                             cfg["WorkingDir"], *argv], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        status, deadline = 0, t0 + 600
        while status != 200 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(1)
            status = _get(f"http://127.0.0.1:{port}/health")
        t_health = time.monotonic() - t0
        assert status == 200, (tmp_path / "server.log").read_text()[-3000:]
        print(f"\nCPU image in a chroot: /health 200 after {t_health:.1f}s")
        # stop: SIGTERM to the server (PID 1 of its namespace); unshare exits after it
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1
        os.kill(int(children[0]), 15)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()  # --kill-child: the namespace's processes go with it
            proc.wait()
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert "ninfer: stop report" in text, text[-3000:]
    print(f"server exit status {proc.returncode}")
    assert str(rootfs) not in Path("/proc/self/mountinfo").read_text()
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _root_of(p) == rootfs]
    assert left == []


def _root_of(proc_dir: Path) -> Path | None:
    try:
        return Path(os.readlink(proc_dir / "root"))
    except OSError:
        return None


@pytest.mark.slow
def test_a_gpu_lane_image_runs_its_lock_on_its_base_python(tmp_path):
    """A GPU lane's image with its dependency layer (GBs of CUDA 13 wheels from
    requirements-gpu.lock; ~2.5 min with the wheels cached): unpacked with umoci, the bookworm
    base's python3.11 imports the lock's JAX with its CUDA plugin, at the version that exports
    the lane's bundle (release.manifest.lock_problems, which the build applies)."""
    from release.image import PYTHON, gpu_image
    from release.lock import pins

    lock = ROOT / "requirements-gpu.lock"
    d = gpu_image(tmp_path / "oci", tree=ROOT, lock=lock, profile_name="rtx5090", epoch=0,
                  with_dependencies=True)
    assert verify_layout(tmp_path / "oci") == [] and len(d["layers"]) == 3
    cfg = json.loads(_blob(tmp_path / "oci", d["config"]).read_bytes())["config"]
    assert cfg["Labels"]["org.ninfer.dependencies"] == "built"
    bundle = tmp_path / "bundle"
    subprocess.run(["umoci", "unpack", "--image", f"{tmp_path / 'oci'}:rtx5090", str(bundle)],
                   check=True, capture_output=True)
    env = dict(e.split("=", 1) for e in cfg["Env"])
    probe = ("import importlib.metadata as m, jax; print(jax.__version__, "
             "m.version('jaxlib'), m.version('jax-cuda13-plugin'), m.version('jax-cuda13-pjrt'))")
    out = subprocess.run(["unshare", "--root", str(bundle / "rootfs"), PYTHON, "-c", probe],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    want = pins(lock)["jax"]
    assert want == pins(ROOT / "requirements.lock")["jax"]  # the JAX that exports bundles
    assert out.stdout.split() == [want] * 4
