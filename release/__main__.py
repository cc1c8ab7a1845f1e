"""`python -m release build|verify ...`: the same as `./ninfer release`, for Bazel and Nix."""
import sys

from release.cli import main

sys.exit(main(sys.argv[1:]))
