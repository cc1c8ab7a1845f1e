"""Replication (`./ninfer checkpoints replica cert|serve|push|pull`), with a real replica
service process on a loopback TLS port, real state directories and real stores:

  R1  certificates are private and pinned: an unpinned client, a replica that is not the pinned
      one and a peer file whose fingerprint is not pinned are all refused, and nothing is written
  R2  a push killed (SIGKILL) between its first and last acknowledged page, run again, completes
      with no object received twice (the replica's own count)
  R3  a session grown by N = 64 and 512 tokens re-pushes only its new pages, one state image,
      the tokens and responses, and the manifest (the replica's received bytes)
      and what the replaced manifest alone listed is collected at once; an object that a push
      in flight relies on, or that a push that died left, stays (collection, in-process)
  R4  pull into a stopped state dir, and again after its checkpoint root is removed (the
      responses it still holds are recognised, not refused); the checkpoint read back equals
      the source's
  R5  bad input is refused before any write, naming the file or the entry: a wrong transfer key
      (push and pull), another principal's manifest, a flipped byte (in transit and at rest),
      a truncated stream and a truncated object, `..` and absolute entry names

The same with real servers: tests/test_replica_server.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.serverproc import REPO

PAGE, STATE = 128 << 10, 512 << 10  # bytes of a synthetic page and state image
_HEADS: dict = {}  # (state dir, session) -> its newest stored response


def cli(*args, ok=True, timeout=120):
    r = subprocess.run([sys.executable, "-m", "server.cli", "checkpoints", *map(str, args)],
                       cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == (0 if ok else 1), (r.stdout, r.stderr)
    if not ok:
        return r.stderr
    return json.loads(r.stdout) if r.stdout.startswith("{") else r.stdout


def save_synthetic(state: Path, principal: str, session: str, n_tokens: int, turns: int):
    """A generation of `n_tokens` through the real CheckpointStore (bench/replication.py's:
    a grown session shares its full pages) and `turns` more stored responses."""
    from bench.replication import save

    pages, _HEADS[state, session] = save(state, n_tokens, PAGE, STATE, turns,
                                         _HEADS.get((state, session)), principal, session)
    return pages


def serve_replica(replica: Path, cert_dir: Path, key: Path, client: dict):
    """`replica serve` as a process on a loopback port, pinning `client`'s certificate."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "checkpoints", "replica", "serve", "--dir",
         replica, "--listen", "127.0.0.1:0", "--cert-dir", cert_dir, "--transfer-key", key,
         "--peer-cert", client["cert"], "--pin", client["sha256"]],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return proc, json.loads(line)["listening"]


@pytest.fixture(scope="module")
def rw(tmp_path_factory):
    root = tmp_path_factory.mktemp("replica")
    w = SimpleNamespace(root=root, src=root / "src", dst=root / "dst", heads={})
    for d in (w.src, w.dst):
        d.mkdir(mode=0o700)
    w.key = Path(cli("transfer-key", "--state-dir", w.src).strip())
    (w.dst / "secrets").mkdir(mode=0o700)
    shutil.copy2(w.key, w.dst / "secrets" / "transfer-key")
    w.client = cli("replica", "cert", "--state-dir", w.src)
    shutil.copytree(w.src / "secrets" / "replica", w.dst / "secrets" / "replica")
    w.server = cli("replica", "cert", "--out", root / "replica-cert")
    w.stranger = cli("replica", "cert", "--out", root / "stranger-cert")
    w.dir = root / "replica"
    w.proc, w.addr = serve_replica(w.dir, root / "replica-cert", w.key, w.client)
    w.peer = ["--peer-cert", w.server["cert"], "--pin", w.server["sha256"]]
    yield w
    w.proc.send_signal(signal.SIGTERM)
    w.proc.wait(timeout=30)


def push(w, session, *extra, ok=True, principal="carol"):
    return cli("replica", "push", "--state-dir", w.src, "--to", w.addr, "--principal",
               principal, "--session", session, *w.peer, *extra, ok=ok)


def pull(w, session, *extra, ok=True, principal="carol", key=None):
    return cli("replica", "pull", "--state-dir", w.dst, "--from", w.addr, "--principal",
               principal, "--session", session, *w.peer, "--transfer-key",
               key or w.dst / "secrets" / "transfer-key", *extra, ok=ok)


def files(d: Path) -> list:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()
                  and p.name not in ("received.json", "lock"))


def stats(w) -> dict:
    return json.loads((w.dir / "received.json").read_text())


def test_r1_certificates_private_and_pinned(rw):
    w = rw
    key = Path(w.client["key"])
    assert os.stat(key).st_mode & 0o777 == 0o600
    assert os.stat(key.parent).st_mode & 0o777 == 0o700
    from cryptography import x509
    cert = x509.load_pem_x509_certificate(Path(w.client["cert"]).read_bytes())
    assert hashlib.sha256(cert.public_bytes(
        __import__("cryptography.hazmat.primitives.serialization",
                   fromlist=["Encoding"]).Encoding.DER)).hexdigest() == w.client["sha256"]
    save_synthetic(w.src, "carol", "pinned", 200, 1)
    before = files(w.dir)
    # a client whose certificate the replica does not pin
    msg = push(w, "pinned", "--cert-dir", w.root / "stranger-cert", ok=False)
    assert "TLS handshake failed" in msg
    # a replica that is not the pinned one (the client pins the stranger's certificate)
    msg = cli("replica", "push", "--state-dir", w.src, "--to", w.addr, "--principal", "carol",
              "--session", "pinned", "--peer-cert", w.stranger["cert"], "--pin",
              w.stranger["sha256"], ok=False)
    assert "TLS handshake failed" in msg and "CERTIFICATE_VERIFY_FAILED" in msg
    # a peer certificate file whose fingerprint is not the pin; no pin at all
    msg = cli("replica", "push", "--state-dir", w.src, "--to", w.addr, "--principal", "carol",
              "--session", "pinned", "--peer-cert", w.stranger["cert"], "--pin",
              w.server["sha256"], ok=False)
    assert w.stranger["cert"] in msg and "not pinned" in msg
    msg = cli("replica", "serve", "--dir", w.root / "r2", "--listen", "127.0.0.1:0",
              "--transfer-key", w.key, "--state-dir", w.src, ok=False)
    assert "unpinned peer is never trusted" in msg and not (w.root / "r2").exists()
    import grpc  # no plaintext: a client without TLS gets no answer

    from server import replica_pb2 as pb
    from server import replica_pb2_grpc as pbg
    with grpc.insecure_channel(w.addr) as ch, pytest.raises(grpc.RpcError) as e:
        list(pbg.ReplicaStub(ch).Pull(pb.PullRequest(principal="carol", session="pinned"),
                                      timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert files(w.dir) == before
    assert push(w, "pinned")["objects_sent"] == 7  # tokens, state, 4 pages, responses


def test_r2_killed_push_resumes_without_sending_a_page_twice(rw):
    w = rw
    save_synthetic(w.src, "carol", "killed", 24 * 64, 2)
    p = subprocess.Popen([sys.executable, "-m", "server.cli", "checkpoints", "replica", "push",
                          "--state-dir", w.src, "--to", w.addr, "--principal", "carol",
                          "--session", "killed", *w.peer, "--max-rate", "1"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while "acknowledged pages/" not in (line := p.stderr.readline()):
        assert line, p.stdout.read()
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    time.sleep(0.5)  # the replica finishes what it was taking
    got = stats(w)["distinct_objects"]
    total = 24 + 3
    first = got - 7  # R1 pushed 7 objects
    assert 2 <= first < total - 1, first  # state and a page at least, the manifest not
    assert not (w.dir / "sessions" / _ns("killed")).exists()
    r = push(w, "killed")
    assert r["objects"] == total and r["objects_sent"] == total - first
    s = stats(w)
    assert s["received_twice"] == [] and s["distinct_objects"] == s["objects_received"] == 7 + total
    assert (w.dir / "sessions" / _ns("killed") / "manifest").is_file()


def _ns(session, principal="carol"):
    from server.checkpoints.tags import session_namespace
    return session_namespace(principal, session)


def test_r3_a_grown_session_repushes_only_its_new_pages(rw):
    w = rw
    T = 40 * 64 - 9
    pages0 = save_synthetic(w.src, "carol", "grown", T, 2)
    push(w, "grown")
    w.bytes_per_push = {}
    for n in (64, 512):
        pages1 = save_synthetic(w.src, "carol", "grown", T + n, 1)
        before = stats(w)
        r = push(w, "grown")
        new = pages1 - pages0
        assert len(new) == -(-(T + n) // 64) - T // 64
        got = stats(w)["bytes_received"] - before["bytes_received"]
        tokens, responses = 4 * (T + n), r["bytes_sent"] - len(new) * PAGE - STATE - 4 * (T + n)
        assert r["objects_sent"] == len(new) + 3  # + state image, tokens, responses
        assert got == r["bytes_sent"] == len(new) * PAGE + STATE + tokens + responses
        assert 0 < responses < 16 << 10
        w.bytes_per_push[n] = {"bytes": got + r["manifest_bytes"], "new_pages": len(new)}
        pages0, T = pages1, T + n
    assert stats(w)["received_twice"] == []


def _listed(replica: Path) -> set:
    out = set()
    for m in (replica / "sessions").glob("*/manifest"):
        head = json.loads(m.read_bytes().partition(b"\n")[2])
        out |= {e["sha256"] for e in head["entries"]}
    return out


def test_r3_superseded_objects_are_collected(rw):
    """After R2's and R3's pushes the replica holds exactly what its manifests list: the state
    images, tokens, responses and partial last pages of the replaced manifests are gone."""
    w = rw
    on_disk = {p.name for p in (w.dir / "objects").glob("*/*")}
    assert on_disk == _listed(w.dir)
    assert stats(w)["objects_collected"] > 0


def test_collection_keeps_what_is_listed_held_or_young(tmp_path):
    from server.checkpoints.replica_store import ORPHAN_GRACE_S, ReplicaDir

    r = ReplicaDir(tmp_path / "replica", b"k" * 32)
    data = {k: os.urandom(1000) for k in "abcde"}
    ent = {k: {"path": f"pages/{hashlib.sha256(v).hexdigest()}", "bytes": len(v),
               "sha256": hashlib.sha256(v).hexdigest()} for k, v in data.items()}

    def head(session, keys):
        return {"principal": "p", "session": session, "entries": [ent[k] for k in keys]}

    def publish(h):
        for e in h["entries"]:
            r.put(e, data[next(k for k in ent if ent[k] is e)], "t")
        return r.publish(h, json.dumps(h).encode(), "tag", "t")
    publish(head("s", "ab"))
    r.put(ent["c"], data["c"], "t")  # what a push that died left: listed nowhere
    inflight = head("t", "bd")  # a push of another session, which found b here
    with r.holding(inflight):
        publish(head("s", "ae"))  # b superseded, but held
        assert {p.name for p in (r.root / "objects").glob("*/*")} == {
            ent[k]["sha256"] for k in "abce"}
    assert r.collected == 0
    assert r.collect() == 0  # b and c are young orphans now: kept for a resumed push
    assert r.collect(now=time.time() + ORPHAN_GRACE_S + 1) == 2
    assert {p.name for p in (r.root / "objects").glob("*/*")} == {ent[k]["sha256"] for k in "ae"}


def _checkpoint(state: Path, session: str):
    from concurrent.futures import ThreadPoolExecutor

    from server.checkpoints.transfer import session_entries
    with ThreadPoolExecutor(2) as pool:
        _, entries, _ = session_entries(state, "carol", session, pool)
        return {n: bytes(d) for n, d, _ in entries if n != "responses.json"}


def test_r4_pull_into_a_stopped_state_dir_and_after_losing_its_checkpoints(rw):
    w = rw
    r = pull(w, "grown")
    assert r["server"] == "stopped" and r["responses"] == 4 and r["pages"] == 49
    assert _checkpoint(w.dst, "grown") == _checkpoint(w.src, "grown")
    shutil.rmtree(w.dst / "checkpoints")
    r = pull(w, "grown")
    assert r["responses_already_here"] == 4 and r["responses"] == 0 and r["pages_written"] == 49
    assert _checkpoint(w.dst, "grown") == _checkpoint(w.src, "grown")


def _raw_push(w, messages):
    """Send `messages` (replica_pb2.PushMessage) on a pinned TLS channel; the grpc error."""
    import grpc

    from server import replica_pb2_grpc as pbg
    from server.checkpoints.replica_tls import channel, load_identity

    ident = load_identity(w.src / "secrets" / "replica", [w.server["cert"]],
                          [w.server["sha256"]])
    with channel(w.addr, ident) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pbg.ReplicaStub(ch).Push(iter(messages), timeout=30))
    return e.value.details()


def _signed(w, session, edit=None):
    from concurrent.futures import ThreadPoolExecutor

    from server.checkpoints.bundle import read_transfer_key, sign_header
    from server.checkpoints.transfer import session_entries
    with ThreadPoolExecutor(2) as pool:
        header, entries, _ = session_entries(w.src, "carol", session, pool)
    entries = [(n, bytes(d), s) for n, d, s in entries]
    if edit:
        entries = edit(entries)
    head_b, mac, _ = sign_header(read_transfer_key(w.key), header, entries)
    return head_b, mac, entries


def test_r5_bad_input_is_refused_before_any_write(rw):
    from server import replica_pb2 as pb

    w = rw
    save_synthetic(w.src, "carol", "bad", 6 * 64, 1)
    rep, dst = files(w.dir), files(w.dst)
    wrong = w.root / "wrong.key"
    cli("transfer-key", "--out", wrong)
    msg = push(w, "bad", "--transfer-key", wrong, ok=False)
    assert "bundle.mac does not verify" in msg and "'bad'" in msg
    head_b, mac, entries = _signed(w, "bad")
    m = pb.PushMessage(manifest=pb.Manifest(header=head_b, mac=mac))
    name, data, sha = next(e for e in entries if e[0].startswith("pages/"))
    sha = sha or hashlib.sha256(data).hexdigest()
    flipped = bytearray(data)
    flipped[100] ^= 1
    msg = _raw_push(w, [m, pb.PushMessage(chunk=pb.Chunk(sha256=sha, data=bytes(flipped),
                                                         last=True))])
    assert name in msg and "sha256 differs" in msg
    msg = _raw_push(w, [m, pb.PushMessage(chunk=pb.Chunk(sha256=sha, data=data[:999])),
                        pb.PushMessage(commit=pb.Commit())])
    assert name in msg and "truncated" in msg
    for evil in ("pages/../../escape", "/tmp/escape"):
        with pytest.raises(ValueError):  # the signer refuses it too: forge the header
            _signed(w, "bad", lambda es: es + [(evil, b"x", None)])
        h = json.loads(head_b)
        h["entries"].append({"path": evil, "bytes": 1, "sha256": "0" * 64})
        from server.checkpoints.bundle import _mac, read_transfer_key
        hb = json.dumps(h, sort_keys=True, separators=(",", ":")).encode()
        msg = _raw_push(w, [pb.PushMessage(manifest=pb.Manifest(
            header=hb, mac=_mac(read_transfer_key(w.key), hb)))])
        assert repr(evil) in msg and "not a bundle entry" in msg
    assert files(w.dir) == rep and not (w.dir / "sessions" / _ns("bad")).exists()
    push(w, "bad")
    rep = files(w.dir)
    msg = pull(w, "bad", key=wrong, ok=False)
    assert "manifest of session 'bad'" in msg and "bundle.mac does not verify" in msg
    # another principal's manifest, moved under bob's name on the replica
    shutil.copytree(w.dir / "sessions" / _ns("bad"), w.dir / "sessions" / _ns("bad", "bob"))
    msg = pull(w, "bad", principal="bob", ok=False)
    assert "another principal" in msg and "'bob'" in msg
    shutil.rmtree(w.dir / "sessions" / _ns("bad", "bob"))
    obj = w.dir / "objects" / sha[:2] / sha
    good = obj.read_bytes()
    for bad, why in ((good[:100] + bytes([good[100] ^ 1]) + good[101:], "sha256 differs"),
                     (good[:-10], "truncated")):
        obj.chmod(0o600)
        obj.write_bytes(bad)
        msg = pull(w, "bad", ok=False)
        assert name in msg and why in msg, msg
    obj.write_bytes(good)
    assert files(w.dst) == dst and files(w.dir) == rep
    assert pull(w, "bad")["pages"] == 6
