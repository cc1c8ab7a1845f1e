"""Durable checkpoints through real server processes sharing one state directory:

  S1  builds 2K-token sessions; bob's never-stopped turns are the reference; SIGKILL
  S2  (autosave off) true-cold restore of alice == bob; carol's flipped byte -> quarantine and
      recompute; dave is the negative control; SIGTERM saves what was never checkpointed
  S3  alice continues exactly from the graceful-stop checkpoint; `ninfer ctl stop`
  S4  a changed profile: incompatible, reason logged, recomputed and saved under its own
      fingerprint
  S5  the original profile again restores its own generation; injected ENOSPC refuses saves
      while serving continues

Token identity: 64 greedy tokens with at least 16 distinct, and a negative control.
"""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from lanes.profile import PROFILE_DIR
from server.checkpoints.tags import session_namespace
from tests.serverproc import REPO, start_server

PRINCIPALS = ("alice", "bob", "carol", "dave")
KV_BYTES_PER_TOKEN = 2048  # the tiny model, fp32 KV
SESSION = "ck-session-7f3a9c2e"


def key_of(who: str) -> str:
    return f"nk-{who}-0123456789abcdef"


def big_prompt(seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = ["parse", "tree", "vector", "merge", "cache", "queue", "graph", "token", "shard",
             "index", "lambda", "socket", "buffer", "thread", "kernel", "branch"]
    lines = [f"{i}. {' '.join(rng.choice(words, 6))} = {int(rng.integers(0, 999))}"
             for i in range(150)]
    return "Review these entries:\n" + "\n".join(lines)


TURNS = {2: "Which entry matters most, and why?", 3: "Now rewrite it as Python code.",
         4: "Add a unit test.", 5: "Summarize."}


@pytest.fixture(scope="module")
def world(tmp_path_factory, embedded_models_dir):
    d = tmp_path_factory.mktemp("ckpt")
    (d / "models").symlink_to(embedded_models_dir)
    keys = d / "keys"
    # alice reads the whole server's checkpoint metrics: an admin (server/auth.py)
    keys.write_text("".join(f"{p} {key_of(p)}{' admin' if p == 'alice' else ''}\n"
                            for p in PRINCIPALS))
    keys.chmod(0o600)
    base = (PROFILE_DIR / "cpu.toml").read_text()
    # restores stream through a staging arena of 4 slots of 2 pages (the GPU lanes' path)
    small = (base.replace("context_tokens = 32768", "context_tokens = 4096")
             .replace("kv_capacity_tokens = 131072", "kv_capacity_tokens = 16384")
             .replace("checkpoint_staging_bytes = 0", "checkpoint_staging_bytes = 1048576"))
    assert small != base
    (d / "ckpt.toml").write_text(small)
    (d / "ckpt-b.toml").write_text(small.replace("max_queue = 16", "max_queue = 15"))
    return SimpleNamespace(dir=d, lane=str(d / "ckpt.toml"), lane_b=str(d / "ckpt-b.toml"),
                           ids={}, r={})


def start(w, *extra, lane=None, env=None):
    old = dict(os.environ)
    os.environ.update({"SANIC_RESPONSE_TIMEOUT": "600", **(env or {})})  # slow shared CI CPUs
    try:
        return start_server(w.dir, "--lane", lane or w.lane, *extra)
    finally:
        os.environ.clear()
        os.environ.update(old)


def ask(srv, who, text, prev=None, n=64):
    body = {"model": "tiny", "input": text, "max_output_tokens": n, "temperature": 0,
            "prompt_cache_key": SESSION}
    if prev is not None:
        body["previous_response_id"] = prev["id"]
    r = httpx.post(srv.api_url + "/responses", json=body, timeout=600,
                   headers={"Authorization": f"Bearer {key_of(who)}"})
    assert r.status_code == 200, r.text
    return r.json()


def save_now(srv, who):
    r = httpx.post(srv.api_url + "/ninfer/checkpoints", json={"prompt_cache_key": SESSION},
                   headers={"Authorization": f"Bearer {key_of(who)}"}, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def fed(r) -> int:
    u = r["usage"]
    return u["input_tokens"] + u["output_tokens"] - (r["status"] == "incomplete")


def out_ids(w, response_id) -> list[int]:
    db = sqlite3.connect(f"file:{w.dir / 'responses.db'}?mode=ro", uri=True)
    try:
        (blob,), = db.execute("SELECT token_ids FROM output_items WHERE response_id = ?",
                              (response_id,)).fetchall()
    finally:
        db.close()
    return np.frombuffer(blob, "<i4").tolist()


def done_record(w, response_id) -> dict:
    for line in (w.dir / "logs" / "requests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("request_id") == response_id and rec["event"] == "request_done":
            return rec
    raise LookupError(response_id)


def events(w, name) -> list[dict]:
    return [json.loads(x) for x in (w.dir / "logs" / "requests.jsonl").read_text().splitlines()
            if json.loads(x)["event"] == name]


def meaningful(ids) -> bool:
    return len(ids) == 64 and len(set(ids)) >= 16


def gen_dir(w, who) -> Path:
    sdir = w.dir / "checkpoints" / "sessions" / session_namespace(who, SESSION)
    return sdir / "generations" / (sdir / "current").read_text().strip()


def kill(srv, sig) -> None:
    srv.proc.send_signal(sig)
    srv.proc.wait(timeout=120)


def test_s1_sessions_reference_and_bytes_per_turn(world):
    w = world
    srv = start(w)
    try:
        b1 = ask(srv, "bob", big_prompt(1), n=8)
        assert b1["usage"]["input_tokens"] >= 2048
        b2 = ask(srv, "bob", TURNS[2], prev=b1)
        b3 = ask(srv, "bob", TURNS[3], prev=b2)
        w.r.update(b1=b1, b2=b2, b3=b3)
        for who in ("alice", "carol"):
            w.r[who[0] + "1"] = ask(srv, who, big_prompt(1), n=8)
        w.r["d1"] = ask(srv, "dave", big_prompt(2), n=8)  # a different history
        for who in PRINCIPALS:  # explicit saves; they also wait for the autosaves
            assert all(x["status"] in ("saved", "already_saved") for x in save_now(srv, who))
        m1 = json.loads((gen_dir(w, "alice") / "manifest.json").read_text())
        assert m1["frontier_tokens"] == fed(w.r["a1"]) and m1["head_response_id"] == \
            w.r["a1"]["id"]
        # bytes written per turn: bob's third turn added N tokens to a 2K-token context
        m3 = json.loads((gen_dir(w, "bob") / "manifest.json").read_text())
        n_new = fed(b3) - fed(b2)
        state = (gen_dir(w, "bob") / "state.bin").stat().st_size
        kv = m3["bytes_written"] - state - 4 * fed(b3)
        assert m3["frontier_tokens"] == fed(b3)
        assert n_new * KV_BYTES_PER_TOKEN <= kv <= (n_new + 2 * 64) * KV_BYTES_PER_TOKEN
        assert m3["bytes_written"] < m3["payload_bytes"] / 4
    finally:
        kill(srv, signal.SIGKILL)
    w.ids.update(ref2=out_ids(w, b2["id"]), ref3=out_ids(w, b3["id"]))
    assert meaningful(w.ids["ref2"]) and meaningful(w.ids["ref3"])


def test_s2_true_cold_restore_corruption_and_graceful_stop(world):
    w = world
    state_bin = gen_dir(w, "carol") / "state.bin"
    data = bytearray(state_bin.read_bytes())
    data[1000] ^= 0x20
    state_bin.write_bytes(bytes(data))
    srv = start(w, "--checkpoint-autosave", "off")
    try:
        a1, c1, d1 = w.r["a1"], w.r["c1"], w.r["d1"]
        a2 = ask(srv, "alice", TURNS[2], prev=a1)
        rec = done_record(w, a2["id"])
        assert a2["usage"]["input_tokens_details"]["cached_tokens"] == fed(a1)
        assert (rec["path"], rec["checkpoint"]) == ("disk-restored", "restored")
        assert rec["computed_tokens"] == a2["usage"]["input_tokens"] - fed(a1)
        c2 = ask(srv, "carol", TURNS[2], prev=c1)
        rec = done_record(w, c2["id"])
        assert rec["checkpoint"].startswith("hash_mismatch") and rec["path"] == "root"
        assert rec["cached_tokens"] == 0
        assert len(os.listdir(w.dir / "checkpoints" / "quarantine")) == 1
        d2 = ask(srv, "dave", TURNS[2], prev=d1)
        w.r.update(a2=a2)
        metrics = httpx.get(srv.base_url + "/metrics", timeout=60,
                            headers={"Authorization": f"Bearer {key_of('alice')}"}).text
        restored = [e for e in events(w, "checkpoint_restore") if e["reason"] == "restored"]
        assert len(restored) == 2  # alice and dave; carol's is corrupt
        for e in restored:  # where the restore's time went, logged with it
            assert e["staging"] == "arena"  # streamed through the lane's staging arena
            st = e["stages"]
            assert {"read_verify", "to_device_s", "import_s", "total"} <= set(st)
            assert all(v >= 0 for v in st.values()) and st["total"] <= e["seconds"]
        assert 'ninfer_checkpoint_restores_total{outcome="restored"} 2.0' in metrics
        assert 'ninfer_checkpoint_restores_total{outcome="corrupt"} 1.0' in metrics
        # a corrupt checkpoint is a storage fault: on stderr and in its counter too
        assert 'ninfer_storage_errors_total{kind="corrupt",store="checkpoints"} 1.0' in metrics
        assert "storage fault: checkpoints: corrupt" in "".join(srv.log)
        assert "ninfer_checkpoint_restore_bytes_total 0.0" not in metrics
    finally:
        kill(srv, signal.SIGTERM)
    assert srv.proc.returncode == 0
    ref2 = w.ids["ref2"]
    assert out_ids(w, a2["id"]) == ref2            # restored == never stopped
    assert out_ids(w, c2["id"]) == ref2            # recomputed correctly
    assert out_ids(w, d2["id"]) != ref2            # negative control: another history
    report = json.loads((w.dir / "stop_report.json").read_text())
    saved = {x["session"] for x in report["saved"]}
    assert session_namespace("alice", SESSION)[:16] in saved and not report["refused"]
    assert "ninfer: stop report: saved" in "".join(srv.log)
    assert json.loads((gen_dir(w, "alice") / "manifest.json").read_text())[
        "head_response_id"] == a2["id"]


def test_s3_continues_exactly_after_the_graceful_stop_and_ctl(world):
    w = world
    srv = start(w)
    try:
        a3 = ask(srv, "alice", TURNS[3], prev=w.r["a2"])
        rec = done_record(w, a3["id"])
        assert rec["path"] == "disk-restored" and rec["cached_tokens"] == fed(w.r["a2"])
        w.r["a3"] = a3
        sock = w.dir / "ctl.sock"
        assert sock.is_socket() and sock.stat().st_mode & 0o777 == 0o600
        ctl = [sys.executable, "-m", "server.cli", "ctl", "--state-dir", str(w.dir)]
        st = subprocess.run(ctl[:4] + ["status"] + ctl[4:], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["state"] == "serving"
        drain = subprocess.run(ctl[:4] + ["drain"] + ctl[4:], cwd=REPO, capture_output=True,
                               text=True, timeout=120)
        assert drain.returncode == 0, drain.stderr
        assert json.loads(drain.stdout)["drained"] is True
        refused = httpx.post(srv.api_url + "/responses", timeout=60,
                             json={"model": "tiny", "input": "x", "prompt_cache_key": SESSION},
                             headers={"Authorization": f"Bearer {key_of('alice')}"})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "server_draining"
        assert refused.headers["Retry-After"] == "5"
        kept = httpx.get(srv.api_url + f"/responses/{a3['id']}", timeout=60,
                         headers={"Authorization": f"Bearer {key_of('alice')}"})
        assert kept.status_code == 200  # reads still work while draining
        stop = subprocess.run(ctl[:4] + ["stop"] + ctl[4:], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert "report" in json.loads(stop.stdout)
        srv.proc.wait(timeout=60)
    finally:
        kill(srv, signal.SIGKILL) if srv.proc.poll() is None else None
    assert srv.proc.returncode == 0
    assert out_ids(w, a3["id"]) == w.ids["ref3"]


def test_s4_s5_profile_change_is_incompatible_then_rollback_restores_and_enospc(world):
    w = world
    srv = start(w, lane=w.lane_b)
    try:
        a4 = ask(srv, "alice", TURNS[4], prev=w.r["a3"], n=8)
        rec = done_record(w, a4["id"])
        assert rec["checkpoint"] == "fingerprint_mismatch" and rec["path"] == "root"
        restore = [e for e in events(w, "checkpoint_restore")][-1]
        assert (restore["state"], restore["reason"]) == ("incompatible", "fingerprint_mismatch")
        save_now(srv, "alice")
    finally:
        kill(srv, signal.SIGTERM)
    sdir = w.dir / "checkpoints" / "sessions" / session_namespace("alice", SESSION)
    assert len(os.listdir(sdir / "generations")) == 2  # one per fingerprint
    srv = start(w, env={"NINFER_CHECKPOINT_FAULTS": "enospc"})
    try:
        a5 = ask(srv, "alice", TURNS[5], prev=a4, n=8)
        rec = done_record(w, a5["id"])
        assert rec["path"] == "disk-restored" and rec["checkpoint"] == "restored"
        assert rec["cached_tokens"] == fed(w.r["a3"])  # the original profile's generation
        saved = save_now(srv, "alice")
        assert saved[0]["status"] == "refused" and saved[0]["reason"] == "enospc"
        b = ask(srv, "bob", "Still there?", n=4)  # serving continues
        assert b["status"] in ("completed", "incomplete")
        assert any(e["reason"] == "enospc" for e in events(w, "checkpoint_refused"))
        assert len(os.listdir(sdir / "generations")) == 2
        assert not [n for n in os.listdir(sdir) if n.startswith(".staging")]
        # purging the session removes its checkpoints and the pages only it referenced
        r = httpx.delete(srv.api_url + f"/ninfer/sessions/{SESSION}",
                         headers={"Authorization": f"Bearer {key_of('alice')}"}, timeout=60)
        assert r.status_code == 200, r.text
        assert not sdir.exists()
    finally:
        kill(srv, signal.SIGTERM)
