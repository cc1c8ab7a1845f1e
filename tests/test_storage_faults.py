"""Storage faults against the real server, on real filesystems and real files: a full disk under
the response database and the checkpoints (a small tmpfs that fills up), a purge whose
checkpoint files cannot be deleted, a flipped payload byte and a smashed B-tree page in
`responses.db`; and the per-principal views of `/metrics` and `/v1/ninfer/status`."""
from __future__ import annotations

import shutil
import signal
import sqlite3
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.checkpoints.tags import session_namespace
from tests.faultfs import filled, flip_text, smash_table_root, tmpfs_prefix, undeletable, view
from tests.serverproc import start_server

SECRET = "zebra-quokka-7731"  # prompt text that must never reach stderr
KEYS = {"alice": "nk-alice-0123456789abcdef", "bob": "nk-bob-0123456789abcdef",
        "ops": "nk-ops-0123456789abcdef"}


def scrape(srv, key: str) -> dict:
    r = httpx.get(srv.base_url + "/metrics", headers={"Authorization": f"Bearer {key}"},
                  timeout=30)
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(r.text) for s in f.samples}


def create(srv, key: str, **body):
    return httpx.post(srv.api_url + "/responses", headers={"Authorization": f"Bearer {key}"},
                      json={"model": "tiny", "max_output_tokens": 4, **body}, timeout=300)


def stderr_of(srv) -> str:
    return "".join(srv.log)


# ---- a full disk ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_disk(tmp_path_factory, embedded_models_dir):
    d = tmp_path_factory.mktemp("fullfs")
    state, keys = d / "state", d / "keys"
    state.mkdir(mode=0o700)
    keys.write_text(f"default {KEYS['alice']}\n")
    keys.chmod(0o600)
    srv = start_server(state, "--key-file", str(keys), "--checkpoint-autosave", "off",
                       wrap=tmpfs_prefix(state, "16m", embedded_models_dir),
                       env={"NINFER_EXEC_STORE": "off"})
    yield SimpleNamespace(srv=srv, state=view(srv.proc.pid, state))
    srv.stop()


def test_a_full_database_disk_fails_the_stream_and_the_request_and_stores_nothing(small_disk,
                                                                                 tmp_path):
    srv, state = small_disk.srv, small_disk.state
    parent = create(srv, srv.key, input="hello", prompt_cache_key="full")
    assert parent.status_code == 200, parent.text
    pid = parent.json()["id"]
    client = openai.OpenAI(base_url=srv.api_url, api_key=srv.key, max_retries=0)
    with filled(state):
        events = list(client.responses.create(model="tiny", input=SECRET, stream=True,
                                              max_output_tokens=4, previous_response_id=pid))
        assert events[0].type == "response.created"
        assert events[-1].type == "response.failed", [e.type for e in events]
        error = events[-1].response.error
        assert error.code == "storage_full" and "disk is full" in error.message
        streamed = events[0].response.id
        r = create(srv, srv.key, input=SECRET, previous_response_id=pid)
        assert r.status_code == 507, r.text
        assert r.json()["error"]["code"] == "storage_full"
        assert "not stored" in r.json()["error"]["message"]
    h = {"Authorization": f"Bearer {srv.key}"}
    assert httpx.get(f"{srv.api_url}/responses/{streamed}", headers=h).status_code == 404
    # the store is whole and serves again once there is room
    for name in ("responses.db", "responses.db-wal"):  # (SQLite resolves /proc/<pid>/root)
        shutil.copy(state / name, tmp_path / name)
    conn = sqlite3.connect(tmp_path / "responses.db")
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 1
    conn.close()
    after = create(srv, srv.key, input="again", previous_response_id=pid)
    assert after.status_code == 200, after.text
    assert httpx.get(f"{srv.api_url}/responses/{after.json()['id']}",
                     headers=h).status_code == 200
    m = scrape(srv, srv.key)
    assert m[("ninfer_storage_errors_total", (("kind", "full"), ("store", "responses")))] == 2
    log = stderr_of(srv)
    assert log.count("storage fault: responses: full") == 2
    assert SECRET not in log


def test_a_full_checkpoint_disk_refuses_the_save_and_reports_it(small_disk):
    srv, state = small_disk.srv, small_disk.state
    h = {"Authorization": f"Bearer {srv.key}"}
    r = create(srv, srv.key, input="to checkpoint", prompt_cache_key="ck-full")
    assert r.status_code == 200, r.text
    before = scrape(srv, srv.key)[("ninfer_storage_errors_total",
                                   (("kind", "full"), ("store", "checkpoints")))]
    with filled(state):
        saved = httpx.post(srv.api_url + "/ninfer/checkpoints", headers=h, timeout=120,
                           json={"prompt_cache_key": "ck-full"})
        assert saved.status_code == 200, saved.text
        assert [(s["status"], s.get("reason")) for s in saved.json()["data"]] == [
            ("refused", "enospc")]
    assert not list((state / "checkpoints" / "sessions").glob("*/.staging-*"))
    m = scrape(srv, srv.key)
    assert m[("ninfer_storage_errors_total",
              (("kind", "full"), ("store", "checkpoints")))] >= before + 1
    assert "storage fault: checkpoints: full" in stderr_of(srv)
    saved = httpx.post(srv.api_url + "/ninfer/checkpoints", headers=h, timeout=120,
                       json={"prompt_cache_key": "ck-full"})
    assert [s["status"] for s in saved.json()["data"]] == ["saved"]


# ---- three principals, one of them admin ------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory, embedded_models_dir):
    d = tmp_path_factory.mktemp("principals")
    (d / "models").symlink_to(embedded_models_dir)
    (d / "keys").write_text(f"alice {KEYS['alice']}\nbob {KEYS['bob']}\n"
                            f"ops {KEYS['ops']} admin\n")
    (d / "keys").chmod(0o600)
    w = SimpleNamespace(dir=d, srv=start_server(d, principal="alice"))
    yield w
    w.srv.stop()


def test_a_principal_sees_only_its_own_figures_and_an_admin_all(world):
    srv = world.srv
    assert create(srv, KEYS["alice"], input="alice was here").status_code == 200
    alice, bob, ops = (scrape(srv, KEYS[p]) for p in ("alice", "bob", "ops"))

    def served(m):  # requests that generated (a 4-token answer ends incomplete)
        return sum(v for (name, labels), v in m.items() if name == "ninfer_requests_total"
                   and dict(labels)["outcome"] in ("completed", "incomplete"))

    assert served(alice) >= 1 and served(bob) == 0 and served(ops) >= served(alice)
    for own in (alice, bob):  # no pools, checkpoints or faults: others' activity shows there
        assert not [k for k in own if k[0].startswith(("ninfer_kv_", "ninfer_checkpoint",
                                                       "ninfer_storage", "ninfer_state"))]
    assert ("ninfer_kv_used_bytes", ()) in ops
    assert ("ninfer_storage_errors_total", (("kind", "io"), ("store", "responses"))) in ops

    def status(who):
        r = httpx.get(srv.api_url + "/ninfer/status", timeout=30,
                      headers={"Authorization": f"Bearer {KEYS[who]}"})
        assert r.status_code == 200, r.text
        return r.json()

    a, b, o = status("alice"), status("bob"), status("ops")
    assert "memory" not in a and "memory" not in b and "memory" in o
    assert a["principal"]["requests"]["incomplete"] >= 1
    assert b["principal"] == {"name": "bob", "sees_all": False, "in_flight": 0,
                              "requests": {**b["principal"]["requests"], "incomplete": 0}}
    assert o["principal"]["sees_all"] is True


def test_a_purge_the_checkpoint_disk_interrupts_completes_on_retry(world):
    srv, key = world.srv, KEYS["alice"]
    h = {"Authorization": f"Bearer {key}"}
    r = create(srv, key, input="purge me", prompt_cache_key="purge-fault")
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    saved = httpx.post(srv.api_url + "/ninfer/checkpoints", headers=h, timeout=120,
                       json={"prompt_cache_key": "purge-fault"})
    assert [s["status"] for s in saved.json()["data"]] in (["saved"], ["already_saved"])
    sdir = world.dir / "checkpoints" / "sessions" / session_namespace("alice", "purge-fault")
    current = sdir / "current"
    assert current.exists()
    with undeletable(current):
        first = httpx.delete(srv.api_url + "/ninfer/sessions/purge-fault", headers=h)
        assert first.status_code == 500, first.text
        assert first.json()["error"]["code"] == "storage_io_error"
        assert "retry" in first.json()["error"]["message"]
        # the session still exists: its responses were kept for the retry
        assert httpx.get(f"{srv.api_url}/responses/{rid}", headers=h).status_code == 200
    again = httpx.delete(srv.api_url + "/ninfer/sessions/purge-fault", headers=h)
    assert again.status_code == 200, again.text
    assert again.json()["responses"] == 1
    assert not sdir.exists()
    assert httpx.get(f"{srv.api_url}/responses/{rid}", headers=h).status_code == 404
    assert "storage fault: checkpoints: io" in stderr_of(srv)


def _restart(world, db_edit):
    """Stop the server gracefully (the WAL checkpointed into responses.db), edit the file,
    start again."""
    world.srv.proc.send_signal(signal.SIGTERM)
    assert world.srv.proc.wait(timeout=60) == 0
    db_edit(world.dir / "responses.db")
    world.srv = start_server(world.dir, principal="alice")


def test_a_flipped_payload_byte_is_caught_when_read(world):
    srv, key = world.srv, KEYS["alice"]
    h = {"Authorization": f"Bearer {key}"}
    marker = "payload-marker-QX81"
    hit = create(srv, key, input=f"remember {marker}").json()["id"]
    fine = create(srv, key, input="an unrelated response").json()["id"]
    _restart(world, lambda db: flip_text(db, marker.encode()))
    srv = world.srv
    for path in (f"/responses/{hit}", f"/responses/{hit}/input_items"):
        r = httpx.get(srv.api_url + path, headers=h)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "storage_corrupt", r.text
    chained = create(srv, key, input="go on", previous_response_id=hit)
    assert chained.json()["error"]["code"] == "storage_corrupt", chained.text
    assert httpx.get(f"{srv.api_url}/responses/{fine}", headers=h).status_code == 200
    m = scrape(srv, KEYS["ops"])
    assert m[("ninfer_storage_errors_total", (("kind", "corrupt"), ("store", "responses")))] == 3
    assert stderr_of(srv).count("storage fault: responses: corrupt") == 3
    assert marker[:-4] not in stderr_of(srv)


def test_a_smashed_btree_page_is_refused_at_start(world):
    keep = world.dir / "responses.db.good"
    world.srv.proc.send_signal(signal.SIGTERM)
    assert world.srv.proc.wait(timeout=60) == 0
    shutil.copy(world.dir / "responses.db", keep)
    smash_table_root(world.dir / "responses.db", "output_items")
    t = time.monotonic()
    with pytest.raises(RuntimeError) as refused:
        start_server(world.dir, principal="alice", timeout=120)
    log = str(refused.value)
    assert "storage fault: response store" in log and "refusing to start" in log, log
    assert "move it aside" in log and "listening on" not in log, log
    assert time.monotonic() - t < 120
