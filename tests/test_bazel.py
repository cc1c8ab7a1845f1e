"""The offline Bazel build (release tier): Debian's bazel-bootstrap builds and tests a copy of this
worktree with nothing downloaded but the lock's distributions from pip's configured index:
`bazel test //tests:smoke` passes, the CUDA ops build for every lane card with exactly that card's
code in them, two clean builds of them are byte-identical, and `bazel run //release:v0_16_0`
writes the release into the workspace's dist/v0.16.0/.

Bazel runs on copies of the worktree in a temporary directory, each with an output root of its
own there (`bazel shutdown` at the end), so the worktree and the user's Bazel cache are left
alone. The times and sizes the
tests measure are printed (run with -s to see them)."""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.kernels.cuda_build import fatbin_archs

pytestmark = pytest.mark.release

REPO = Path(__file__).resolve().parent.parent
ARCHS = ("86", "89", "90", "120")
OPS = [f"engine/cuda_ops/int4_gemv-sm{a}.so" for a in ARCHS]
# the XLA FFI handlers engine/kernels/cuda_build.py registers from the library
FFI_HANDLERS = ("NinferInt4Gemv", "NinferInt4GemvMma", "NinferInt4GemvWide", "NinferInt4Mlp")
MEASURED: dict[str, object] = {}


def _ensure_bazel() -> str:
    """The bazel binary, installing Debian's bazel-bootstrap where it is missing."""
    if shutil.which("bazel") is None:
        install = ["apt-get", "install", "-y", "-q", "bazel-bootstrap"]
        if subprocess.run(install, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True)
            subprocess.run(install, check=True, capture_output=True)
    path = shutil.which("bazel")
    assert path, "bazel-bootstrap installed no bazel on PATH"
    return path


class Bazel:
    def __init__(self, exe: str, workspace: Path, output_root: Path):
        self.exe, self.workspace, self.output_root = exe, workspace, output_root

    def __call__(self, *args: str, timeout: int = 840) -> tuple[subprocess.CompletedProcess, float]:
        start = time.monotonic()
        res = subprocess.run([self.exe, f"--output_user_root={self.output_root}", *args],
                             cwd=self.workspace, capture_output=True, text=True, timeout=timeout)
        return res, time.monotonic() - start

    def bin(self) -> Path:
        res, _ = self("info", "bazel-bin")
        assert res.returncode == 0, res.stderr[-3000:]
        return Path(res.stdout.strip())


def _copy_worktree(dest: Path) -> Path:
    """This worktree's files (tracked and new, as git lists them) copied to `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    # a checkout, as a user's clone is: the release takes its commit and epoch from git
    env = {**os.environ, "GIT_AUTHOR_DATE": "2026-12-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2026-12-01T00:00:00Z"}
    for cmd in (["init", "-q"], ["add", "-A"],
                ["-c", "user.name=ci", "-c", "user.email=ci@localhost", "commit", "-qm", "copy"]):
        subprocess.run(["git", *cmd], cwd=dest, env=env, check=True, capture_output=True)
    return dest


@pytest.fixture(scope="module")
def bazels(tmp_path_factory):
    """Bazel on two copies of this worktree at different paths, each with its own output root."""
    exe = _ensure_bazel()
    root = tmp_path_factory.mktemp("bazel")
    made = [Bazel(exe, _copy_worktree(root / "ws"), root / "out"),
            Bazel(exe, _copy_worktree(root / "elsewhere" / "ninfer-copy"), root / "out2")]
    yield made
    for b in made:
        b("shutdown", timeout=120)
    # the output roots hold ~1.5 GB; Bazel leaves some of their directories read-only
    subprocess.run(["chmod", "-R", "u+w", str(root)], check=False)
    shutil.rmtree(root, ignore_errors=True)
    print("\nbazel measurements:", json.dumps(MEASURED, indent=1, sort_keys=True))


@pytest.fixture(scope="module")
def bazel(bazels):
    return bazels[0]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_smoke_passes_under_bazel_test(bazel):
    res, cold = bazel("test", "//tests:smoke")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "//tests:smoke" in res.stderr + res.stdout
    res, cached = bazel("test", "//tests:smoke")
    assert res.returncode == 0
    assert "(cached) PASSED" in res.stderr + res.stdout  # nothing changed: nothing re-ran
    site = bazel.output_root.glob("*/external/pypi/site")
    site_bytes = sum(f.stat().st_size for d in site for f in d.rglob("*") if f.is_file())
    MEASURED.update(smoke_cold_s=round(cold, 1), smoke_cached_s=round(cached, 1),
                    pypi_site_mib=round(site_bytes / 2**20, 1))


def test_ninfer_binary_plans_the_cpu_lane(bazel):
    res, took = bazel("run", "//:ninfer", "--", "plan", "--lane", "cpu", "--json")
    assert res.returncode == 0, res.stderr[-4000:]
    (plan,) = json.loads(res.stdout)
    assert plan["lane"] == "cpu" and plan["fits"] is True
    assert plan["host_total"] == sum(p["bytes"] for p in plan["parts"] if p["where"] == "host")
    MEASURED.update(ninfer_run_s=round(took, 1))


def test_cuda_ops_build_for_each_card_byte_identically_twice(bazels):
    """Two clean builds, in workspaces at different paths with output roots of their own, give
    the same bytes."""
    first_ws, second_ws = bazels
    res, cold = first_ws("build", "//engine:cuda_ops")
    assert res.returncode == 0, res.stderr[-4000:]
    out = first_ws.bin()
    first = {name: _sha(out / name) for name in OPS}
    for arch, name in zip(ARCHS, OPS):
        # each library holds compiled code for its lane card's architecture and nothing else
        assert fatbin_archs(out / name) == {"sm": {int(arch)}, "ptx": set()}, name
        lib = ctypes.CDLL(str(out / name))  # loads without a GPU; exports what the engine calls
        assert all(getattr(lib, sym, None) for sym in FFI_HANDLERS), name
    sizes = {Path(n).name: (out / n).stat().st_size for n in OPS}

    res, cached = first_ws("build", "//engine:cuda_ops")
    assert res.returncode == 0
    assert {name: _sha(out / name) for name in OPS} == first

    res, second = second_ws("build", "//engine:cuda_ops")
    assert res.returncode == 0, res.stderr[-4000:]
    out2 = second_ws.bin()
    assert out2 != out
    assert {name: _sha(out2 / name) for name in OPS} == first
    assert not list((out2 / "engine" / "cuda_ops").glob("_nvcc_keep_*"))  # intermediates gone
    MEASURED.update(cuda_cold_s=round(cold, 1), cuda_cached_s=round(cached, 1),
                    cuda_second_workspace_cold_s=round(second, 1), cuda_sizes=sizes,
                    cuda_sha256={Path(n).name: h for n, h in first.items()})


def test_release_target_writes_the_release_into_the_workspace(bazel):
    res, took = bazel("run", "//release:v0_16_0")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    dist = bazel.workspace / "dist" / "v0.16.0"
    assert (dist / "manifest.json").is_file()
    # the GPU lanes' bundles carry the CUDA ops Bazel built, byte for byte (the h200 plan runs
    # them, so at least its bundle has one)
    from release.bundle import open_bundle

    carried = {}
    for lane in ("h200", "rtx3090", "rtx4090", "rtx5090"):
        bundle = open_bundle(dist / "lanes" / lane / "engine-bundle.tar", expect_lane=lane)
        for name, data in bundle.cuda_libraries().items():
            arch = name.split("-sm", 1)[1].split("-", 1)[0]
            built = bazel.bin() / f"engine/cuda_ops/int4_gemv-sm{arch}.so"
            assert data == built.read_bytes(), (lane, name)
            carried[lane] = name
    assert "h200" in carried
    sums = (dist / "SHA256SUMS").read_text().splitlines()
    for line in sums:
        digest, name = line.split("  ", 1)
        assert _sha(dist / name) == digest, name
    # the README's next command: the release verifies, and is a candidate until each lane has
    # a passing receipt of this very bundle (the cpu lane's, qualification/cpu.json, blocks
    # only by its fields: a failed verdict, another bundle)
    verify = [sys.executable, "-m", "release", "verify", str(dist)]
    out = subprocess.run(verify, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    out = subprocess.run(verify + ["--require-ready"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 1
    for lane in ("h200", "rtx3090", "rtx4090", "rtx5090"):
        assert f"lane {lane}: no qualification receipt" in out.stdout
    cpu = [x for x in out.stdout.splitlines() if "lane cpu:" in x]
    assert all("(receipt field " in x for x in cpu), cpu
    MEASURED.update(release_run_s=round(took, 1),
                    release_mib=round(sum(f.stat().st_size for f in dist.rglob("*")
                                          if f.is_file()) / 2**20, 1))
