"""What this host has: memory (from /proc/meminfo) and free disk where a path will be."""
from __future__ import annotations

import shutil
from pathlib import Path


def meminfo(field: str) -> int | None:
    """/proc/meminfo's `field` ("MemTotal", "MemAvailable") in bytes; None where unreadable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def existing_parent(path: Path) -> Path:
    """`path`, or the nearest folder above it that exists (where it would be created)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_disk(path: Path) -> int:
    """Bytes free on the file system `path` is (or would be created) on."""
    return shutil.disk_usage(existing_parent(path)).free
