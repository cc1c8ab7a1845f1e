"""Drive the real Oh My Pi (OMP) coding agent, pinned in tests/omp, against a local server.

OMP runs under Bun from `tests/omp/node_modules`, installed by `npm ci` with install scripts off
(tests/omp/README.md says why). Each client gets its own HOME holding `.omp/agent/models.yml` and
`config.yml`, an empty working directory, and an environment built from nothing, so neither the
developer's OMP setup nor this repository leaks into a run. Its HTTP(S)_PROXY is a decoy
(`OmpClient.egress`): anything OMP tries to reach beyond loopback is refused there and recorded.
"""
from __future__ import annotations

from server import omp_config  # noqa: E402  (the code behind ./ninfer omp-config)

import hashlib
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pytest

from tests.recording_http import RecordingServer

REPO = Path(__file__).resolve().parent.parent
OMP_DIR = REPO / "tests" / "omp"
NODE_MODULES = OMP_DIR / "node_modules"
BUN = NODE_MODULES / "@oven" / "bun-linux-x64" / "bin" / "bun"
OMP_CLI = NODE_MODULES / "@oh-my-pi" / "pi-coding-agent" / "dist" / "cli.js"
STAMP = NODE_MODULES / ".ninfer-lock-sha256"  # the lock's sha256, written after a good install
OMP_VERSION = "18.2.3"

# ---------------------------------------------------------------------------------------------
# Installation


def lock_digest() -> str:
    return hashlib.sha256((OMP_DIR / "package-lock.json").read_bytes()).hexdigest()


def is_installed() -> bool:
    return (STAMP.is_file() and STAMP.read_text().strip() == lock_digest()
            and BUN.is_file() and OMP_CLI.is_file())


def ensure_installed(timeout: float = 900.0) -> float:
    """Install the pinned OMP with `npm ci` unless node_modules already matches the lock.

    Returns the seconds spent installing (0.0 when nothing was done). Raises RuntimeError and
    never skips: a test that needs OMP fails when OMP cannot be had.
    """
    if is_installed():
        return 0.0
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not on PATH: the OMP client tests need Node.js and npm to "
                           "install tests/omp (npm ci --prefix tests/omp)")
    STAMP.unlink(missing_ok=True)
    t0 = time.monotonic()
    # --ignore-scripts repeats tests/omp/.npmrc on purpose: no package's install script may run.
    cmd = [npm, "ci", "--prefix", str(OMP_DIR), "--ignore-scripts", "--no-audit", "--no-fund"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    version = subprocess.run([str(BUN), str(OMP_CLI), "--version"], capture_output=True,
                             text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/"})
    if version.returncode != 0 or OMP_VERSION not in version.stdout:
        raise RuntimeError(f"the installed OMP does not run (rc={version.returncode}):\n"
                           f"{version.stdout}\n{version.stderr}")
    STAMP.write_text(lock_digest() + "\n")
    return time.monotonic() - t0


@pytest.fixture(scope="session")
def omp_install() -> float:
    """OMP installed and runnable; the value is the seconds the install took (0.0: was there)."""
    return ensure_installed()


# ---------------------------------------------------------------------------------------------
# Configuration


def Provider(id: str, base_url: str, api_key: str, model: str = "tiny",  # noqa: N802
             context_window: int = 32768, max_tokens: int = 16) -> omp_config.Provider:
    """The provider `./ninfer omp-config` writes, with a short max_tokens: the tiny model's
    gibberish stays short."""
    return omp_config.Provider(id, base_url, api_key, model, context_window, max_tokens)


# ---------------------------------------------------------------------------------------------
# Running


@dataclass(frozen=True)
class OmpResult:
    argv: tuple[str, ...]
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float

    def frames(self) -> list[dict]:
        """stdout as JSON lines (`--mode json`)."""
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]

    def describe(self) -> str:
        return (f"omp exited {self.returncode} after {self.seconds:.1f}s\n"
                f"--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}")


class OmpClient:
    """OMP in its own HOME and working directory under `root`, pointed at `providers`."""

    def __init__(self, root: Path, providers: Sequence[Provider], *, stateful: bool = False,
                 modules: Path = NODE_MODULES, **config):
        """`modules`: the node_modules OMP and Bun run from (another OMP version's install,
        tests/omp_versions.py); the pinned one by default."""
        default = providers[0]
        self.bun = modules / BUN.relative_to(NODE_MODULES)
        self.cli = modules / OMP_CLI.relative_to(NODE_MODULES)
        self.home, self.workdir = root / "home", root / "work"
        agent = self.home / ".omp" / "agent"
        agent.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Compaction off: the tiny model never stops by itself, each turn ends `incomplete`,
        # which OMP takes for "out of room" and would compact and resend.
        config.setdefault("compaction", False)
        omp_config.write_config(agent, providers, **config)  # what `./ninfer omp-config` writes
        self.model_arg = f"{default.id}/{default.model}"
        self.egress = RecordingServer(status=502)
        self.env = {"HOME": str(self.home), "PATH": f"{self.bun.parent}:/usr/bin:/bin",
                    "LANG": "C.UTF-8", "TMPDIR": str(root), "NO_COLOR": "1", "TERM": "dumb",
                    "NO_PROXY": "127.0.0.1,localhost,::1", "no_proxy": "127.0.0.1,localhost,::1"}
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            self.env[var] = self.env[var.lower()] = self.egress.base_url
        if stateful:
            self.env["PI_OPENAI_STATEFUL"] = "1"

    def argv(self, *args: str) -> list[str]:
        return [str(self.bun), str(self.cli), "--model", self.model_arg, *args]

    # Turn timeouts are generous: OMP's eleven tool definitions render to ~13.6K prompt tokens,
    # which the tiny model prefills on CPU once per server (later turns reuse that system turn).
    def run_print(self, prompt: str, *extra: str, timeout: float = 300.0) -> OmpResult:
        """One non-interactive turn, `omp -p PROMPT [extra]`, with stdin from /dev/null."""
        argv = self.argv("-p", prompt, *extra)
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: OMP and any children it started
            out, err = proc.communicate()
            code = None
        return OmpResult(tuple(argv), code, out, err, time.monotonic() - t0)

    def rpc(self, *extra: str) -> OmpRpc:
        return OmpRpc(self.argv("--mode", "rpc", *extra), self.workdir, self.env)

    def close(self) -> None:
        self.egress.stop()


_DIALOGS = {"select", "confirm", "input", "editor"}


class OmpRpc:
    """`omp --mode rpc`: commands as JSON lines on stdin; responses and events on stdout.

    OMP first writes {"type": "ready"}. {"id", "type": "prompt", "message"} is acknowledged at
    once by {"type": "response", "command": "prompt", "id", "success"}; the turn's events follow
    (agent_start, turn_start, message_start/update/end, turn_end) and it has ended when
    {"type": "agent_end", "messages"} arrives. A failed turn ends the same way; its last
    assistant message has stopReason "error" and an errorMessage. Closing stdin ends OMP.
    """

    def __init__(self, argv: list[str], cwd: Path, env: dict):
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     bufsize=1, start_new_session=True)
        self.frames: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        self.seen: list[dict] = []
        self._ids = 0
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.strip():
                try:
                    self.frames.put(json.loads(line))
                except ValueError:
                    self.frames.put({"type": "_unparsed", "line": line})
        self.frames.put(None)  # stdout closed

    def next_frame(self, deadline: float) -> dict:
        try:
            frame = self.frames.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("omp --mode rpc sent nothing before the deadline:\n"
                               + "".join(self.stderr)[-4000:]) from None
        if frame is None:
            raise EOFError(f"omp --mode rpc closed stdout (rc={self.proc.poll()}):\n"
                           + "".join(self.stderr)[-4000:])
        self.seen.append(frame)
        if frame.get("type") == "extension_ui_request" and frame.get("method") in _DIALOGS:
            # Nobody is there to answer a dialog: cancel it rather than let the turn hang.
            self.send({"type": "extension_ui_response", "id": frame["id"], "cancelled": True})
        return frame

    def wait_for(self, kind: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while (frame := self.next_frame(deadline)).get("type") != kind:
            pass
        return frame

    def send(self, command: dict) -> str:
        if "id" not in command and command["type"] != "extension_ui_response":
            self._ids += 1
            command["id"] = f"c{self._ids}"
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return command.get("id", "")

    def prompt(self, message: str, timeout: float = 300.0) -> list[dict]:
        """Send one prompt; return every frame up to and including its agent_end."""
        deadline = time.monotonic() + timeout
        cid = self.send({"type": "prompt", "message": message})
        frames: list[dict] = []
        while True:
            frames.append(frame := self.next_frame(deadline))
            if frame.get("type") == "response" and frame.get("id") == cid \
                    and not frame.get("success"):
                raise RuntimeError(f"OMP refused the prompt: {frame}")
            if frame.get("type") == "agent_end":
                return frames

    def close(self, timeout: float = 20.0) -> int:
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            return self.proc.wait()

    def __enter__(self) -> OmpRpc:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def last_assistant(frames: list[dict]) -> dict:
    """The final assistant message of a turn, from its frames (the last is agent_end)."""
    end = next(f for f in reversed(frames) if f.get("type") == "agent_end")
    return next(m for m in reversed(end["messages"]) if m.get("role") == "assistant")
