"""The server's API fuzzed from its OpenAPI document (tests/fuzz_api.py) against the real server:
no 5xx, every error in the OpenAI format, streams that end, a live server after each batch. A
fast sample in the default tier; 10,000 cases in the slow tier, at least 30% of them valid
requests that succeed."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from tests.fuzz_api import fuzz_case
from tests.fuzz_run import Fuzzer
from tests.serverproc import start_server


@pytest.fixture(scope="module")
def server(shared_state_dir):
    srv = start_server(shared_state_dir)
    yield srv
    assert srv.stop() in (0, -15), "".join(srv.log[-50:])


def run_fuzz(base_url: str, key: str, *, batches: int, batch_size: int, at: int,
             workers: int = 4) -> Fuzzer:
    """`batches` batches of `batch_size` cases drawn by hypothesis (seeded by `at`), each
    sent `workers` at a time and followed by a liveness check."""
    fz = Fuzzer(base_url, key, workers=workers, seed=at)

    @seed(at)
    @settings(max_examples=batches, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.lists(fuzz_case(), min_size=batch_size, max_size=batch_size))
    def prop(cases):
        fz.batch(cases)

    try:
        prop()
    finally:
        fz.close()
    return fz


def _report(fz: Fuzzer) -> str:
    return json.dumps({"summary": fz.summary(), "failures": fz.failures[:5]}, indent=1)


def test_fuzz_sample(server):
    fz = run_fuzz(server.base_url, server.key, batches=6, batch_size=30, at=46)
    s = fz.summary()
    print(json.dumps(s))
    assert not fz.failures, _report(fz)
    assert s["cases"] == 6 * 30 and s["fivexx"] == 0
    assert set(s["classes"]) == {"valid", "schema", "mutated", "raw", "paths", "auth"}, s
    assert s["valid_2xx"] >= 0.3 * s["cases"], _report(fz)


@pytest.mark.slow
def test_fuzz_ten_thousand(server):
    fz = run_fuzz(server.base_url, server.key, batches=250, batch_size=40, at=4646)
    s = fz.summary()
    print(json.dumps(s))
    assert not fz.failures, _report(fz)
    assert s["cases"] == 10_000 and s["fivexx"] == 0
    assert s["valid_2xx"] >= 0.3 * s["cases"], _report(fz)
