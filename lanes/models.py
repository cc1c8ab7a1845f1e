"""A GPU lane's model on this installation: converted once from its source checkpoint, then
pinned.

A lane's model identity is the source checkpoint's (its files' sha256s), the conversion recipe
and the converter version; the artifact's sha256 is only known once the user converts, so a
GPU lane's profile says `model_sha256 = "PENDING"` and `./ninfer convert --lane L --from DIR`
writes the artifact into the state directory and pins it there (`models/pinned.json`, written
atomically): from then on `serve --lane L` refuses any other bytes.

    ./ninfer convert --lane rtx4090 --from ~/models/Qwen3.8-27B [--state-dir D]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

CONVERTER_VERSION = "engine.io.convert/1"
PIN = Path("models") / "pinned.json"


def artifact_path(profile, state_dir: Path) -> Path:
    """Where the lane's artifact lives: its `model`, under the state directory when relative."""
    p = Path(profile.model)
    return p if p.is_absolute() else state_dir / p


def read_pin(state_dir: Path) -> dict | None:
    path = state_dir / PIN
    if not path.exists():
        return None
    return json.loads(path.read_text())


def write_pin(state_dir: Path, pin: dict) -> None:
    path = state_dir / PIN
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(pin, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def pinned_sha256(profile, state_dir: Path) -> str | None:
    """The sha256 serve must find: the profile's own pin, else this installation's (None: the
    lane's model was never converted here)."""
    if profile.model_sha256 != "PENDING":
        return profile.model_sha256
    pin = read_pin(state_dir)
    if pin is None or pin.get("lane") != profile.name:
        return None
    return pin["artifact_sha256"]


def convert_for_lane(argv: list[str], default_state_dir: Path) -> int:
    from engine.io.artifact import ArtifactError, open_artifact
    from engine.io.convert import ConvertError, convert
    from lanes.profile import ProfileError, load_profile

    ap = argparse.ArgumentParser(prog="ninfer convert --lane",
                                 description="convert a lane's model and pin it here")
    ap.add_argument("--lane", required=True)
    ap.add_argument("--from", dest="src", required=True, help="the source checkpoint (HF dir)")
    ap.add_argument("--state-dir", type=Path, default=default_state_dir)
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    try:
        profile = load_profile(a.lane)
    except ProfileError as e:
        print(f"ninfer convert: {e}", file=sys.stderr)
        return 78
    if profile.model.startswith("embedded:"):
        print(f"ninfer convert: lane {profile.name} serves an embedded model; nothing to "
              f"convert", file=sys.stderr)
        return 78
    pin = read_pin(a.state_dir)
    out = artifact_path(profile, a.state_dir)
    if pin is not None and out.exists():
        print(f"ninfer convert: {out} is already converted and pinned (sha256 "
              f"{pin['artifact_sha256']}); delete it and {a.state_dir / PIN} to convert again",
              file=sys.stderr)
        return 78
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    log = None if a.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    t = time.monotonic()
    try:
        sha = convert(a.src, out, profile.weights, name=profile.model_preset, log=log)
        with open_artifact(out, verify=False) as art:
            source = art.source
    except (ConvertError, ArtifactError, OSError) as e:
        print(f"ninfer convert: {e}", file=sys.stderr)
        return 1
    write_pin(a.state_dir, {
        "lane": profile.name, "artifact": str(out.relative_to(a.state_dir))
        if out.is_relative_to(a.state_dir) else str(out), "artifact_sha256": sha,
        "recipe": profile.weights, "converter": CONVERTER_VERSION,
        "source_files": source.get("files", []), "model_preset": profile.model_preset,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.monotonic() - t, 1)})
    print(f"{out} sha256 {sha}: pinned for lane {profile.name} in {a.state_dir / PIN}")
    return 0
