"""Sessions leave the machine, through real server processes on loopback:

  T1  server A builds alice's session and exports it while serving; A, never stopped, then
      continues it: the reference
  T2  server B (another state dir, its own secrets, the same transfer key) imports the bundle
      while running (control socket); `previous_response_id` continues there token-identically
      from the restored checkpoint; another principal's and a wrong key's imports are refused
  T3  with B stopped, every bad bundle is refused before any write, naming the file and entry
  T4  state dir C imports while stopped, then a resent transcript with the same
      prompt_cache_key restores from the checkpoint; C is backed up while serving, its whole
      state dir removed, restored, and the next turn continues token-identically
"""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from types import SimpleNamespace

import pytest

from lanes.profile import PROFILE_DIR
from server.checkpoints.bundle import read_transfer_key, write_bundle
from tests.serverproc import REPO
from tests.test_checkpoint_server import (SESSION, TURNS, ask, big_prompt, done_record, fed,
                                          key_of, out_ids, save_now, start)

TRANSFER_KEY = "secrets/transfer-key"


def ninfer(*args, ok=True):
    r = subprocess.run([sys.executable, "-m", "server.cli", *map(str, args)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    if ok:
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout) if r.stdout.strip().startswith("{") else r.stdout
    assert r.returncode == 1, (r.stdout, r.stderr)
    return r.stderr


def state_dir(root, name, lane_toml, keys):
    d = root / name
    d.mkdir(mode=0o700)
    (d / "models").symlink_to(root / "models")
    (d / "keys").write_text(keys)
    (d / "keys").chmod(0o600)
    return SimpleNamespace(dir=d, lane=lane_toml, lane_b=lane_toml)


def tree(d):
    """Every file under a state dir's checkpoints and the response rows: what an import
    would change."""
    files = sorted(str(p.relative_to(d)) for p in (d / "checkpoints").rglob("*") if p.is_file()
                   and p.name != "lock")
    import sqlite3
    db = sqlite3.connect(f"file:{d / 'responses.db'}?mode=ro", uri=True)
    try:
        n = db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]
    finally:
        db.close()
    return files, n


@pytest.fixture(scope="module")
def world(tmp_path_factory, embedded_models_dir):
    root = tmp_path_factory.mktemp("transfer")
    (root / "models").symlink_to(embedded_models_dir)
    base = (PROFILE_DIR / "cpu.toml").read_text()
    small = (base.replace("context_tokens = 32768", "context_tokens = 4096")
             .replace("kv_capacity_tokens = 131072", "kv_capacity_tokens = 16384"))
    assert small != base
    lane = root / "transfer.toml"
    lane.write_text(small)
    keys = "".join(f"{p} {key_of(p)}\n" for p in ("alice", "bob"))
    w = SimpleNamespace(root=root, r={}, ids={})
    w.a, w.b, w.c = (state_dir(root, n, str(lane), keys) for n in "abc")
    w.bundle = root / "alice.bundle"
    yield w
    for d in (w.a, w.b, w.c):  # a test that failed midway leaves its server running
        if getattr(d, "srv", None) is not None:
            d.srv.stop()


def test_t1_export_while_serving_and_the_reference(world):
    w = world
    key = ninfer("checkpoints", "transfer-key", "--state-dir", w.a.dir).strip()
    assert key == str(w.a.dir / TRANSFER_KEY) and os.stat(key).st_mode & 0o777 == 0o600
    for other in (w.b, w.c):  # the owner gives the key to both servers
        (other.dir / "secrets").mkdir(mode=0o700)
        shutil.copy2(key, other.dir / TRANSFER_KEY)
    w.a.srv = srv = start(w.a)
    r1 = ask(srv, "alice", big_prompt(1), n=8)
    r2 = ask(srv, "alice", TURNS[2], prev=r1)
    assert all(x["status"] in ("saved", "already_saved") for x in save_now(srv, "alice"))
    out = ninfer("checkpoints", "export", "--state-dir", w.a.dir, "--session", SESSION,
                 "--principal", "alice", "--out", w.bundle)
    assert out["frontier_tokens"] == fed(r2) and out["responses"] == 2
    assert w.bundle.stat().st_mode & 0o777 == 0o600 and out["bytes"] == w.bundle.stat().st_size
    with tarfile.open(w.bundle) as t:
        names = t.getnames()
    assert names[0] == "bundle.json" and names[-1] == "bundle.mac"
    assert "responses.json" in names and any(n.startswith("pages/") for n in names)
    r3 = ask(srv, "alice", TURNS[3], prev=r2)  # A never stopped: the reference
    w.r.update(r1=r1, r2=r2, r3=r3)
    w.ids["ref3"] = out_ids(w.a, r3["id"])
    assert len(set(w.ids["ref3"])) >= 16


def test_t2_import_into_a_running_server_continues_exactly(world):
    w = world
    w.b.srv = srv = start(w.b)
    try:
        bad_key = w.root / "wrong.key"
        ninfer("checkpoints", "transfer-key", "--out", bad_key)
        msg = ninfer("checkpoints", "import", w.bundle, "--state-dir", w.b.dir,
                     "--transfer-key", bad_key, ok=False)
        assert "bundle.mac does not verify" in msg and str(w.bundle) in msg
        msg = ninfer("checkpoints", "import", w.bundle, "--state-dir", w.b.dir,
                     "--principal", "bob", ok=False)
        assert "another principal" in msg
        before = tree(w.b.dir)
        got = ninfer("checkpoints", "import", w.bundle, "--state-dir", w.b.dir,
                     "--principal", "alice")
        assert got["server"] == "running" and got["responses"] == 2
        assert got["frontier_tokens"] == fed(w.r["r2"])
        assert tree(w.b.dir)[1] == before[1] + 2
        b3 = ask(srv, "alice", TURNS[3], prev=w.r["r2"])
        rec = done_record(w.b, b3["id"])
        assert (rec["path"], rec["checkpoint"]) == ("disk-restored", "restored")
        assert b3["usage"]["input_tokens_details"]["cached_tokens"] == fed(w.r["r2"])
        assert rec["computed_tokens"] == b3["usage"]["input_tokens"] - fed(w.r["r2"])
    finally:
        srv.stop()
    assert out_ids(w.b, b3["id"]) == w.ids["ref3"]


def _rewrite(src, dst, edit):
    """A copy of the bundle with its members passed through `edit(name, data)` -> list of
    (TarInfo, data)."""
    with tarfile.open(src) as t, tarfile.open(dst, "w", format=tarfile.USTAR_FORMAT) as o:
        for m in t.getmembers():
            for info, data in edit(m, t.extractfile(m).read()):
                o.addfile(info, io.BytesIO(data) if data is not None else None)


def _bad_bundles(w):
    key = read_transfer_key(w.a.dir / TRANSFER_KEY)
    raw = w.bundle.read_bytes()
    bad = {}
    flipped = bytearray(raw)
    with tarfile.open(w.bundle) as t:
        page = next(m for m in t.getmembers() if m.name.startswith("pages/"))
    flipped[page.offset_data + 100] ^= 0x01
    bad["flipped"] = (bytes(flipped), page.name)
    bad["truncated"] = (raw[:len(raw) * 2 // 3], "truncated")

    def entry(name, kind=tarfile.REGTYPE):
        def edit(m, data):
            yield m, data
            if m.name == "bundle.json":
                info = tarfile.TarInfo(name)
                info.type = kind
                if kind == tarfile.SYMTYPE:
                    info.linkname = "/etc/passwd"
                    yield info, None
                else:
                    info.size = 4
                    yield info, b"evil"
        return edit

    for label, name, kind in (("dotdot", "pages/../../escape", tarfile.REGTYPE),
                              ("absolute", "/tmp/escape", tarfile.REGTYPE),
                              ("symlink", "responses.json", tarfile.SYMTYPE)):
        p = w.root / f"{label}.bundle"
        _rewrite(w.bundle, p, entry(name, kind))
        bad[label] = (p.read_bytes(), name if label != "symlink" else "not a regular file")
    # a correctly signed bundle whose runtime differs: another KV capacity
    with tarfile.open(w.bundle) as t:
        members = {m.name: t.extractfile(m).read() for m in t.getmembers()}
    head = json.loads(members.pop("bundle.json"))
    members.pop("bundle.mac")
    fp = dict(head["fingerprint"], kv_capacity_tokens=head["fingerprint"]["kv_capacity_tokens"]
              + 64)
    from server.checkpoints.fingerprint import fingerprint_digest
    head.update(fingerprint=fp, fingerprint_sha256=fingerprint_digest(fp))
    p = w.root / "other-runtime.bundle"
    write_bundle(p, key, {k: v for k, v in head.items() if k not in ("entries",)},
                 list(members.items()))
    bad["fingerprint"] = (p.read_bytes(), "kv_capacity_tokens")
    return bad


def test_t3_bad_bundles_are_refused_before_any_write(world):
    w = world
    before = tree(w.b.dir)
    for label, (data, named) in _bad_bundles(w).items():
        p = w.root / f"bad-{label}.bundle"
        p.write_bytes(data)
        msg = ninfer("checkpoints", "import", p, "--state-dir", w.b.dir, ok=False)
        assert str(p) in msg and named in msg, (label, msg)
        assert tree(w.b.dir) == before, label
    assert not list((w.b.dir / "checkpoints" / "sessions").rglob(".staging-*"))


def test_t4_stopped_import_transcript_restore_then_backup_and_recovery(world):
    w = world
    got = ninfer("checkpoints", "import", w.bundle, "--state-dir", w.c.dir)
    assert got["server"] == "stopped" and got["fingerprint_checked"] == "code_only"
    w.c.srv = srv = start(w.c)
    try:
        r1, r2 = w.r["r1"], w.r["r2"]
        transcript = ([{"role": "user", "content": big_prompt(1)}] + r1["output"]
                      + [{"role": "user", "content": TURNS[2]}] + r2["output"]
                      + [{"role": "user", "content": TURNS[3]}])
        c3 = ask(srv, "alice", transcript)
        rec = done_record(w.c, c3["id"])
        assert (rec["path"], rec["checkpoint"]) == ("disk-restored", "restored")
        assert rec["cached_tokens"] == fed(r2)
        assert all(x["status"] in ("saved", "already_saved") for x in save_now(srv, "alice"))
        bk = ninfer("backup", "--state-dir", w.c.dir, "--out", w.root / "c-backup")
        assert bk["generations"] >= 1 and not bk["skipped"]
    finally:
        srv.stop()
    assert out_ids(w.c, c3["id"]) == w.ids["ref3"]
    shutil.rmtree(w.c.dir)  # the whole state dir is lost
    w.c.dir.mkdir(mode=0o700)
    (w.c.dir / "models").symlink_to(w.root / "models")
    got = ninfer("restore", "--state-dir", w.c.dir, w.root / "c-backup")
    assert got["responses_db"] == "restored" and got["generations"] >= 1
    a4 = ask(w.a.srv, "alice", TURNS[4], prev=w.r["r3"])  # the reference, on A
    w.c.srv = srv = start(w.c)
    w.c.srv = srv
    try:
        c4 = ask(srv, "alice", TURNS[4], prev=c3)
        rec = done_record(w.c, c4["id"])
        assert (rec["path"], rec["checkpoint"]) == ("disk-restored", "restored")
        assert rec["cached_tokens"] == fed(c3)
    finally:
        srv.stop()
        w.a.srv.proc.send_signal(signal.SIGTERM)
        w.a.srv.proc.wait(timeout=60)
    assert out_ids(w.c, c4["id"]) == out_ids(w.a, a4["id"])
