"""The generated gRPC modules are committed: regenerating them from server/ctl.proto and
server/replica.proto gives the same bytes (protoc output is deterministic)."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_generated_modules_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    from server.ctl import generate

    generate(tmp_path)
    for name in ("ctl_pb2.py", "ctl_pb2_grpc.py", "replica_pb2.py", "replica_pb2_grpc.py"):
        assert (tmp_path / "server" / name).read_bytes() == (REPO / "server" / name).read_bytes()


def test_client_reports_a_missing_server(tmp_path, capsys):
    from server.ctl import main

    assert main(["status", "--state-dir", str(tmp_path)], tmp_path) == 1
    assert "no server control socket" in capsys.readouterr().err
