"""The control plane: drain, save and stop a running server, over gRPC on a unix socket.

Server side: `Lifecycle` (drain, the graceful stop and its report, shared by SIGTERM/SIGINT
and `ctl stop`) and `start_ctl_server`, which listens on <state-dir>/ctl.sock (mode 0600, in the
0700 state directory). Client side: `./ninfer ctl status|save|drain|stop [--state-dir DIR]`.

The generated modules (server/ctl_pb2.py, server/ctl_pb2_grpc.py) are committed: protoc's output
is byte-deterministic, so the runtime needs only grpcio and protobuf (no compiler at build or
start), and tests/test_checkpoint_ctl.py regenerates them and checks they are unchanged.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

from server.checkpoints.status import SAVE_OUTCOMES, SessionStatus

SOCKET_NAME = "ctl.sock"
REPO = Path(__file__).resolve().parent.parent


class Lifecycle:
    """Drain and stop, once. `request_stop` is how the server's own loop gets stopped."""

    def __init__(self, rt, state_dir: Path, request_stop=None):
        self.rt, self.state_dir, self.request_stop = rt, Path(state_dir), request_stop
        self._lock = threading.Lock()
        self._report: dict | None = None

    def busy(self) -> tuple[int, int]:
        eng = self.rt.engine
        if eng is None:
            return 0, 0
        st = eng.stats()
        return st["running"], st["waiting"]

    def drain(self, timeout: float = 30.0) -> dict:
        self.rt.draining = True
        deadline = time.monotonic() + timeout
        running, waiting = self.busy()
        while (running or waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
            running, waiting = self.busy()
        return {"drained": not (running or waiting), "running": running, "waiting": waiting}

    def stop_report(self, timeout: float = 60.0) -> dict:
        """Drain, save every live session, report (saved, nothing to save, refused and why)."""
        with self._lock:
            if self._report is not None:
                return self._report
            drained = self.drain(min(timeout, 30.0))["drained"]
            ck = self.rt.checkpointer
            if ck is None:
                report = {**{s.value: [] for s in SAVE_OUTCOMES}, "seconds": 0.0,
                          "checkpoints": "off"}
            else:
                report = ck.shutdown(timeout=timeout)
            report["drained"] = drained
            self._report = report
            self._publish(report)
            return report

    def _publish(self, report: dict) -> None:
        from server.checkpoints.files import publish_file

        counts = {s.value: len(report[s]) for s in SAVE_OUTCOMES}
        reasons = sorted({r.get("reason") or "?" for r in report[SessionStatus.REFUSED]})
        try:
            publish_file(self.state_dir / "stop_report.json",
                         json.dumps(report, indent=1, sort_keys=True).encode())
        except OSError as e:
            print(f"ninfer: could not write the stop report: {e}", file=sys.stderr)
        self.rt.obs.on_event("server_stop", pid=os.getpid(), drained=report["drained"],
                             refused_reasons=",".join(reasons) or None, **counts)
        saved, already, nothing, refused = (counts[s] for s in SAVE_OUTCOMES)
        print(f"ninfer: stop report: saved {saved}, already saved {already}, nothing to save "
              f"{nothing}, refused {refused}" + (f" ({', '.join(reasons)})" if reasons else ""),
              file=sys.stderr, flush=True)


def _session_results(rows) -> list:
    from server import ctl_pb2 as pb

    return [pb.SessionResult(session=str(r.get("session") or ""), status=r.get("status", ""),
                             reason=r.get("reason") or "", generation=r.get("generation") or "",
                             bytes_written=int(r.get("bytes_written") or 0)) for r in rows]


def _servicer(life: Lifecycle):
    from server import ctl_pb2 as pb
    from server import ctl_pb2_grpc as pbg

    class Control(pbg.ControlServicer):
        def Status(self, request, context):
            rt = life.rt
            ck = rt.checkpointer
            st = ck.status() if ck is not None else {}
            store = st.get("store", {})
            running, waiting = life.busy()
            profile = rt.profile
            state = ("stopping" if life._report is not None else "draining"
                     if rt.draining else "loading" if rt.engine is None else "serving")
            return pb.StatusReply(
                state=state, pid=os.getpid(),
                model_sha256=rt.model.sha256 if rt.model is not None else "",
                profile_sha256=profile.canonical_hash() if profile is not None else "",
                fingerprint_sha256=rt.fingerprint_sha256,
                running=running, waiting=waiting,
                checkpoint_bytes=store.get("bytes_used", 0),
                checkpoint_quota_bytes=store.get("quota_bytes", 0),
                checkpoint_sessions=store.get("sessions", 0),
                live_sessions=st.get("sessions", 0), unsaved_sessions=st.get("unsaved", 0),
                saves=st.get(SessionStatus.SAVED, 0),
                refused_saves=st.get(SessionStatus.REFUSED, 0),
                restores=st.get(SessionStatus.RESTORED, 0))

        def Save(self, request, context):
            ck = life.rt.checkpointer
            rows = ck.save_all() if ck is not None and ck.engine is not None else []
            return pb.SaveReply(results=_session_results(rows))

        def Drain(self, request, context):
            return pb.DrainReply(**life.drain(request.timeout_s or 30.0))

        def Stop(self, request, context):
            r = life.stop_report(request.timeout_s or 60.0)
            if life.request_stop is not None:  # after this reply has gone out
                threading.Timer(0.2, life.request_stop).start()
            return pb.StopReply(report=pb.StopReport(
                drained=r["drained"], seconds=r["seconds"],  # its groups: the save statuses
                **{s.value: _session_results(r[s]) for s in SAVE_OUTCOMES}))

        def Import(self, request, context):
            import grpc

            from server.checkpoints.bundle import BundleError

            try:
                r = import_running(life.rt, Path(request.path),
                                   Path(request.transfer_key_path), request.principal or None)
            except BundleError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return pb.ImportReply(**r)

    return Control()


def import_running(rt, path: Path, key_path: Path, principal: str | None) -> dict:
    """`Import`: the bundle into this server's stores, checked against its exact runtime
    fingerprint."""
    from server.checkpoints.bundle import BundleError, read_transfer_key
    from server.checkpoints.transfer import publish_verified, verify_for_import

    ck = rt.checkpointer
    if ck is None or ck.engine is None:
        raise BundleError("this server has no checkpoint store, or has not loaded its model")
    key = read_transfer_key(key_path)
    b, rows = verify_for_import(path, key, ck.fingerprint, True, principal, rt.response_store)
    with b:
        if not ck.accept_import(b.principal, b.session):
            raise BundleError(f"{path}: the session is live on this server; import refused")
        r = publish_verified(b, rows, ck.store, rt.response_store, path)
    return {k: r[k] for k in ("generation", "frontier_tokens", "pages", "pages_written",
                              "responses", "head_response_id")}


def start_ctl_server(life: Lifecycle):
    """Serve the control plane on <state-dir>/ctl.sock; returns the grpc server."""
    import grpc

    from server import ctl_pb2_grpc as pbg

    path = life.state_dir / SOCKET_NAME
    if path.is_socket() or path.exists():
        path.unlink()  # a stale socket of a dead server (the state dir is ours: 0700)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="ctl"))
    pbg.add_ControlServicer_to_server(_servicer(life), server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    os.chmod(path, 0o600)
    return server


# ---- client -------------------------------------------------------------------------------
def main(argv: list[str], default_state_dir: Path) -> int:
    p = argparse.ArgumentParser(prog="ninfer ctl", description="control a running server")
    p.add_argument("command", choices=["status", "save", "drain", "stop"])
    p.add_argument("--state-dir", help="the server's state directory")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds (default 120)")
    args = p.parse_args(argv)
    import grpc
    from google.protobuf.json_format import MessageToDict

    from server import ctl_pb2 as pb
    from server import ctl_pb2_grpc as pbg

    path = Path(args.state_dir or default_state_dir) / SOCKET_NAME
    if not path.is_socket():
        print(f"ninfer ctl: no server control socket at {path}", file=sys.stderr)
        return 1
    with grpc.insecure_channel(f"unix:{path}") as ch:
        stub = pbg.ControlStub(ch)
        call = {"status": lambda: stub.Status(pb.StatusRequest(), timeout=args.timeout),
                "save": lambda: stub.Save(pb.SaveRequest(), timeout=args.timeout),
                "drain": lambda: stub.Drain(pb.DrainRequest(timeout_s=args.timeout),
                                            timeout=args.timeout + 5),
                "stop": lambda: stub.Stop(pb.StopRequest(timeout_s=args.timeout),
                                          timeout=args.timeout + 5)}[args.command]
        try:
            reply = call()
        except grpc.RpcError as e:
            print(f"ninfer ctl: {args.command} failed: {e.code().name}: {e.details()}",
                  file=sys.stderr)
            return 1
    print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True,
                                   always_print_fields_with_no_presence=True), indent=1))
    return 0


def generate(out_dir: Path = REPO) -> None:
    """Regenerate server/ctl_pb2.py, server/ctl_pb2_grpc.py and the replica service's
    server/replica_pb2*.py under `out_dir` (dev only)."""
    from grpc_tools import protoc

    for proto in ("ctl.proto", "replica.proto"):
        rc = protoc.main(["protoc", f"-I{REPO}", f"--python_out={out_dir}",
                          f"--grpc_python_out={out_dir}", str(REPO / "server" / proto)])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} ({rc})")


if __name__ == "__main__":
    if sys.argv[1:] == ["--generate"]:
        generate()
    else:
        sys.exit(main(sys.argv[1:], Path(os.environ.get("NINFER_STATE_DIR", "."))))
