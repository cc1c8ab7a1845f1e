"""Start the real server as a subprocess on a loopback socket, for tests."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    state_dir: Path
    key: str
    log: list[str] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def startup_phases(self, wait_s: float = 30.0) -> dict:
        """The `startup phases:` line the server prints once ready (server/model_load.py).
        The server answers as ready a moment before it prints the line, and the log reaches
        `log` through a reader thread, so the line is waited for (up to `wait_s`)."""
        deadline = time.monotonic() + wait_s
        while True:
            for line in list(self.log):
                if "ninfer: startup phases: " in line:
                    return json.loads(line.split("ninfer: startup phases: ", 1)[1])
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise LookupError("no startup phases line:\n" + "".join(self.log))
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def read_key(key_file: Path, principal: str = "default") -> str:
    for line in key_file.read_text().splitlines():
        parts = line.split()
        if len(parts) in (2, 3) and parts[0] == principal:  # `<principal> <key> [admin]`
            return parts[1]
    raise LookupError(principal)


# The model the server tests run on: the random embedded `tiny` they were written against (its
# outputs are long and never end on their own). The CPU lane's own default is the trained
# `tiny-chat`; pass model=None to serve the lane's model.
TEST_MODEL = "embedded:tiny"


def start_server(state_dir: Path, *extra: str, timeout: float = 600.0,
                 wait_ready: bool = True, principal: str | None = None,
                 wrap: tuple[str, ...] = (), env: dict | None = None,
                 model: str | None = TEST_MODEL) -> ServerProcess:
    """`wrap`: a command prefix that execs the server (the process keeps its pid). `model`
    becomes `--model` unless `extra` names a model, a bundle or synthetic weights itself."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    if model is not None and not {"--model", "--bundle", "--synthetic-weights"} & set(extra):
        extra = ("--model", model, *extra)
    cmd = [*wrap, sys.executable, "-m", "server.cli", "serve", "--port", "0",
           "--state-dir", str(state_dir), *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    port_box: list[int] = []

    def pump():
        for line in proc.stdout:
            log.append(line)
            m = re.search(r"listening on http://[^:]+:(\d+)", line)
            if m:
                port_box.append(int(m.group(1)))

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not port_box:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(log))
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port_box[0]}"
    key_file = state_dir / "keys"
    for a in extra:
        if a.startswith("--key-file="):
            key_file = Path(a.split("=", 1)[1])
    if "--key-file" in extra:
        key_file = Path(extra[list(extra).index("--key-file") + 1])
    if principal is None:  # the first principal of the key file
        principal = key_file.read_text().split()[0]
    server = ServerProcess(proc, base, state_dir, read_key(key_file, principal), log)
    if wait_ready:
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError("server did not become ready:\n" + "".join(log))
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    return server
