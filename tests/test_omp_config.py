"""`./ninfer omp-config` writes a fail-closed OMP provider config from the lane and key file."""
from __future__ import annotations

import json
import stat
import subprocess

from lanes.profile import load_profile
from server.omp_config import IMPLICIT_PROVIDERS
from tests.serverproc import REPO


def test_omp_config_command(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    keys = state / "keys"
    keys.write_text("alice nk-alice-0123456789abcdef\nbob nk-bob-0123456789abcdef00\n")
    keys.chmod(0o600)
    out = tmp_path / "agent"
    r = subprocess.run([str(REPO / "ninfer"), "omp-config", "--out", str(out), "--state-dir",
                        str(state), "--principal", "bob", "--port", "18100"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "nk-bob" not in r.stdout + r.stderr  # the key goes into the file only
    lane = load_profile("cpu")
    for name in ("models.yml", "config.yml"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600
    models = json.loads((out / "models.yml").read_text())
    (pid, prov), = models["providers"].items()
    assert pid == "ninfer" and prov["baseUrl"] == "http://127.0.0.1:18100/v1"
    assert prov["api"] == "openai-responses" and prov["apiKey"] == "nk-bob-0123456789abcdef00"
    (m,) = prov["models"]
    assert m["id"] == "tiny-chat" and m["input"] == ["text"]  # the cpu lane's served model
    assert m["contextWindow"] == lane.context_tokens and m["maxTokens"] == lane.max_output_tokens
    cfg = json.loads((out / "config.yml").read_text())
    assert cfg["retry"] == {"enabled": False, "modelFallback": False,
                            "fallbackRevertPolicy": "never"}
    assert cfg["providers"]["maxInFlightRequests"] == {"ninfer": lane.max_concurrency}
    assert cfg["startup"] == {"checkUpdate": False}
    assert set(IMPLICIT_PROVIDERS) <= set(cfg["disabledProviders"])
    bad = subprocess.run([str(REPO / "ninfer"), "omp-config", "--out", str(out), "--state-dir",
                          str(state), "--principal", "carol"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "carol" in bad.stderr
