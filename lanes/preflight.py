"""Preflight: before `./ninfer serve --lane L` touches anything, this machine is checked against
the lane, fail-closed. Every problem says what is wrong and how to fix it; the server exits 78
(EX_CONFIG) with the state directory untouched.

Checked: the profile's memory plan fits its card (and this host's RAM); on a GPU lane, the
card the driver reports (name, memory, driver version) is the lane's; the free disk under the
state directory covers the checkpoint quota; the lane's model is an artifact this installation
has converted and pinned (or the operator asked for synthetic weights)."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from engine.io.host import free_disk, meminfo
from lanes.planner import MiB, plan_lane

EX_CONFIG = 78
_SMI_QUERY = "--query-gpu=name,memory.total,driver_version"


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_mib: int
    driver: str


def probe_gpus() -> list[Gpu] | str:
    """The GPUs the NVIDIA driver reports (nvidia-smi), or why there are none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no NVIDIA driver here (nvidia-smi not found)"
    try:
        out = subprocess.run([smi, _SMI_QUERY, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi failed: {e}"
    if out.returncode != 0:
        return f"nvidia-smi failed: {out.stderr.strip() or out.stdout.strip()}"
    gpus = []
    for line in out.stdout.strip().splitlines():
        name, mem, driver = (x.strip() for x in line.split(","))
        gpus.append(Gpu(name, int(float(mem)), driver))
    return gpus or "nvidia-smi lists no GPU"


def _version(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in v.split("."))


def preflight(profile, *, state_dir: Path, checkpoints: bool, synthetic: bool = False,
              model_override: str | None = None, gpus=probe_gpus, ram=None,
              free_disk=free_disk) -> list[str]:
    """What stops `profile` from serving on this machine (empty: nothing)."""
    problems: list[str] = []
    plan = plan_lane(profile, host_ram=ram() if ram else meminfo("MemTotal"))
    for p in plan.problems:
        problems.append(f"memory plan: {p} (./ninfer plan --lane {profile.name} shows each part)")
    if profile.gpu:
        card = profile.table("card")
        found = gpus()
        if isinstance(found, str):
            problems.append(f"lane {profile.name} needs an {card['name']}: {found}. Serve on "
                            f"the card this lane is for, or pick this machine's lane "
                            f"(./ninfer plan lists them; the cpu lane runs anywhere)")
        else:
            gpu = found[0]
            if gpu.name.lower() != card["name"].lower():
                problems.append(f"lane {profile.name} is for an {card['name']}, but GPU 0 is "
                                f"an {gpu.name}; use the lane for this card")
            if gpu.memory_mib < card["memory_mib"]:
                problems.append(f"GPU 0 reports {gpu.memory_mib:,} MiB, less than the "
                                f"{card['memory_mib']:,} MiB lane {profile.name} plans for")
            if card.get("min_driver") and _version(gpu.driver) < _version(card["min_driver"]):
                problems.append(f"NVIDIA driver {gpu.driver} is older than the "
                                f"{card['min_driver']} lane {profile.name} needs; update it")
    if checkpoints and profile.checkpoint_quota_bytes:
        free = free_disk(state_dir)
        if free < profile.checkpoint_quota_bytes:
            problems.append(f"{free / MiB:,.0f} MiB free under {state_dir}, less than the "
                            f"{profile.checkpoint_quota_bytes / MiB:,.0f} MiB checkpoint quota; "
                            f"free disk, choose another --state-dir, or lower --checkpoint-quota")
    if not synthetic and model_override is None and not profile.model.startswith("embedded:"):
        from lanes.models import artifact_path, pinned_sha256

        art = artifact_path(profile, state_dir)
        if pinned_sha256(profile, state_dir) is None:
            problems.append(f"lane {profile.name}'s model has not been converted on this "
                            f"installation: ./ninfer convert --lane {profile.name} --from "
                            f"SOURCE_CHECKPOINT_DIR --state-dir {state_dir} (writes {art} and "
                            f"pins its sha256), or serve --synthetic-weights to try the lane "
                            f"without it")
        elif not art.exists():
            problems.append(f"lane {profile.name}'s model {art} is missing; convert it again "
                            f"or restore it from a backup")
    return problems


def refuse(profile, problems: list[str]) -> str:
    """The message a refused serve prints."""
    head = f"ninfer: lane {profile.name}: preflight refused ({len(problems)} problem" + \
        ("s" if len(problems) != 1 else "") + "); nothing was started or written:"
    return "\n".join([head] + [f"  - {p}" for p in problems])

