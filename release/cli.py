"""`./ninfer release build|verify`."""
from __future__ import annotations

import sys

USAGE = """usage: ninfer release build [--out DIR] [options]
       ninfer release verify DIR [--manifest-sha256 H] [--require-ready]"""


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("build", "verify"):
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] == "build":
        from release.build import main as build_main

        return build_main(argv[1:])
    from release.verify import main as verify_main

    return verify_main(argv[1:])
