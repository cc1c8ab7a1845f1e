"""The managed lane lifecycle (`./ninfer lane`, lanes/lifecycle.py) with real processes on the
CPU lane: every lane command runs as `python -m server.cli lane ...`, and `start` runs the
installed instance's own code with this interpreter (`--python`).

- pack: byte-reproducible ids, read-only files, only the product.
- install/start/upgrade/rollback with a server running: a chain of responses survives every
  step; the session restores from its checkpoint while the fingerprint is unchanged
  (`disk-restored`), recomputes with the reason logged after an upgrade that changes it, and
  restores the earlier checkpoint again after the rollback.
- an install SIGKILLed right after each journal step, then repaired: `current` names a
  complete, verified instance before and after, and nothing half-written is left.
- the store schema: an upgrade the previous instance could not read needs
  --allow-no-rollback; a migrated store refuses the rollback.
- bad input: exit 78 or 1, a clear message, nothing half-written visible.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from lanes.instance import MANIFEST, Source, verify
from lanes.txn import INSTALL_STEPS
from tests.lane_runs import (PROMPT, PY, REPO, ask, chain_intact, fed, last_restore, lane, ok,
                             saved_up_to, serving, start_through_the_script, status, turn,
                             wait_gone)

PRODUCT_TOP = {"engine", "server", "lanes", "release", "sbom", "ninfer", "requirements.lock",
               "requirements-dev.lock", "requirements-gpu.lock", MANIFEST}


def tree_copy(dst: Path, path: str, edit) -> Path:
    """A copy of this tree's product files with `path`'s text replaced by `edit(text)`."""
    dst.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("engine", "server", "lanes", "release", "sbom"):
        shutil.copytree(REPO / name, dst / name, ignore=skip)
    for name in ["ninfer"] + [p.name for p in REPO.glob("requirements*.lock")]:
        shutil.copy2(REPO / name, dst / name)
    old = (dst / path).read_text()
    assert edit(old) != old
    (dst / path).write_text(edit(old))
    return dst


def pack(tree: Path, out: Path) -> SimpleNamespace:
    iid, path = ok("pack", "--out", out, cwd=tree).stdout.split()
    return SimpleNamespace(id=iid, path=Path(path))


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """A: this tree; B: a server/ comment changed (same checkpoint fingerprint); C: the cpu
    profile's max_queue changed (another fingerprint); D: one store schema version more."""
    d = tmp_path_factory.mktemp("packs")
    out = d / "out"
    edits = {"B": ("server/errors.py", lambda t: t + "\n# lane test: instance B\n"),
             "C": ("lanes/profiles/cpu.toml", lambda t: t.replace("max_queue = 16",
                                                                  "max_queue = 15")),
             "D": ("server/response_store_schema.py", lambda t: t.replace(
                 "\nSCHEMA_VERSION = MIGRATIONS[-1][0]",
                 "\nMIGRATIONS = MIGRATIONS + ((MIGRATIONS[-1][0] + 1, "
                 "('CREATE TABLE lane_test (x INTEGER)',)),)"
                 "\nSCHEMA_VERSION = MIGRATIONS[-1][0]"))}
    got = {"A": pack(REPO, out), "A2": pack(REPO, out)}
    for name, (path, edit) in edits.items():
        got[name] = pack(tree_copy(d / name, path, edit), out)
    return SimpleNamespace(**got)


def manifest(p) -> dict:
    return json.loads((p.path / MANIFEST).read_bytes())


# ---- pack ------------------------------------------------------------------------------------

def test_pack_is_reproducible_read_only_and_holds_only_the_product(packs):
    import hashlib

    from lanes.profile import load_profile
    from server.response_store_schema import SCHEMA_VERSION

    a = packs.A
    assert packs.A2.id == a.id and a.path.name == a.id
    blob = (a.path / MANIFEST).read_bytes()
    assert hashlib.sha256(blob).hexdigest() == a.id
    m = manifest(a)
    assert m["store_schema_version"] == SCHEMA_VERSION
    assert m["profiles"]["cpu"] == load_profile("cpu").canonical_hash()
    assert {p.name for p in a.path.iterdir()} <= PRODUCT_TOP
    assert {"engine", "server", "lanes", "ninfer"} <= {p.name for p in a.path.iterdir()}
    for f in m["files"]:
        assert not f["path"].startswith(("tests/", "bench/", "docs/", ".venv"))
        assert "__pycache__" not in f["path"] and not f["path"].endswith(".pyc")
        mode = (a.path / f["path"]).stat().st_mode & 0o777
        assert f"{mode:04o}" == f["mode"] == ("0555" if f["path"] == "ninfer" else "0444")
    assert all(p.stat().st_mode & 0o777 == 0o555 for p in a.path.rglob("*") if p.is_dir())
    assert not verify(a.path, Source.from_instance(a.path))
    # one product file changed: another id, the manifest differs in that file only
    for name, path in (("B", "server/errors.py"), ("C", "lanes/profiles/cpu.toml"),
                       ("D", "server/response_store_schema.py")):
        theirs = {f["path"]: f for f in manifest(getattr(packs, name))["files"]}
        ours = {f["path"]: f for f in m["files"]}
        diff = {p for p in theirs.keys() | ours.keys() if theirs.get(p) != ours.get(p)}
        assert diff == {path}, name
    assert len({packs.A.id, packs.B.id, packs.C.id, packs.D.id}) == 4
    assert manifest(packs.C)["profiles"]["cpu"] != m["profiles"]["cpu"]
    assert manifest(packs.D)["store_schema_version"] == SCHEMA_VERSION + 1


def test_the_store_schema_is_not_backward_readable(tmp_path):
    """What lanes/schema.py's `opens_up_to` assumes, pinned against server/response_store_schema.py: a
    store migrated by a newer SCHEMA_VERSION is refused by this one, whatever it added."""
    from lanes.schema import opens_up_to, store_version
    from server.response_store_schema import MIGRATIONS, SCHEMA_VERSION, StoreError, connect

    db = tmp_path / "responses.db"
    connect(db).close()
    assert store_version(db) == SCHEMA_VERSION
    connect(db, MIGRATIONS + ((SCHEMA_VERSION + 1, ("CREATE TABLE x (a INTEGER)",)),)).close()
    with pytest.raises(StoreError, match="newer than this server"):
        connect(db)
    assert opens_up_to({"store_schema_version": SCHEMA_VERSION}) == SCHEMA_VERSION


# ---- the lifecycle with a server -------------------------------------------------------------

def test_upgrade_and_rollback_keep_chains_and_restore_sessions(packs, tmp_path,
                                                               embedded_models_dir):
    root = tmp_path / "root"
    out = ok("install", "--root", root, "--from", packs.A.path)
    assert "verified with systemd-analyze" in out.stdout
    unit = (root / "systemd" / "ninfer-cpu.service").read_text()
    assert f'ExecStart="{root}/current/ninfer" serve --lane cpu --state-dir "{root}/state"' \
        in unit
    assert "ExecStop=-" in unit and " ctl stop " in unit and "Restart=on-failure" in unit
    (root / "state" / "models").symlink_to(embedded_models_dir)
    ok("start", "--root", root, "--python", PY, "--port", "0")
    serving(root, packs.A.id, None)
    r1 = ask(root, PROMPT)
    r2, how = turn(root, "Which entry matters most?", r1)
    assert how == ("continuation", None, fed(r1))

    # B: a server/ file changed; the checkpoint fingerprint is the same: restored from disk
    ok("install", "--root", root, "--from", packs.B.path)
    serving(root, packs.B.id, packs.A.id)
    r3, how = turn(root, "Why?", r2)
    assert how == ("disk-restored", "restored", fed(r2))
    chain_intact(root, [r1, r2, r3])

    # C: the lane profile changed, so does the fingerprint: recomputed, the reason logged
    ok("install", "--root", root, "--from", packs.C.path)
    serving(root, packs.C.id, packs.B.id)
    r4, how = turn(root, "And then?", r3)
    assert how == ("root", "fingerprint_mismatch", 0)
    restore = last_restore(root)
    assert (restore["state"], restore["reason"]) == ("incompatible", "fingerprint_mismatch")
    assert "profile_sha256" in restore["differs"]
    chain_intact(root, [r1, r2, r3, r4])

    # rollback to B: B's checkpoints (written before C) restore again
    assert "restarted the server" in ok("rollback", "--root", root).stdout
    serving(root, packs.B.id, packs.C.id)
    r5, how = turn(root, "Summarize.", r4)
    assert how == ("disk-restored", "restored", fed(r3))
    chain_intact(root, [r1, r2, r3, r4, r5])

    out = ok("stop", "--root", root)
    assert "stopped pid" in out.stdout and "refused 0" in out.stdout
    assert status(root)["server"] is None
    assert not ok("stop", "--root", root).stderr  # not running: nothing to do


@pytest.mark.slow
def test_an_install_killed_beside_a_running_server_and_a_server_crash(packs, tmp_path,
                                                                      embedded_models_dir):
    root = tmp_path / "root"
    ok("install", "--root", root, "--from", packs.A.path)
    (root / "state" / "models").symlink_to(embedded_models_dir)
    ok("start", "--root", root, "--python", PY, "--port", "0")
    r1 = ask(root, PROMPT)
    r2 = ask(root, "Which entry matters most?", prev=r1)
    # killed before it stopped the server: the repair finishes the install, A still serves
    r = lane("install", "--root", root, "--from", packs.B.path, "--test-kill-after", "unit")
    assert r.returncode == -signal.SIGKILL
    st = status(root)
    assert "finished the install" in st["repaired"][0]
    assert (st["current"], st["server"]["instance"], st["server"]["is_current"]) == (
        packs.B.id, packs.A.id, False)
    ok("stop", "--root", root)
    if not start_through_the_script(root):
        ok("start", "--root", root, "--python", PY, "--port", "0")
    serving(root, packs.B.id, packs.A.id)
    r3, how = turn(root, "Why?", r2)
    assert how == ("disk-restored", "restored", fed(r2))
    # a crash: the stale pid record is noticed, the chain continues from the autosave
    saved_up_to(root, fed(r3))
    pid = status(root)["server"]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    ok("start", "--root", root, "--python", PY, "--port", "0")
    r4, how = turn(root, "Go on.", r3)
    assert how == ("disk-restored", "restored", fed(r3))
    chain_intact(root, [r1, r2, r3, r4])
    ok("stop", "--root", root)


# ---- an interrupted install, repaired ------------------------------------------------------

def pointers(root) -> tuple:
    return tuple(os.readlink(root / n).split("/")[-1] if os.path.lexists(root / n) else None
                 for n in ("current", "previous"))


def assert_current_is_complete(root) -> None:
    cur = root / "current"
    assert not verify(cur.resolve(), Source.from_instance(cur.resolve()))


def test_an_install_killed_after_each_journal_step_is_repaired(packs, tmp_path):
    from lanes.lifecycle import main

    base = tmp_path / "base"
    ok("install", "--root", base, "--from", packs.A.path)
    for step in INSTALL_STEPS:
        root = tmp_path / f"r-{step}"
        shutil.copytree(base, root, symlinks=True)
        r = lane("install", "--root", root, "--from", packs.B.path, "--test-kill-after", step)
        assert r.returncode == -signal.SIGKILL, (step, r.stderr)
        assert pointers(root)[0] in (packs.A.id, packs.B.id)
        assert_current_is_complete(root)  # before the repair too
        journal = (root / "journal.jsonl").read_text().splitlines()
        assert json.loads(journal[-1])["step"] == ("begin" if step == "copying" else step)
        assert main(["repair", "--root", str(root)]) == 0
        forward = INSTALL_STEPS.index(step) >= INSTALL_STEPS.index("renamed")
        want = (packs.B.id, packs.A.id) if forward else (packs.A.id, None)
        assert pointers(root) == want, step
        assert_current_is_complete(root)
        last = json.loads((root / "journal.jsonl").read_text().splitlines()[-1])
        assert (last["step"], last.get("repaired")) == ("done" if forward else "aborted", True)
        assert sorted(p.name for p in (root / "instances").iterdir()) == sorted(
            {packs.A.id, packs.B.id} if forward else {packs.A.id})
        assert not list(root.glob(".tmp-*"))
    # a rollback killed after its first step: the next command (status) finishes it
    root = tmp_path / "r-renamed"
    r = lane("rollback", "--root", root, "--test-kill-after", "begin")
    assert r.returncode == -signal.SIGKILL
    st = status(root)
    assert (st["current"], st["previous"]) == (packs.A.id, packs.B.id)
    assert "finished the rollback" in st["repaired"][0]


# ---- the store schema ------------------------------------------------------------------------

def test_a_schema_upgrade_needs_allow_no_rollback_and_then_blocks_rollback(packs, tmp_path):
    from server.response_store_schema import MIGRATIONS, SCHEMA_VERSION, connect

    root = tmp_path / "root"
    ok("install", "--root", root, "--from", packs.A.path)
    db = root / "state" / "responses.db"
    connect(db).close()  # as A's server leaves it
    r = lane("install", "--root", root, "--from", packs.D.path)
    assert r.returncode == 78 and "--allow-no-rollback" in r.stderr, r.stderr
    assert f"schema version {SCHEMA_VERSION + 1}" in r.stderr
    assert pointers(root) == (packs.A.id, None)
    assert sorted(p.name for p in (root / "instances").iterdir()) == [packs.A.id]
    out = ok("install", "--root", root, "--from", packs.D.path, "--allow-no-rollback")
    assert "no rollback past this upgrade" in out.stdout
    # D's server migrates the store when it starts
    connect(db, MIGRATIONS + ((SCHEMA_VERSION + 1, ("CREATE TABLE lane_test (x INTEGER)",)),)
            ).close()
    r = lane("rollback", "--root", root)
    assert r.returncode == 78 and "rollback refused" in r.stderr, r.stderr
    assert pointers(root) == (packs.D.id, packs.A.id)
    r = lane("install", "--root", root, "--from", packs.A.path)  # nor by installing A again
    assert r.returncode == 78 and "would refuse to start" in r.stderr, r.stderr


# ---- bad input -------------------------------------------------------------------------------

def test_bad_input_is_refused_with_nothing_half_written(packs, tmp_path):
    root = tmp_path / "root"
    r = lane("install", "--root", root, "--from", packs.A.path, "--lane", "nosuch")
    assert r.returncode == 78 and "unknown lane 'nosuch'" in r.stderr and not root.exists()
    for cmd in ("start", "stop", "status", "rollback", "repair"):
        r = lane(cmd, "--root", tmp_path / "missing")
        assert r.returncode == 78 and "does not exist" in r.stderr, (cmd, r.stderr)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    r = lane("install", "--root", tmp_path / "full", "--from", packs.A.path)
    assert r.returncode == 78 and "is not a lane root" in r.stderr
    r = lane("install", "--root", root, "--from", tmp_path / "full")
    assert r.returncode == 78 and "not a packed instance" in r.stderr and not root.exists()
    assert lane("install", "--root", root, "--bogus").returncode == 78

    # a tampered pack: refused while verifying the copy, which is removed
    bad = tmp_path / "tampered" / packs.A.id
    shutil.copytree(packs.A.path, bad)
    victim = bad / "server" / "errors.py"
    victim.parent.chmod(0o755)
    victim.chmod(0o644)
    victim.write_text(victim.read_text() + "# tampered\n")
    victim.chmod(0o444)
    r = lane("install", "--root", root, "--from", bad)
    assert r.returncode == 1 and "server/errors.py: content differs" in r.stderr, r.stderr
    assert pointers(root) == (None, None) and not list((root / "instances").iterdir())
    assert json.loads((root / "journal.jsonl").read_text().splitlines()[-1])["step"] == "aborted"

    # a tampered installed instance: start refuses it, status and repair say so
    ok("install", "--root", root, "--from", packs.A.path)
    inst = root / "instances" / packs.A.id / "lanes" / "profile.py"
    inst.parent.chmod(0o755)
    inst.chmod(0o644)
    inst.write_text(inst.read_text().replace("canonical", "canonicaI", 1))
    inst.chmod(0o444)
    r = lane("start", "--root", root, "--python", PY)
    assert r.returncode == 1 and "lanes/profile.py: content differs" in r.stderr, r.stderr
    assert not (root / "run" / "server.json").exists()
    assert lane("status", "--root", root).returncode == 1
    assert lane("repair", "--root", root).returncode == 1



def test_the_unit_says_when_it_was_not_verified_and_enable_reports_systemctl(tmp_path,
                                                                             monkeypatch):
    from lanes import unit

    root = SimpleNamespace(path=tmp_path, state=tmp_path / "state", systemd=tmp_path)
    path, note = unit.write(root, "cpu", tmp_path / "instance", which=lambda name: None)
    assert note == "not verified: systemd-analyze is not on this machine's PATH"
    assert f'ExecStart="{tmp_path}/current/ninfer" serve --lane cpu' in path.read_text()
    monkeypatch.setattr(unit, "USER_UNIT_DIR", tmp_path / "user")
    calls = []

    def run(cmd, **kw):
        calls.append(cmd[2:])
        return SimpleNamespace(returncode=int("enable" in cmd), stdout="", stderr="no bus")

    warnings = unit.enable(path, run=run, which=lambda name: "/bin/systemctl")
    assert (tmp_path / "user" / path.name).read_text() == path.read_text()
    assert calls == [["daemon-reload"], ["enable", path.name]]
    assert warnings == ["`systemctl --user enable ninfer-cpu.service` failed: no bus"]
    assert "not on PATH" in unit.enable(path, which=lambda name: None)[0]
