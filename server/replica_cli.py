"""`./ninfer checkpoints replica cert|serve|push|pull`: sessions copied to a replica over gRPC
with mutual TLS between pinned certificates (server/checkpoints/replica_*.py).

    cert [--out DIR]                 this side's key (0600) and certificate; prints the sha256
    serve --dir DIR --listen HOST:PORT --peer-cert FILE --pin SHA256 ...
    push --to HOST:PORT --session KEY [--principal P] --peer-cert FILE --pin SHA256
         [--max-rate MB/s]
    pull --from HOST:PORT --session KEY [--principal P] --peer-cert FILE --pin SHA256

Each takes --state-dir (default: as `serve`), --cert-dir (default <state-dir>/secrets/replica)
and --transfer-key FILE (default <state-dir>/secrets/transfer-key). `serve` has no default
address: it listens only where --listen says, and only with TLS. --peer-cert and --pin may be
given more than once (a replica that several servers push to pins each of them). A refusal
exits 1 and names the file, the session or the entry.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from server.checkpoints.bundle import BundleError, default_transfer_key, read_transfer_key
from server.checkpoints.replica_tls import PinError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer checkpoints replica",
                                description="replicate sessions over mutual TLS")
    sub = p.add_subparsers(dest="command", required=True)
    cert = sub.add_parser("cert", help="create this side's key and certificate")
    cert.add_argument("--out", help="directory (default <state-dir>/secrets/replica)")
    serve = sub.add_parser("serve", help="run the replica service")
    serve.add_argument("--dir", required=True, help="the replica directory")
    serve.add_argument("--listen", required=True, help="HOST:PORT to listen on (TLS only)")
    push = sub.add_parser("push", help="copy a session's newest generation to the replica")
    push.add_argument("--to", required=True, help="the replica's HOST:PORT")
    push.add_argument("--max-rate", type=float, default=0.0,
                      help="pace the objects sent to this many MB/s (default: no limit)")
    pull = sub.add_parser("pull", help="bring a session from the replica into this state dir")
    pull.add_argument("--from", dest="frm", required=True, help="the replica's HOST:PORT")
    pull.add_argument("--checkpoint-quota", default="8G",
                      help="quota of the store when the server is stopped (default 8G)")
    for s in (push, pull):
        s.add_argument("--session", required=True, help="the session's prompt_cache_key")
        s.add_argument("--principal", help="its principal (default: the key file's first)")
        s.add_argument("--timeout", type=float, default=3600.0)
    for s in (cert, serve, push, pull):
        s.add_argument("--state-dir", help="the state directory (default: as serve)")
        s.add_argument("--cert-dir", help="this side's key and certificate (default "
                                          "<state-dir>/secrets/replica)")
    for s in (serve, push, pull):
        s.add_argument("--transfer-key", help="the transfer key file (default "
                                              "<state-dir>/secrets/transfer-key)")
        s.add_argument("--peer-cert", action="append", default=[],
                       help="the peer's certificate file (pinned by --pin)")
        s.add_argument("--pin", action="append", default=[],
                       help="the peer certificate's sha256 fingerprint, as `cert` prints it")
    return p


def _run(args, state_dir: Path) -> dict | int:
    from server.checkpoints import replica_tls

    cert_dir = Path(args.cert_dir or state_dir / "secrets" / "replica")
    if args.command == "cert":
        made = replica_tls.make_cert(Path(args.out) if args.out else cert_dir)
        print("ninfer: give replica.crt and its sha256 to the peer (--peer-cert, --pin); "
              "replica.key stays here", file=sys.stderr)
        return made
    key_path = Path(args.transfer_key or default_transfer_key(state_dir))
    key = read_transfer_key(key_path)
    ident = replica_tls.load_identity(cert_dir, args.peer_cert, args.pin)
    if args.command == "serve":
        from server.checkpoints.replica_service import serve_forever

        host, sep, port = args.listen.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise BundleError(f"--listen {args.listen!r} is not HOST:PORT")
        return serve_forever(Path(args.dir), args.listen, key, ident)
    from server.checkpoints_cli import _first_principal

    principal = args.principal or _first_principal(state_dir)
    if args.command == "push":
        from concurrent.futures import ThreadPoolExecutor

        from server.checkpoints.checkpoint_store import default_io_threads
        from server.checkpoints.replica_client import log_progress, push

        with ThreadPoolExecutor(default_io_threads(), thread_name_prefix="ninfer-push") as pool:
            return push(state_dir, principal, args.session, args.to, ident, key, pool,
                        args.max_rate, args.timeout, log_progress)
    from server.checkpoints.replica_client import pull
    from server.checkpoints_cli import _import_running, _import_stopped

    return pull(state_dir, args.frm, ident, key, key_path, principal, args.session,
                _import_running, _import_stopped, args.timeout, args.checkpoint_quota)


def main(argv: list[str], default_state_dir: Path) -> int:
    args = _parser().parse_args(argv)
    os.umask(0o077)  # keys, certificates' directory and replica files are the owner's alone
    state_dir = Path(args.state_dir or default_state_dir)
    try:
        result = _run(args, state_dir)
    except (BundleError, PinError, FileExistsError, OSError) as e:
        print(f"ninfer checkpoints replica {args.command}: refused: {e}", file=sys.stderr)
        return 1
    if isinstance(result, int):
        return result
    print(json.dumps(result, indent=1, sort_keys=True))
    return 0
