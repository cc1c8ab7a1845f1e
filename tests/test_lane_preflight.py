"""Preflight: `./ninfer serve --lane L` checks this machine against the lane before it touches
anything, and refuses with exit 78 and the state directory unchanged."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lanes.planner import MiB
from lanes.preflight import Gpu, preflight
from lanes.profile import load_profile

ROOT = Path(__file__).resolve().parent.parent


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, p.stat().st_size, p.stat().st_mode)
            for p in sorted(d.rglob("*"))} | {".": d.stat().st_mtime_ns}


def _serve(*args):
    return subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_gpu_lane_on_this_machine_is_refused_before_anything_is_written(tmp_path):
    fresh = tmp_path / "fresh"
    out = _serve("--lane", "rtx5090", "--state-dir", str(fresh))
    assert out.returncode == 78, out.stderr
    assert "preflight refused" in out.stderr and "RTX 5090" in out.stderr
    assert not fresh.exists()
    # an existing state directory is left exactly as it was
    used = tmp_path / "used"
    (used / "logs").mkdir(parents=True, mode=0o700)
    (used / "keys").write_text("default nk-0123456789abcdef0123\n")
    os.chmod(used / "keys", 0o600)
    before = _tree(used)
    out = _serve("--lane", "rtx3090", "--state-dir", str(used))
    assert out.returncode == 78, out.stderr
    assert _tree(used) == before
    assert "nothing was started or written" in out.stderr


def _check(lane, tmp_path, **kw):
    kw.setdefault("gpus", lambda: [Gpu("NVIDIA GeForce RTX 4090", 24564, "580.95.05")])
    kw.setdefault("ram", lambda: 128 << 30)
    kw.setdefault("free_disk", lambda p: 1 << 40)
    kw.setdefault("checkpoints", True)
    pinned = tmp_path / "models" / "pinned.json"
    pinned.parent.mkdir(parents=True, exist_ok=True)
    pinned.write_text("{}")
    return preflight(load_profile(lane), state_dir=tmp_path, **kw)


def test_the_lanes_card_passes_and_each_mismatch_is_named(tmp_path):
    assert _check("rtx4090", tmp_path) == []
    p = _check("rtx4090", tmp_path, gpus=lambda: [Gpu("NVIDIA GeForce RTX 3090", 24576, "580.95.05")])
    assert len(p) == 1 and "is for an NVIDIA GeForce RTX 4090, but GPU 0 is an NVIDIA GeForce RTX 3090" in p[0]
    p = _check("rtx4090", tmp_path, gpus=lambda: [Gpu("NVIDIA GeForce RTX 4090", 20000, "580.95.05")])
    assert len(p) == 1 and "20,000 MiB" in p[0]
    p = _check("rtx4090", tmp_path, gpus=lambda: [Gpu("NVIDIA GeForce RTX 4090", 24564, "550.54.14")])
    assert len(p) == 1 and "driver 550.54.14 is older than the 580.65" in p[0]
    p = _check("rtx4090", tmp_path, gpus=lambda: "no NVIDIA driver here (nvidia-smi not found)")
    assert len(p) == 1 and "nvidia-smi not found" in p[0]


def test_host_ram_disk_and_the_model_are_checked(tmp_path):
    p = _check("rtx4090", tmp_path, ram=lambda: 16 << 30)
    assert len(p) == 1 and "more than this host's" in p[0]
    p = _check("rtx4090", tmp_path, free_disk=lambda d: 10 << 30)
    assert len(p) == 1 and "checkpoint quota" in p[0] and f"{24 * 1024:,} MiB" in p[0]
    assert _check("rtx4090", tmp_path, free_disk=lambda d: 10 << 30, checkpoints=False) == []
    (tmp_path / "models" / "pinned.json").unlink()
    p = preflight(load_profile("rtx4090"), state_dir=tmp_path, checkpoints=False,
                  gpus=lambda: [Gpu("NVIDIA GeForce RTX 4090", 24564, "580.95.05")],
                  ram=lambda: 128 << 30)
    assert len(p) == 1 and "has not been converted" in p[0] and "--synthetic-weights" in p[0]
    assert preflight(load_profile("rtx4090"), state_dir=tmp_path, checkpoints=False,
                     synthetic=True, gpus=lambda: [Gpu("NVIDIA GeForce RTX 4090", 24564, "580.95.05")],
                     ram=lambda: 128 << 30) == []


def test_the_cpu_lane_passes_here(tmp_path):
    assert preflight(load_profile("cpu"), state_dir=tmp_path / "s", checkpoints=True) == []
    assert MiB == 1 << 20
