"""Replication with real server processes on loopback: sessions built on a server, saved and
pushed to a replica service while it serves; with the server stopped its checkpoint root is
removed (`rm -rf`); one session is pulled back with the server stopped, the other through the
running server's control socket; alice continues by `previous_response_id`, bob by his
resent transcript with the same `prompt_cache_key`, each token-identically with its model state
restored from the pulled checkpoint (not recomputed). Slow tier."""
from __future__ import annotations

import shutil

import pytest

from lanes.profile import PROFILE_DIR
from tests.test_checkpoint_server import TURNS, ask, fed, key_of, out_ids, save_now, start
from tests.test_replica import cli, serve_replica
from tests.test_session_transfer import N, prompt, restored, state_dir, transcript

SESSION = "ck-session-7f3a9c2e"  # the helpers' prompt_cache_key


@pytest.fixture(scope="module")
def sw(tmp_path_factory, embedded_models_dir):
    root = tmp_path_factory.mktemp("replica-srv")
    (root / "models").symlink_to(embedded_models_dir)
    base = (PROFILE_DIR / "cpu.toml").read_text()
    lane = root / "small.toml"
    lane.write_text(base.replace("context_tokens = 32768", "context_tokens = 4096")
                    .replace("kv_capacity_tokens = 131072", "kv_capacity_tokens = 16384"))
    a = state_dir(root, "a", str(lane), "".join(f"{p} {key_of(p)}\n" for p in ("alice", "bob")))
    key = cli("transfer-key", "--state-dir", a.dir).strip()
    client = cli("replica", "cert", "--state-dir", a.dir)
    server = cli("replica", "cert", "--out", root / "replica-cert")
    proc, addr = serve_replica(root / "replica", root / "replica-cert", key, client)
    peer = ("--from", addr, "--peer-cert", server["cert"], "--pin", server["sha256"])
    yield a, peer
    proc.terminate()
    proc.wait(timeout=30)
    if getattr(a, "srv", None) is not None:
        a.srv.stop()


def replica(a, peer, verb, who):
    to = ("--to" if verb == "push" else "--from", peer[1], *peer[2:])
    return cli("replica", verb, "--state-dir", a.dir, "--principal", who, "--session", SESSION,
               *to)


@pytest.mark.slow  # two server starts, ten generations: 70-140 s on the shared 2-core VM
def test_r6_pulled_back_after_the_checkpoint_root_is_lost_continues_exactly(sw):
    a, peer = sw
    refs = {}
    a.srv = srv = start(a)
    try:
        for who, seed in (("alice", 1), ("bob", 2)):
            r1 = ask(srv, who, prompt(seed), n=8)
            r2 = ask(srv, who, TURNS[2], prev=r1, n=N)
            assert all(x["status"] in ("saved", "already_saved") for x in save_now(srv, who))
            out = replica(a, peer, "push", who)
            assert out["objects_sent"] == out["objects"] and out["frontier_tokens"] == fed(r2)
            refs[who] = (r1, r2, ask(srv, who, TURNS[3], prev=r2, n=N))
    finally:
        srv.stop()
    ids = {who: out_ids(a, r3["id"]) for who, (_, _, r3) in refs.items()}
    assert ids["alice"] != ids["bob"] and all(len(set(v)) >= 8 for v in ids.values())
    shutil.rmtree(a.dir / "checkpoints")
    got = replica(a, peer, "pull", "alice")
    assert got["server"] == "stopped" and got["responses_already_here"] == 2
    a.srv = srv = start(a)
    try:
        got = replica(a, peer, "pull", "bob")
        assert got["server"] == "running" and got["responses_already_here"] == 2
        again = {}
        r1, r2, _ = refs["alice"]
        again["alice"] = ask(srv, "alice", TURNS[3], prev=r2, n=N)
        restored(a, again["alice"], fed(r2))
        r1, r2, _ = refs["bob"]  # bob resends his transcript, same prompt_cache_key
        again["bob"] = ask(srv, "bob", transcript([r1, r2], TURNS[3]), n=N)
        restored(a, again["bob"], fed(r2))
    finally:
        srv.stop()
    for who in refs:
        assert out_ids(a, again[who]["id"]) == ids[who], who
