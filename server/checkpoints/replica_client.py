"""`./ninfer checkpoints replica push|pull`: the client side of the replica service.

Push reads the session's newest verified generation and stored responses as `export` does
(`session_entries`), signs the same header with the transfer key, sends it first, and then only
the objects the replica says it lacks; the replica acknowledges each one once it is durable, so
a push that was interrupted and is run again sends only what was not acknowledged (or not yet
received whole) before. The manifest is published when every object is there.

Pull fetches the manifest and its objects, verifies the tag and every object's sha256 and size
in memory, rebuilds the bundle `export` would have written and imports it by the path `import`
takes (the running server's control socket, or the stores themselves when it is stopped). Stored
responses that the receiving database already holds, identical, are left out of that bundle
(after losing only the checkpoint root, the responses are still there); one that differs is
refused.
"""
from __future__ import annotations

import hashlib
import json
import queue
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from server import response_rows
from server.checkpoints.bundle import BundleError, sign_header, write_bundle
from server.checkpoints.replica_service import CHUNK
from server.checkpoints.replica_store import check_manifest, objects_of, where_of
from server.checkpoints.replica_tls import channel, unreachable


def _rpc_error(address: str, e) -> BundleError:
    import grpc

    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return BundleError(unreachable(address, e))
    return BundleError(f"replica {address}: {e.code().name}: {e.details()}")


def push(state_dir: Path, principal: str, session: str, address: str, ident, key: bytes,
         pool, max_rate: float = 0.0, timeout: float = 3600.0, progress=None) -> dict:
    """Push (principal, session)'s newest verified generation to the replica at `address`.
    `max_rate` (MB/s, 0: none) paces the object bytes sent; `progress(path, done, total)`
    hears each acknowledged object."""
    import grpc

    from server import replica_pb2 as pb
    from server import replica_pb2_grpc as pbg
    from server.checkpoints.transfer import session_entries

    header, entries, info = session_entries(state_dir, principal, session, pool)
    head_b, mac, views = sign_header(key, header, entries, pool)
    head = json.loads(head_b)
    by_sha = {e["sha256"]: (e, v) for e, v in zip(head["entries"], views)}
    wanted: queue.Queue = queue.Queue()
    sent = {"bytes": 0, "t0": time.perf_counter()}

    def requests():
        yield pb.PushMessage(manifest=pb.Manifest(header=head_b, mac=mac))
        want = wanted.get()
        for sha in want or ():
            view = by_sha[sha][1]
            for off in range(0, max(view.nbytes, 1), CHUNK):
                part = bytes(view[off:off + CHUNK])
                if max_rate > 0:  # pace: never ahead of max_rate MB/s
                    ahead = sent["bytes"] / (max_rate * 1e6) - (time.perf_counter() - sent["t0"])
                    if ahead > 0:
                        time.sleep(ahead)
                sent["bytes"] += len(part)
                yield pb.PushMessage(chunk=pb.Chunk(sha256=sha, data=part,
                                                    last=off + CHUNK >= view.nbytes))
        if want is not None:
            yield pb.PushMessage(commit=pb.Commit())

    t0 = time.perf_counter()
    missing, acked, published = None, 0, None
    with channel(address, ident) as ch:
        try:
            for r in pbg.ReplicaStub(ch).Push(requests(), timeout=timeout):
                kind = r.WhichOneof("body")
                if kind == "missing":
                    missing = list(r.missing.sha256)
                    if any(d not in by_sha for d in missing):
                        raise BundleError(f"replica {address} asked for an object the "
                                          "manifest does not list")
                    wanted.put(missing)
                elif kind == "ack":
                    acked += 1
                    if progress is not None:
                        progress(by_sha[r.ack.sha256][0]["path"], acked, len(missing))
                elif kind == "published":
                    published = r.published
        except grpc.RpcError as e:
            raise _rpc_error(address, e) from None
        finally:
            wanted.put(None)  # the request thread never waits on a push that ended
    if published is None:
        raise BundleError(f"replica {address}: the push ended before the manifest was "
                          "published")
    seconds = time.perf_counter() - t0
    total = sum(e["bytes"] for e in objects_of(head))
    sent_bytes = sum(by_sha[d][0]["bytes"] for d in missing)
    return {**info, "replica": address, "objects": len(objects_of(head)),
            "objects_sent": len(missing), "bytes_sent": sent_bytes, "bytes_total": total,
            "manifest_bytes": len(head_b) + len(mac), "seconds": round(seconds, 3),
            "mb_per_s": round(sent_bytes / 1e6 / seconds, 1) if seconds else None,
            "replica_objects_received": published.objects_received,
            "replica_bytes_received": published.bytes_received}


def fetch(address: str, ident, key: bytes, principal: str, session: str,
          timeout: float = 3600.0) -> tuple[dict, dict]:
    """The session's manifest (verified) and every object it lists (verified), by entry
    path; BundleError naming the manifest or the entry otherwise. Nothing is written."""
    import grpc

    from server import replica_pb2 as pb
    from server import replica_pb2_grpc as pbg

    where = f"replica {address}: {where_of(principal, session)}"
    head, objs, cur = None, {}, None
    with channel(address, ident) as ch:
        try:
            for r in pbg.ReplicaStub(ch).Pull(pb.PullRequest(principal=principal,
                                                             session=session),
                                              timeout=timeout):
                if head is None:
                    if r.WhichOneof("body") != "manifest":
                        raise BundleError(f"{where}: the stream does not start with it")
                    head = check_manifest(key, r.manifest.header, r.manifest.mac, where)
                    if (head["principal"], head["session"]) != (principal, session):
                        raise BundleError(f"{where}: bundle.json is another principal's or "
                                          f"session's ({head['principal']!r}); refused")
                    listed = {e["sha256"]: e for e in objects_of(head)}
                    continue
                c = r.chunk
                if c.sha256 not in listed or (cur is not None and c.sha256 != cur):
                    raise BundleError(f"{where}: an object the manifest does not list")
                cur = c.sha256
                buf = objs.setdefault(cur, bytearray())
                buf += c.data
                if c.last:
                    cur = None
        except grpc.RpcError as e:
            raise _rpc_error(address, e) from None
    if head is None:
        raise BundleError(f"{where}: no manifest received (truncated stream)")
    data = {}
    for sha, e in listed.items():
        body = objs.get(sha)
        if body is None or len(body) != int(e["bytes"]):
            raise BundleError(f"{where}: entry {e['path']}: "
                              f"{'missing' if body is None else 'truncated'}")
        if hashlib.sha256(body).hexdigest() != sha:
            raise BundleError(f"{where}: entry {e['path']}: sha256 differs from bundle.json")
    for e in head["entries"]:
        data[e["path"]] = bytes(objs[e["sha256"]])
    return head, data


def _without_stored(db: Path, principal: str, session: str, rows: dict, where: str) -> dict:
    """`rows` less the responses the database at `db` holds already, identical (and their
    items); ValueError when one it holds differs."""
    if not db.is_file():
        return rows
    here = response_rows.export_session(db, principal, session)
    ids = {r["id"] for r in rows["responses"]}
    have = {r["id"] for r in here["responses"]} & ids
    if not have:
        return rows
    for table in ("responses", "input_items", "output_items"):
        col = "id" if table == "responses" else "response_id"
        ours = sorted((json.dumps(r, sort_keys=True) for r in here[table] if r[col] in have))
        theirs = sorted((json.dumps(r, sort_keys=True) for r in rows[table] if r[col] in have))
        if ours != theirs:
            raise ValueError(f"{where}: responses.json: a response in {table} is stored here "
                             "with other content; refused")
    return {**rows, **{t: [r for r in rows[t] if r["id" if t == "responses" else
                                                     "response_id"] not in have]
                       for t in ("responses", "input_items", "output_items")}}


def pull(state_dir: Path, address: str, ident, key: bytes, key_path: Path, principal: str,
         session: str, import_running, import_stopped, timeout: float = 3600.0,
         checkpoint_quota: str = "8G") -> dict:
    """Fetch the session from the replica and import it into `state_dir` (through
    `import_running(sock, args, key_path)` when its server answers on the control socket,
    else `import_stopped(args, state_dir, key_path)`)."""
    state_dir = Path(state_dir)
    head, data = fetch(address, ident, key, principal, session, timeout)
    where = f"replica {address}: {where_of(principal, session)}"
    try:
        rows = response_rows.decode(data["responses.json"], where)
        kept = _without_stored(state_dir / "responses.db", principal, session, rows, where)
    except ValueError as e:
        raise BundleError(str(e)) from None
    if kept is not rows:
        data["responses.json"] = response_rows.encode(kept)
    header = {k: v for k, v in head.items() if k not in ("type", "schema", "entries")}
    tmp = Path(tempfile.mkdtemp(prefix=".replica-pull-", dir=state_dir))
    try:
        bundle = tmp / "session.bundle"
        write_bundle(bundle, key, header, [(e["path"], data[e["path"]], None)
                                           for e in head["entries"]])
        args = SimpleNamespace(file=str(bundle), principal=principal, timeout=timeout,
                               checkpoint_quota=checkpoint_quota)
        sock = state_dir / "ctl.sock"
        r = import_running(sock, args, key_path) if sock.is_socket() else None
        if r is None:
            r = import_stopped(args, state_dir, key_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r.update(replica=address, responses_already_here=len(rows["responses"])
             - len(kept["responses"]))
    return r


def log_progress(path: str, done: int, total: int) -> None:
    print(f"ninfer replica push: acknowledged {path} ({done}/{total})", file=sys.stderr,
          flush=True)
