"""Preflight: `./ninfer serve --lane L` checks this machine against the lane before it touches
anything, and refuses with exit 78 and the state directory unchanged."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lanes.planner import MiB
from lanes.preflight import Gpu, preflight
from lanes.profile import load_profile

ROOT = Path(__file__).resolve().parent.parent


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, p.stat().st_size, p.stat().st_mode)
            for p in sorted(d.rglob("*"))} | {".": d.stat().st_mtime_ns}


def _serve(*args):
    return subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_gpu_lane_on_this_machine_is_refused_before_anything_is_written(tmp_path):
    fresh = tmp_path / "fresh"
    out = _serve("--lane", "rtx5090", "--state-dir", str(fresh))
    assert out.returncode == 78, out.stderr
    assert "preflight refused" in out.stderr and "RTX 5090" in out.stderr
    assert not fresh.exists()
    # an existing state directory is left exactly as it was
    used = tmp_path / "used"
    (used / "logs").mkdir(parents=True, mode=0o700)
    (used / "keys").write_text("default nk-0123456789abcdef0123\n")
    os.chmod(used / "keys", 0o600)
    before = _tree(used)
    out = _serve("--lane", "rtx3090", "--state-dir", str(used))
    assert out.returncode == 78, out.stderr
    assert _tree(used) == before
    assert "nothing was started or written" in out.stderr


def _check(lane, tmp_path, **kw):
    kw.setdefault("gpus", lambda: [Gpu("NVIDIA GeForce RTX 4090", 24564, "580.95.05")])
    kw.setdefault("ram", lambda: 128 << 30)
    kw.setdefault("free_disk", lambda p: 1 << 40)
    kw.setdefault("checkpoints", True)
    from lanes.models import artifact_path, write_pin

    prof = load_profile(lane)
    write_pin(tmp_path, {"lane": prof.name, "artifact_sha256": "0" * 64})
    artifact_path(prof, tmp_path).write_bytes(b"x")
    return preflight(load_profile(lane), state_dir=tmp_path, **kw)


def test_the_lanes_card_passes_and_each_mismatch_is_named(tmp_path):
    assert _check("rtx4090", tmp_path) == []
    p = _check("rtx4090", tmp_path, gpus=lambda: [Gpu("NVIDIA GeForce RTX 3090", 24576, "580.95.05")])
    assert len(p) == 1 and "is for an NVIDIA GeForce RTX 4090, but GPU 0 is an NVIDIA GeForce RTX 3090" in p[0]
    p = _check("rtx4090", tmp_path, gpus=lambda: [Gpu("NVIDIA GeForce RTX 4090", 20000, "580.95.05")])
    assert len(p) == 1 and "20,000 MiB" in p[0]
    p = _check("rtx4090", tmp_path, gpus=lambda: [Gpu("NVIDIA GeForce RTX 4090", 24564, "550.54.14")])
    assert len(p) == 1 and "driver 550.54.14 is older than the 580.65" in p[0]
    p = _check("rtx4090", tmp_path, gpus=lambda: "no NVIDIA driver here (nvidia-smi not found)")
    assert len(p) == 1 and "nvidia-smi not found" in p[0]


def test_host_ram_disk_and_the_model_are_checked(tmp_path):
    p = _check("rtx4090", tmp_path, ram=lambda: 16 << 30)
    assert len(p) == 1 and "more than this host's" in p[0]
    p = _check("rtx4090", tmp_path, free_disk=lambda d: 10 << 30)
    assert len(p) == 1 and "checkpoint quota" in p[0] and f"{24 * 1024:,} MiB" in p[0]
    assert _check("rtx4090", tmp_path, free_disk=lambda d: 10 << 30, checkpoints=False) == []
    (tmp_path / "models" / "pinned.json").unlink()
    p = preflight(load_profile("rtx4090"), state_dir=tmp_path, checkpoints=False,
                  gpus=lambda: [Gpu("NVIDIA GeForce RTX 4090", 24564, "580.95.05")],
                  ram=lambda: 128 << 30)
    assert len(p) == 1 and "has not been converted" in p[0] and "--synthetic-weights" in p[0]
    assert preflight(load_profile("rtx4090"), state_dir=tmp_path, checkpoints=False,
                     synthetic=True, gpus=lambda: [Gpu("NVIDIA GeForce RTX 4090", 24564, "580.95.05")],
                     ram=lambda: 128 << 30) == []


def test_the_cpu_lane_passes_here(tmp_path):
    assert preflight(load_profile("cpu"), state_dir=tmp_path / "s", checkpoints=True) == []
    assert MiB == 1 << 20


def _pending_lane(tmp_path, name: str, model: str, extra: str = "") -> Path:
    """The cpu lane as a lane whose model is an artifact never pinned in its profile (tiny
    shapes, one-token prefill pieces and a 512-token context: a quick start)."""
    import re

    text = (ROOT / "lanes" / "profiles" / "cpu.toml").read_text()
    for key, value in (("name", f'"{name}"'), ("model", f'"{model}"'),
                       ("model_sha256", '"PENDING"'), ("prefill_chunk", "1"),
                       ("context_tokens", "512")):
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        assert n == 1
    lane = tmp_path / f"{name}.toml"
    lane.write_text(text + f'model_preset = "tiny"\n{extra}\n')
    return lane


def test_convert_for_a_lane_pins_the_artifact_and_serve_holds_it(tmp_path):
    """A lane whose model is PENDING: `./ninfer convert --lane` writes it into the state
    directory and pins its sha256; serve then starts on it, and refuses it once a byte
    changes. A second convert is refused while the pin stands."""
    import httpx

    from engine.model.config import TINY
    from engine.text.chat import default_chat_template
    from engine.text.tokenizer import build_qwen35_tokenizer_json
    from lanes.models import read_pin
    from tests.hf_models import build_hf
    from tests.serverproc import start_server

    src = tmp_path / "hf"
    build_hf(TINY, seed=4, weight_scale=1.0).save_pretrained(src)
    (src / "tokenizer.json").write_text(build_qwen35_tokenizer_json(), encoding="utf-8")
    (src / "chat_template.jinja").write_text(default_chat_template(), encoding="utf-8")
    lane = _pending_lane(tmp_path, "pinned", "models/pinned-tiny.ninfer")
    state = tmp_path / "state"
    out = _serve("--lane", str(lane), "--state-dir", str(state))
    assert out.returncode == 78 and "has not been converted" in out.stderr
    conv = subprocess.run([sys.executable, "-m", "server.cli", "convert", "--lane", str(lane),
                           "--from", str(src), "--state-dir", str(state), "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert conv.returncode == 0, conv.stderr
    pin = read_pin(state)
    assert pin["lane"] == "pinned" and pin["recipe"] == "fp32" and len(pin["source_files"]) >= 2
    again = subprocess.run([sys.executable, "-m", "server.cli", "convert", "--lane", str(lane),
                            "--from", str(src), "--state-dir", str(state)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 78 and "already converted and pinned" in again.stderr
    srv = start_server(state, "--lane", str(lane), "--checkpoints", "off",
                       "--verify-artifact", "full", model=None)  # the lane's own artifact
    try:
        r = httpx.post(srv.api_url + "/responses", timeout=300,
                       headers={"Authorization": f"Bearer {srv.key}"},
                       json={"model": "tiny", "input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
    from lanes.models import write_pin

    def refused() -> str:
        bad = start_server(state, "--lane", str(lane), "--checkpoints", "off",
                           "--verify-artifact", "full", wait_ready=False, model=None)
        assert bad.proc.wait(timeout=300) == 3
        return "".join(bad.log)

    # the pin names other bytes: refused, naming what it expected
    write_pin(state, {**pin, "artifact_sha256": "0" * 64})
    assert "0" * 64 in refused()
    # the pin stands, a byte of the artifact changed: refused
    write_pin(state, pin)
    art = state / "models" / "pinned-tiny.ninfer"
    data = bytearray(art.read_bytes())
    data[len(data) // 2] ^= 1
    art.write_bytes(bytes(data))
    assert "model failed to load" in refused()


def test_synthetic_weights_serve_a_lane_without_its_model_and_say_so(tmp_path):
    """A lane whose model was never converted serves its shapes with random weights under
    --synthetic-weights: preflight lets it through, and the status route and the request log
    say synthetic_weights."""
    import json

    import httpx

    from tests.serverproc import start_server

    lane = _pending_lane(tmp_path, "synth", "models/never-converted.ninfer", 'weights = "bf16"')
    state = tmp_path / "state"
    srv = start_server(state, "--lane", str(lane), "--checkpoints", "off", "--synthetic-weights")
    try:
        h = {"Authorization": f"Bearer {srv.key}"}
        st = httpx.get(srv.api_url + "/ninfer/status", headers=h, timeout=60).json()
        assert st["model"]["synthetic_weights"] is True
        assert st["device_memory"] is None  # the cpu lane: no device figures
        r = httpx.post(srv.api_url + "/responses", headers=h, timeout=300,
                       json={"model": st["model"]["id"], "input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
    assert (state / "models" / "synthetic-tiny-bf16.ninfer").exists()
    log = [json.loads(x) for x in (state / "logs" / "requests.jsonl").read_text().splitlines()]
    start = next(x for x in log if x["event"] == "server_start")
    assert start["synthetic_weights"] is True


def test_serve_refuses_a_bad_or_unknown_profile_with_78_before_anything(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((ROOT / "lanes" / "profiles" / "cpu.toml").read_text().replace(
        "prefill_chunk = 256\n", ""))
    for lane, says in ((str(bad), "missing fields ['prefill_chunk']"),
                       ("nope", "known lanes"),
                       (str(tmp_path / "x.toml"), "no lane profile")):
        out = _serve("--lane", lane, "--state-dir", str(tmp_path / "state"))
        assert out.returncode == 78 and says in out.stderr, out.stderr
        assert not (tmp_path / "state").exists()
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    out = _serve("--lane", str(broken), "--state-dir", str(tmp_path / "state"))
    assert out.returncode == 78 and "broken.toml" in out.stderr and "not valid TOML" in out.stderr
