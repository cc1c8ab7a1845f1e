"""The real OMP client against a lane whose context is smaller than OMP believes: the server's
`context_length_exceeded` answer makes OMP compact its history and continue the session."""
from __future__ import annotations

import json

import pytest

from lanes.profile import PROFILE_DIR
from tests.omp_client import OmpClient, Provider, last_assistant, omp_install
from tests.recording_http import RecordingServer
from tests.serverproc import start_server

pytestmark = pytest.mark.usefixtures(omp_install.__name__)
CONTEXT = 2048


@pytest.fixture(scope="module")
def server(tmp_path_factory, embedded_models_dir):
    d = tmp_path_factory.mktemp("small-context")
    (d / "models").symlink_to(embedded_models_dir)
    lane = (PROFILE_DIR / "cpu.toml").read_text().replace(
        "context_tokens = 32768", f"context_tokens = {CONTEXT}")
    (d / "small.toml").write_text(lane)
    srv = start_server(d, "--lane", str(d / "small.toml"), model=None)  # the lane's tiny-chat
    yield srv
    assert srv.stop() in (0, -15), "".join(srv.log[-50:])


def _padding(n: int, salt: str) -> str:
    return " ".join(f"{salt}{i}" for i in range(n))


@pytest.mark.slow
def test_omp_compacts_on_context_length_exceeded_and_continues(server, tmp_path):
    proxy = RecordingServer(upstream=server.base_url)
    omp = OmpClient(tmp_path / "omp", [Provider("ninfer", proxy.api_url, server.key,
                                                model="tiny-chat", context_window=32768,
                                                max_tokens=64)], compaction=True)
    # OMP keeps this much of the recent history verbatim and summarizes the rest
    cfg_path = omp.home / ".omp" / "agent" / "config.yml"
    cfg = json.loads(cfg_path.read_text())
    cfg["compaction"].update({"keepRecentTokens": 400})
    cfg_path.write_text(json.dumps(cfg))
    try:
        with omp.rpc("--system-prompt", "You are terse.", "--no-tools") as rpc:
            rpc.wait_for("ready", timeout=60)
            turns = [rpc.prompt(f"Note these words: {_padding(120, s)}", timeout=600)
                     for s in "abcdefgh"]
    finally:
        omp.close()
        proxy.stop()
    log = [(r.status, r.json().get("tool_choice"), len(r.body)) for r in proxy.requests
           if r.path == "/v1/responses"]
    print(log)
    overflowed = [r for r in proxy.requests if r.status == 400]
    assert overflowed, f"no request ever exceeded the {CONTEXT}-token context: {log}"
    for r in overflowed:
        err = json.loads(r.answer)["error"]
        assert err["code"] == "context_length_exceeded", err
    first = proxy.requests.index(overflowed[0])
    later = [r for r in proxy.requests[first + 1:] if r.status == 200]
    # the history was compacted (a request far smaller than the one refused), and the turn
    # that overflowed was sent again and answered
    assert min(len(r.body) for r in later) < len(overflowed[0].body) / 2, log
    refused_turn = overflowed[0].json()["input"][-1]
    assert any(r.json()["input"][-1] == refused_turn for r in later), log
    # every turn ended in a reply, none in an error: OMP compacted and went on
    for frames in turns:
        assert last_assistant(frames)["stopReason"] != "error", last_assistant(frames)
