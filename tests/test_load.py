"""Load on the real server (tests/load_run.py): more concurrent chained clients than the lane
runs and queues, so that it sheds with 429 and Retry-After; every acknowledged response is
retrievable with its chain link."""
from __future__ import annotations

import json

import pytest

from lanes.profile import PROFILE_DIR
from tests.load_run import run_load
from tests.serverproc import start_server


def tight_lane(dir_, max_queue: int = 4):
    """The cpu lane with room for two running requests and `max_queue` waiting ones."""
    lane = (PROFILE_DIR / "cpu.toml").read_text()
    for old, new in (("max_queue = 16", f"max_queue = {max_queue}"),
                     ("context_tokens = 32768", "context_tokens = 4096")):
        assert old in lane
        lane = lane.replace(old, new)
    path = dir_ / "load.toml"
    path.write_text(lane)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, embedded_models_dir):
    d = tmp_path_factory.mktemp("load")
    (d / "models").symlink_to(embedded_models_dir)
    srv = start_server(d, "--lane", str(tight_lane(d)))
    yield srv
    assert srv.stop() in (0, -15), "".join(srv.log[-50:])


@pytest.mark.slow
def test_load_sheds_with_retry_after_and_loses_nothing(server):
    res = run_load(server.base_url, server.key, clients=16, turns=6)
    print(json.dumps(res))
    assert not res["problems"], res
    assert res["requests_acknowledged"] == 16 * 6
    assert res["retrievable"] == res["requests_acknowledged"], res["missing"]
    assert res["shed_429"] > 0, "16 clients on 2 rows and 4 queue places were never shed"
