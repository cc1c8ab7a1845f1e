"""`./ninfer checkpoints transfer-key|export|import`: move a session between servers.

    transfer-key [--out FILE]                   create the transfer key (0600) and print its path
    export --session KEY [--principal P] --out FILE
    import FILE [--principal P]
    replica cert|serve|push|pull ...            (server/replica_cli.py, dispatched by cli.py)

Each takes --state-dir (default: as `serve`) and --transfer-key FILE (default
<state-dir>/secrets/transfer-key). Export works whether the server runs or not. Import goes
through the running server's control socket when there is one (checked against its exact runtime
fingerprint); with the server stopped it opens the stores itself (checked against the fingerprint
the server last recorded there). A refusal exits 1 and names the file and the entry or field.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from server.checkpoints.bundle import (BundleError, create_transfer_key, default_transfer_key,
                                       read_transfer_key)


def _first_principal(state_dir: Path) -> str:
    from server.auth import KeyFileError, load_key_file

    try:
        entries = load_key_file(state_dir / "keys").entries
    except (OSError, KeyFileError) as e:
        raise BundleError(f"--principal not given and no key file to take it from: {e}") from None
    return entries[0][0]


def _export(args, state_dir: Path) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from server.checkpoints.checkpoint_store import default_io_threads
    from server.checkpoints.transfer import export_session

    key = read_transfer_key(Path(args.transfer_key or default_transfer_key(state_dir)))
    principal = args.principal or _first_principal(state_dir)
    with ThreadPoolExecutor(default_io_threads(), thread_name_prefix="ninfer-export") as pool:
        return export_session(state_dir, principal, args.session, Path(args.out), key, pool)


def _import_running(sock: Path, args, key_path: Path) -> dict | None:
    """The import through the server's control socket; None when no server answers there."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from server import ctl_pb2 as pb
    from server import ctl_pb2_grpc as pbg

    req = pb.ImportRequest(path=str(Path(args.file).resolve()),
                           transfer_key_path=str(key_path.resolve()),
                           principal=args.principal or "")
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        try:
            reply = pbg.ControlStub(ch).Import(req, timeout=args.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                return None  # a stale socket: no server
            raise BundleError(e.details()) from None
    return {"server": "running", **MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)}


def _import_stopped(args, state_dir: Path, key_path: Path) -> dict:
    from server.checkpoints.checkpoint_store import CheckpointStore, StoreBusy
    from server.checkpoints.setup import parse_size
    from server.checkpoints.transfer import expected_fingerprint, import_session
    from server.response_store import ResponseStore

    key = read_transfer_key(key_path)
    root = state_dir / "checkpoints"
    expected, complete = expected_fingerprint(root)
    try:
        store = CheckpointStore(root, quota_bytes=parse_size(args.checkpoint_quota))
    except StoreBusy:
        raise BundleError(f"{root} is held by a running server whose control socket does not "
                          "answer; stop it or retry") from None
    try:
        rstore = ResponseStore(state_dir / "responses.db")
        try:
            r = import_session(Path(args.file), key, store, rstore, expected, complete,
                               args.principal)
        finally:
            rstore.close()
    finally:
        store.close()
    r.update(server="stopped", fingerprint_checked="recorded" if complete else "code_only")
    return r


def main(argv: list[str], default_state_dir: Path) -> int:
    p = argparse.ArgumentParser(prog="ninfer checkpoints",
                                description="move a session's checkpoint and responses")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("replica", help="cert | serve | push | pull: replicate sessions over "
                                   "mutual TLS (see `replica --help`)")
    tk = sub.add_parser("transfer-key", help="create the transfer key (0600)")
    ex = sub.add_parser("export", help="write a session's bundle")
    ex.add_argument("--session", required=True, help="the session's prompt_cache_key")
    ex.add_argument("--principal", help="its principal (default: the key file's first)")
    ex.add_argument("--out", required=True, help="the bundle file to write")
    im = sub.add_parser("import", help="verify a bundle and publish it into this state dir")
    im.add_argument("file")
    im.add_argument("--principal", help="refuse a bundle of any other principal")
    im.add_argument("--checkpoint-quota", default="8G",
                    help="quota of the store when the server is stopped (default 8G)")
    im.add_argument("--timeout", type=float, default=600.0)
    for s in (tk, ex, im):
        s.add_argument("--state-dir", help="the state directory (default: as serve)")
        s.add_argument("--transfer-key", help="the transfer key file (default "
                                              "<state-dir>/secrets/transfer-key)")
    tk.add_argument("--out", help="where to create it (default: --transfer-key's default)")
    args = p.parse_args(argv)
    os.umask(0o077)  # keys, bundles and store files are the owner's alone
    state_dir = Path(args.state_dir or default_state_dir)
    try:
        if args.command == "transfer-key":
            path = create_transfer_key(Path(args.out or args.transfer_key
                                            or default_transfer_key(state_dir)))
            print(path)
            print("ninfer: copy it (mode 0600) to <state-dir>/secrets/transfer-key of both "
                  "servers, or pass --transfer-key FILE", file=sys.stderr)
            return 0
        if args.command == "export":
            result = _export(args, state_dir)
        else:
            key_path = Path(args.transfer_key or default_transfer_key(state_dir))
            sock = state_dir / "ctl.sock"
            result = _import_running(sock, args, key_path) if sock.is_socket() else None
            if result is None:
                result = _import_stopped(args, state_dir, key_path)
    except (BundleError, FileExistsError) as e:
        print(f"ninfer checkpoints {args.command}: refused: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1, sort_keys=True))
    return 0
