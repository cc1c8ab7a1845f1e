"""Reading a hashed requirements lock: every distribution's name, version and sha256 hashes."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class Dist:
    name: str  # normalized (PEP 503): lower case, runs of -_. as one -
    version: str
    hashes: tuple[str, ...]  # sha256 of each file the lock admits (wheels, sdists)
    marker: str = ""  # an environment marker, if the lock line has one

    @property
    def purl(self) -> str:
        return f"pkg:pypi/{self.name}@{self.version}"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class LockError(ValueError):
    pass


def options(text: str) -> list[str]:
    """The lock's option lines (--index-url, --find-links, ...), as written."""
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith("-")
            and not ln.strip().startswith("--hash")]


def parse(path: Path | str) -> list[Dist]:
    """The distributions of a pip-compile `--generate-hashes` lock, in file order. A
    requirement line that is not `name==version`, or has no sha256 hash, is a LockError naming
    the package."""
    text = Path(path).read_text()
    # join continuation lines; comments are dropped
    logical, cur = [], ""
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip():
            if cur:
                logical.append(cur)
                cur = ""
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
        else:
            logical.append(cur + line)
            cur = ""
    if cur:
        logical.append(cur)
    dists = []
    for line in logical:
        line = line.strip()
        if not line or line.startswith("-"):
            continue
        m = _REQ.match(line)
        if not m:
            raise LockError(f"{path}: not a pinned requirement: {line.split()[0]}")
        marker = line.split(";", 1)[1].split("--hash", 1)[0].strip() if ";" in line else ""
        hashes = tuple(_HASH.findall(line))
        if not hashes:
            raise LockError(f"{path}: {m.group(1)} has no sha256 hash")
        dists.append(Dist(normalize(m.group(1)), m.group(3), hashes, marker))
    return dists
