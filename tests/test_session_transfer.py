"""Sessions leave the machine, through real server processes on loopback (three starts):

  T1  server A builds alice's and bob's sessions, exports both while serving, then (never
      stopped) continues each by two turns: the references
  T2  server B (another state dir, its own secrets, the same transfer key) gets bob's bundle
      while stopped and alice's while running (control socket); alice's `previous_response_id`
      and bob's resent transcript with the same prompt_cache_key restore from the imported
      checkpoints and continue token-identically; another principal's bundle and a wrong
      transfer key are refused; B is backed up while it serves
  T3  with B stopped, every bad bundle is refused before any write, naming the file and entry
  T4  B's whole state dir is removed, restored from the backup, and both sessions continue
      token-identically from their checkpoints
"""
from __future__ import annotations

import io
import json
import os
import shutil
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
    w.a, w.b = (state_dir(root, n, str(lane), keys) for n in "ab")
    w.bundle = {who: root / f"{who}.bundle" for who in ("alice", "bob")}
    yield w
    for d in (w.a, w.b):  # a test that failed midway leaves its server running
        if getattr(d, "srv", None) is not None:
            d.srv.stop()


SHORT = 24  # lines of the review prompt: ~370 tokens, six pages
N = 32  # greedy tokens a turn


def prompt(seed):
    return "\n".join(big_prompt(seed).splitlines()[:SHORT])


def test_t1_export_while_serving_and_the_references(world):
    w = world
    key = ninfer("checkpoints", "transfer-key", "--state-dir", w.a.dir).strip()
    assert key == str(w.a.dir / TRANSFER_KEY) and os.stat(key).st_mode & 0o777 == 0o600
    (w.b.dir / "secrets").mkdir(mode=0o700)  # the owner gives the key to the other server
    shutil.copy2(key, w.b.dir / TRANSFER_KEY)
    w.a.srv = srv = start(w.a)
    try:
        for who, seed in (("alice", 1), ("bob", 2)):
            r1 = ask(srv, who, prompt(seed), n=8)
            r2 = ask(srv, who, TURNS[2], prev=r1, n=N)
            assert all(x["status"] in ("saved", "already_saved") for x in save_now(srv, who))
            out = ninfer("checkpoints", "export", "--state-dir", w.a.dir, "--session", SESSION,
                         "--principal", who, "--out", w.bundle[who])
            assert out["frontier_tokens"] == fed(r2) and out["responses"] == 2
            st = w.bundle[who].stat()
            assert st.st_mode & 0o777 == 0o600 and out["bytes"] == st.st_size
            r3 = ask(srv, who, TURNS[3], prev=r2, n=N)
            r4 = ask(srv, who, TURNS[4], prev=r3, n=N)
            w.r[who] = [r1, r2, r3, r4]
    finally:
        srv.stop()
    with tarfile.open(w.bundle["alice"]) as t:
        names = t.getnames()
    assert names[0] == "bundle.json" and names[-1] == "bundle.mac"
    assert "responses.json" in names and any(n.startswith("pages/") for n in names)
    for who in ("alice", "bob"):
        w.ids[who] = [out_ids(w.a, r["id"]) for r in w.r[who][2:]]
        assert all(len(ids) == N and len(set(ids)) >= 8 for ids in w.ids[who])
    assert w.ids["alice"][0] != w.ids["bob"][0]  # negative control: another history


def transcript(rs, turn):
    """The conversation of responses `rs` resent as input items, plus a new user turn."""
    items = []
    for i, r in enumerate(rs):
        items.append({"role": "user", "content": prompt(2) if i == 0 else TURNS[i + 1]})
        items += r["output"]
    return items + [{"role": "user", "content": turn}]


def warm_caches(w):
    """B starts with A's compiled executables and artifact stamps (caches keyed by the code
    and the artifact, never session state: the checkpoint secret stays B's own), so that a
    start loads its forwards instead of compiling them."""
    for name in ("executables", "verified"):
        if (w.a.dir / name).is_dir() and not (w.b.dir / name).exists():
            shutil.copytree(w.a.dir / name, w.b.dir / name)
    for name in ("executable.key", "artifact-stamp.key"):
        if not (w.b.dir / "secrets" / name).exists():
            shutil.copy2(w.a.dir / "secrets" / name, w.b.dir / "secrets" / name)


def restored(w, r, cached):
    rec = done_record(w, r["id"])
    assert (rec["path"], rec["checkpoint"]) == ("disk-restored", "restored"), rec
    assert r["usage"]["input_tokens_details"]["cached_tokens"] == cached
    assert rec["computed_tokens"] == r["usage"]["input_tokens"] - cached


def test_t2_stopped_and_running_imports_continue_exactly(world):
    w = world
    got = ninfer("checkpoints", "import", w.bundle["bob"], "--state-dir", w.b.dir)
    assert got["server"] == "stopped" and got["fingerprint_checked"] == "code_only"
    warm_caches(w)
    w.b.srv = srv = start(w.b)
    try:
        bad_key = w.root / "wrong.key"
        ninfer("checkpoints", "transfer-key", "--out", bad_key)
        msg = ninfer("checkpoints", "import", w.bundle["alice"], "--state-dir", w.b.dir,
                     "--transfer-key", bad_key, ok=False)
        assert "bundle.mac does not verify" in msg and str(w.bundle["alice"]) in msg
        msg = ninfer("checkpoints", "import", w.bundle["alice"], "--state-dir", w.b.dir,
                     "--principal", "bob", ok=False)
        assert "another principal" in msg
        before = tree(w.b.dir)
        got = ninfer("checkpoints", "import", w.bundle["alice"], "--state-dir", w.b.dir,
                     "--principal", "alice")
        assert got["server"] == "running" and got["responses"] == 2
        assert tree(w.b.dir)[1] == before[1] + 2
        a1, a2 = w.r["alice"][:2]
        b3 = ask(srv, "alice", TURNS[3], prev=a2, n=N)
        restored(w.b, b3, fed(a2))
        o1, o2 = w.r["bob"][:2]
        c3 = ask(srv, "bob", transcript([o1, o2], TURNS[3]), n=N)
        restored(w.b, c3, fed(o2))
        for who in ("alice", "bob"):
            assert all(x["status"] in ("saved", "already_saved") for x in save_now(srv, who))
        bk = ninfer("backup", "--state-dir", w.b.dir, "--out", w.root / "b-backup")
        assert bk["generations"] >= 2 and not bk["skipped"]
    finally:
        srv.stop()
    assert out_ids(w.b, b3["id"]) == w.ids["alice"][0]
    assert out_ids(w.b, c3["id"]) == w.ids["bob"][0]
    w.r["b3"], w.r["c3"] = b3, c3


def _rewrite(src, dst, edit):
    """A copy of the bundle with its members passed through `edit(name, data)` -> list of
    (TarInfo, data)."""
    with tarfile.open(src) as t, tarfile.open(dst, "w", format=tarfile.USTAR_FORMAT) as o:
        for m in t.getmembers():
            for info, data in edit(m, t.extractfile(m).read()):
                o.addfile(info, io.BytesIO(data) if data is not None else None)


def _bad_bundles(w):
    key = read_transfer_key(w.a.dir / TRANSFER_KEY)
    raw = w.bundle['alice'].read_bytes()
    bad = {}
    flipped = bytearray(raw)
    with tarfile.open(w.bundle['alice']) as t:
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
        _rewrite(w.bundle['alice'], p, entry(name, kind))
        bad[label] = (p.read_bytes(), name if label != "symlink" else "not a regular file")
    # a correctly signed bundle whose runtime differs: another KV capacity
    with tarfile.open(w.bundle['alice']) as t:
        members = {m.name: t.extractfile(m).read() for m in t.getmembers()}
    orig = members["bundle.json"]
    head = json.loads(members.pop("bundle.json"))
    members.pop("bundle.mac")
    fp = dict(head["fingerprint"], kv_capacity_tokens=head["fingerprint"]["kv_capacity_tokens"]
              + 64)
    from server.checkpoints.fingerprint import fingerprint_digest
    head.update(fingerprint=fp, fingerprint_sha256=fingerprint_digest(fp))
    p = w.root / "other-runtime.bundle"
    write_bundle(p, key, {k: v for k, v in head.items() if k not in ("entries",)},
                 [(n, d, None) for n, d in members.items()])
    bad["fingerprint"] = (p.read_bytes(), "kv_capacity_tokens")
    # a correctly signed bundle whose first page entry holds another page's bytes: the header
    # lists their true sha256, so only the entry's name (the digest the checkpoint names) lies
    head = json.loads(orig)
    first, second = head["checkpoint"]["pages"][:2]
    swapped = dict(members, **{f"pages/{first}": members[f"pages/{second}"]})
    p = w.root / "misnamed-page.bundle"
    write_bundle(p, key, {k: v for k, v in head.items() if k not in ("entries",)},
                 [(n, d, None) for n, d in swapped.items()])
    bad["misnamed page"] = (p.read_bytes(), f"pages/{first[:16]}")
    return bad


def test_t3_bad_bundles_are_refused_before_any_write(world, capsys):
    from server.cli import main

    w = world
    before = tree(w.b.dir)
    for label, (data, named) in _bad_bundles(w).items():
        p = w.root / f"bad-{label}.bundle"
        p.write_bytes(data)
        capsys.readouterr()
        assert main(["checkpoints", "import", str(p), "--state-dir", str(w.b.dir)]) == 1
        msg = capsys.readouterr().err
        assert str(p) in msg and named in msg, (label, msg)
        assert tree(w.b.dir) == before, label
    assert not list((w.b.dir / "checkpoints" / "sessions").rglob(".staging-*"))


def test_t4_recovery_after_the_state_dir_is_lost(world):
    w = world
    shutil.rmtree(w.b.dir)
    w.b.dir.mkdir(mode=0o700)
    (w.b.dir / "models").symlink_to(w.root / "models")
    bad = w.root / "b-backup-flipped"  # a damaged backup is refused before any write
    shutil.copytree(w.root / "b-backup", bad)
    page = next((bad / "checkpoints" / "pages").rglob("*/*"))
    data = bytearray(page.read_bytes())
    data[7] ^= 0x10
    page.write_bytes(bytes(data))
    msg = ninfer("restore", "--state-dir", w.b.dir, bad, ok=False)
    assert str(page) in msg and sorted(os.listdir(w.b.dir)) == ["models"]
    got = ninfer("restore", "--state-dir", w.b.dir, w.root / "b-backup")
    assert got["responses_db"] == "restored" and got["generations"] >= 2
    assert (w.b.dir / "checkpoints" / "secret").read_bytes() != (
        w.a.dir / "checkpoints" / "secret").read_bytes()
    warm_caches(w)
    w.b.srv = srv = start(w.b)
    try:
        b4 = ask(srv, "alice", TURNS[4], prev=w.r["b3"], n=N)
        restored(w.b, b4, fed(w.r["b3"]))
        c4 = ask(srv, "bob", TURNS[4], prev=w.r["c3"], n=N)
        restored(w.b, c4, fed(w.r["c3"]))
    finally:
        srv.stop()
    assert out_ids(w.b, b4["id"]) == w.ids["alice"][1]
    assert out_ids(w.b, c4["id"]) == w.ids["bob"][1]
