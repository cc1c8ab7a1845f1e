"""The lane's systemd user unit: written into <root>/systemd/ninfer-<lane>.service (and, with
`--enable`, into ~/.config/systemd/user), checked with `systemd-analyze verify` first.

The unit runs the current instance's `ninfer serve` on the root's shared state directory;
ExecStop is a managed stop (`ninfer ctl stop`: drain, save every live session, exit), and
systemd's own SIGTERM, which follows, is the same graceful stop if the control socket was not
there. It changes nothing else on the machine (no GPU clocks or power limits)."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from lanes.instance import LaneError
from server.checkpoints.files import publish_file

USER_UNIT_DIR = Path.home() / ".config" / "systemd" / "user"


def unit_name(lane: str) -> str:
    return f"ninfer-{lane}.service"


def _q(arg: str) -> str:
    """One argument of an Exec line: quoted, with systemd's specifier and variable
    characters escaped."""
    esc = (arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
           .replace("$", "$$"))
    return f'"{esc}"'


def render(lane: str, instance: Path, state: Path) -> str:
    exe = _q(str(instance / "ninfer"))
    st = _q(str(state))
    return "\n".join([
        "# Written by `ninfer lane install`; rewritten by each install.",
        "[Unit]",
        f"Description=ninfer inference server, lane {lane}",
        "After=network.target",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={exe} serve --lane {lane} --state-dir {st}",
        f"ExecStop=-{exe} ctl stop --state-dir {st} --timeout 120",
        "KillSignal=SIGTERM",
        "TimeoutStartSec=900",
        "TimeoutStopSec=180",
        "Restart=on-failure",
        "RestartSec=5",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])


def verify(text: str, lane: str, which=shutil.which, run=subprocess.run) -> str | None:
    """Check a unit's text with `systemd-analyze verify` (as its file name, its executables
    resolved). None: it passed; else what is wrong, or that the tool is missing here. Any
    message about the unit (unknown keys are only warnings to systemd) is a failure."""
    tool = which("systemd-analyze")
    if tool is None:
        return "missing"
    with tempfile.TemporaryDirectory(prefix="ninfer-unit-") as d:
        path = Path(d) / unit_name(lane)
        path.write_text(text)
        out = run([tool, "verify", str(path)], capture_output=True, text=True, timeout=120)
    said = [ln for ln in (out.stdout + out.stderr).splitlines() if unit_name(lane) in ln]
    if out.returncode != 0 or said:
        raise LaneError("systemd-analyze verify refused the lane's unit:\n  "
                        + "\n  ".join(said or (out.stdout + out.stderr).splitlines()[-10:]))
    return None


def write(root, lane: str, instance: Path, which=shutil.which) -> tuple[Path, str]:
    """Verify the unit as it will run `instance` (the path `current` will name), then write it
    with `<root>/current`. Returns (its path, "verified" or why it was not)."""
    concrete = render(lane, instance, root.state)
    missing = verify(concrete, lane, which=which) == "missing"
    path = root.systemd / unit_name(lane)
    text = render(lane, root.path / "current", root.state)
    publish_file(path, text.encode())
    path.chmod(0o644)
    note = ("not verified: systemd-analyze is not on this machine's PATH" if missing
            else "verified with systemd-analyze")
    return path, note


def enable(unit: Path, run=subprocess.run, which=shutil.which) -> list[str]:
    """Copy the unit into ~/.config/systemd/user and enable it; the warnings (empty: done)."""
    USER_UNIT_DIR.mkdir(parents=True, exist_ok=True)
    target = USER_UNIT_DIR / unit.name
    publish_file(target, unit.read_bytes())
    target.chmod(0o644)
    ctl = which("systemctl")
    if ctl is None:
        return [f"{target} written; systemctl is not on PATH: enable it with "
                f"`systemctl --user enable {unit.name}`"]
    warnings = []
    for cmd in (["daemon-reload"], ["enable", unit.name]):
        out = run([ctl, "--user", *cmd], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            warnings.append(f"`systemctl --user {' '.join(cmd)}` failed: "
                            f"{(out.stderr or out.stdout).strip()}")
    return warnings
