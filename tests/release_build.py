"""The release tier's release: built twice from this tree, once per test run, shared by the
release tier's modules and by both of its test processes (a file lock: the first builds, the
other waits and reuses)."""
from __future__ import annotations

import fcntl
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EPOCH = 1_796_000_000  # 2026-11-29: fixed, so the two builds may be compared byte for byte
CACHE = Path.home() / ".cache" / "ninfer" / "release"


def shared_release(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(build a, build b, {"seconds": [a, b]}): the whole release, every lane, twice."""
    from release.build import build

    root = tmp_path_factory.getbasetemp()
    if root.name.startswith("popen-gw"):  # pytest-xdist: one base per worker, one parent
        root = root.parent
    root = root / "release-tier"
    root.mkdir(exist_ok=True)
    a, b = root / "a" / "v0.16.0", root / "b" / "v0.16.0"
    facts = root / "facts.json"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not facts.exists():
            seconds = []
            for out in (a, b):
                t0 = time.monotonic()
                build(out, epoch=EPOCH, cache=CACHE, log=lambda *_: None)
                seconds.append(round(time.monotonic() - t0, 1))
            facts.write_text(json.dumps({"seconds": seconds}))
    return a, b, json.loads(facts.read_text())
