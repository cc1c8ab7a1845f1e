"""The replica service (`./ninfer checkpoints replica serve`): server/replica.proto's Push and
Pull over a replica directory (replica_store.py), on mutual TLS between pinned certificates
(replica_tls.py). It listens only on the address the owner gives, and only with TLS.

Push checks the manifest (the transfer key's tag, entry names, the checkpoint's pages) before
it writes anything, answers with the objects it lacks, takes exactly those (each verified
against the manifest before it is written, then acknowledged), and publishes the manifest when
the client commits. A stream that ends before the commit publishes nothing.
"""
from __future__ import annotations

import json
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

from server.checkpoints.bundle import BundleError
from server.checkpoints.replica_store import (ReplicaDir, check_manifest, dump_stats, objects_of,
                                              where_of)
from server.checkpoints.replica_tls import (Identity, fingerprint, peer_pinned,
                                            server_credentials, server_options)

CHUNK = 2 << 20  # bytes of one streamed chunk
STATS = "received.json"  # <replica>/received.json: what this service has received


def _servicer(replica: ReplicaDir, pins: frozenset):
    import grpc

    from server import replica_pb2 as pb
    from server import replica_pb2_grpc as pbg

    def refuse(context, code, msg):
        print(f"ninfer replica: refused: {msg}", file=sys.stderr, flush=True)
        context.abort(code, msg)

    def peer_ok(context):
        if peer_pinned(context, pins) is None:
            refuse(context, grpc.StatusCode.PERMISSION_DENIED,
                   "the peer's certificate is not pinned by this replica")

    def push_objects(head, head_b, mac, where, requests, context):
        want = replica.missing(head)
        yield pb.PushReply(missing=pb.Missing(sha256=want))
        wanted = {e["sha256"]: e for e in objects_of(head) if e["sha256"] in set(want)}
        cur, buf, n, nbytes = None, bytearray(), 0, 0
        try:
            for msg in requests:
                kind = msg.WhichOneof("body")
                if kind == "commit":
                    if cur is not None:
                        raise BundleError(f"{where}: entry {wanted[cur]['path']}: "
                                          "truncated stream (commit inside an object)")
                    sdir = replica.publish(head, head_b, mac, where)
                    dump_stats(replica, replica.root / STATS)  # with what it collected
                    yield pb.PushReply(published=pb.Published(
                        session_dir=str(sdir), objects_received=n, bytes_received=nbytes))
                    return
                c = msg.chunk if kind == "chunk" else None
                if c is None or (cur is None and c.sha256 not in wanted) or (
                        cur is not None and c.sha256 != cur):
                    raise BundleError(f"{where}: an object not asked for, or interleaved")
                cur = c.sha256
                buf += c.data
                if len(buf) > int(wanted[cur]["bytes"]):
                    raise BundleError(f"{where}: entry {wanted[cur]['path']}: more bytes "
                                      "than bundle.json lists")
                if c.last:
                    total = replica.put(wanted.pop(cur), bytes(buf), where)
                    n, nbytes = n + 1, nbytes + len(buf)
                    dump_stats(replica, replica.root / STATS)
                    yield pb.PushReply(ack=pb.Ack(sha256=cur, objects_received=total))
                    cur, buf = None, bytearray()
        except BundleError as e:
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        print(f"ninfer replica: a push of {where} ended before its commit; nothing "
              "published", file=sys.stderr, flush=True)

    def pull_objects(head, where, context):
        for e in objects_of(head):
            try:
                data = replica.object_path(e["sha256"]).read_bytes()
            except FileNotFoundError:
                refuse(context, grpc.StatusCode.DATA_LOSS,
                       f"{where}: entry {e['path']} is missing on the replica")
            view = memoryview(data)
            for off in range(0, max(len(data), 1), CHUNK):
                yield pb.PullChunk(chunk=pb.Chunk(
                    sha256=e["sha256"], data=bytes(view[off:off + CHUNK]),
                    last=off + CHUNK >= len(data)))

    class Replica(pbg.ReplicaServicer):
        def Push(self, requests, context):
            peer_ok(context)
            first = next(requests, None)
            if first is None or first.WhichOneof("body") != "manifest":
                refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                       "a push starts with its manifest")
            head_b, mac = first.manifest.header, first.manifest.mac
            try:
                head = json.loads(head_b) if head_b else {}
                where = where_of(head.get("principal"), head.get("session"))
            except (ValueError, AttributeError):
                where = "manifest"
            try:
                head = check_manifest(replica.key, head_b, mac, where)
            except BundleError as e:
                refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            with replica.holding(head):  # nothing it relies on is collected meanwhile
                yield from push_objects(head, head_b, mac, where, requests, context)

        def Pull(self, request, context):
            peer_ok(context)
            where = where_of(request.principal, request.session)
            try:
                head_b, mac = replica.read_manifest(request.principal, request.session)
                head = check_manifest(replica.key, head_b, mac, where)
            except FileNotFoundError:
                refuse(context, grpc.StatusCode.NOT_FOUND, f"{where}: not on this replica")
            except BundleError as e:
                refuse(context, grpc.StatusCode.DATA_LOSS, str(e))
            with replica.holding(head):
                yield pb.PullChunk(manifest=pb.Manifest(header=head_b, mac=mac))
                yield from pull_objects(head, where, context)

    return Replica()


def serve(root: Path, listen: str, key: bytes, ident: Identity, workers: int = 8):
    """Start the service on `listen` (host:port; port 0 picks one); returns (server, port)."""
    import grpc

    from server import replica_pb2_grpc as pbg

    replica = ReplicaDir(root, key)
    server = grpc.server(futures.ThreadPoolExecutor(workers, thread_name_prefix="replica"),
                         options=server_options())
    pbg.add_ReplicaServicer_to_server(_servicer(replica, ident.pins), server)
    port = server.add_secure_port(listen, server_credentials(ident))
    if not port:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return server, port


def serve_forever(root: Path, listen: str, key: bytes, ident: Identity) -> int:
    """`replica serve`: one JSON line on stdout once listening, then serve until SIGTERM or
    SIGINT."""
    server, port = serve(root, listen, key, ident)
    host = listen.rsplit(":", 1)[0]
    print(json.dumps({"listening": f"{host}:{port}", "replica": str(root),
                      "sha256": fingerprint(ident.cert)}), flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop(grace=2).wait()
    return 0
