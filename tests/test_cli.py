"""`./ninfer test`'s worker count (server/cli.py worker_count): the suite runs on both of CI's
cores through pytest-xdist unless the arguments choose otherwise."""
from __future__ import annotations

import os

import pytest

from server.cli import build_parser, worker_count


def test_default_is_one_worker_a_core_at_most_two():
    cores = len(os.sched_getaffinity(0))
    assert worker_count(None, []) == max(1, min(2, cores))
    assert worker_count(None, ["-k", "server", "tests/test_store.py"]) == max(1, min(2, cores))


@pytest.mark.parametrize("rest", [["-n", "4"], ["-n4"], ["--numprocesses=3"], ["-p", "no:xdist"],
                                  ["-m", "gpu"], ["-q", "-m", "gpu", "tests/test_engine_gpu.py"]])
def test_arguments_that_choose_their_own_processes_get_no_workers_added(rest):
    assert worker_count(None, rest) == 1


def test_workers_flag_wins_and_is_at_least_one():
    args, rest = build_parser().parse_known_args(["test", "--workers", "3", "-k", "x"])
    assert args.workers == 3 and rest == ["-k", "x"]
    assert worker_count(args.workers, rest) == 3
    assert worker_count(0, []) == 1
    args, _ = build_parser().parse_known_args(["test"])
    assert args.workers is None
