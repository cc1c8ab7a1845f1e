"""The OMP phases of `./ninfer qualify`: the real Oh My Pi client (pinned in tests/omp, run by
its own Bun), unmodified and unassisted, against the lane's server. Nothing sits between them:
no proxy rewrites a request or a terminal event.

    agent_protocol  `omp -p "Say hello." --mode json` exits 0 and its reply ends on its own
                    (stopReason "stop": the server's response.completed)
    tool_turn       asked to read a file, OMP runs its typed `read` tool on the model's call
                    with that path, chains the output and the turn ends on its own

OMP runs in a HOME and working directory of its own, with an environment built from nothing;
its HTTP(S) proxy is a closed loopback port, so nothing can leave the machine."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

from lanes.instance import REPO
from lanes.qualify_lane import LaneUnderTest, PhaseFailure

OMP_DIR = REPO / "tests" / "omp"
BUN = OMP_DIR / "node_modules" / "@oven" / "bun-linux-x64" / "bin" / "bun"
OMP_CLI = OMP_DIR / "node_modules" / "@oh-my-pi" / "pi-coding-agent" / "dist" / "cli.js"
SYSTEM = ("--system-prompt", "You are a terse coding agent.")
TOOL_FILE = "notes_for_review.txt"


def omp_version() -> str | None:
    """The installed OMP's version (None: not installed here)."""
    pkg = OMP_CLI.parent.parent / "package.json"
    try:
        return json.loads(pkg.read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Omp:
    def __init__(self, lane: LaneUnderTest, root: Path, tools: tuple = ()):
        from server import omp_config

        if omp_version() is None or not BUN.is_file():
            raise PhaseFailure(f"OMP is not installed in {OMP_DIR} (npm ci --prefix tests/omp "
                               f"--ignore-scripts installs the pinned client)")
        self.home, self.work = root / "home", root / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        provider = omp_config.Provider("ninfer", lane.url + "/v1", lane.key(),
                                       lane.model_id(), 32768, 96)
        omp_config.write_config(self.home / ".omp" / "agent", [provider], compaction=False)
        self.model = f"ninfer/{lane.model_id()}"
        # the tools the lane's profile qualifies its model with (agent_tools; none: all)
        self.tools = ("--tools", ",".join(tools)) if tools else ()
        dead = f"http://127.0.0.1:{_closed_port()}"
        self.env = {"HOME": str(self.home), "PATH": f"{BUN.parent}:/usr/bin:/bin",
                    "LANG": "C.UTF-8", "TMPDIR": str(root), "NO_COLOR": "1", "TERM": "dumb",
                    "NO_PROXY": "127.0.0.1,localhost,::1", "no_proxy": "127.0.0.1,localhost,::1"}
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            self.env[var] = self.env[var.lower()] = dead

    def turn(self, prompt: str, timeout: float = 600.0) -> tuple[int | None, list[dict], str]:
        argv = [str(BUN), str(OMP_CLI), "--model", self.model, "-p", prompt, *SYSTEM,
                *self.tools, "--mode", "json"]
        proc = subprocess.Popen(argv, cwd=self.work, env=self.env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            code = None
        frames = []
        for line in out.splitlines():
            if line.startswith("{"):
                try:
                    frames.append(json.loads(line))
                except ValueError:
                    pass
        return code, frames, err[-600:]


def _last_assistant(frames: list[dict]) -> dict:
    for f in reversed(frames):
        if f.get("type") == "agent_end":
            for m in reversed(f.get("messages", [])):
                if m.get("role") == "assistant":
                    return m
    return {}


def agent_protocol(lane: LaneUnderTest, profile, tmp: Path) -> dict:
    omp = Omp(lane, tmp / "omp-protocol", profile.agent_tools)
    t0 = time.monotonic()
    code, frames, err = omp.turn("Say hello.")
    reply = _last_assistant(frames)
    text = "".join(c.get("text", "") for c in reply.get("content", []) if isinstance(c, dict))
    out = {"omp_exit": code, "stop_reason": reply.get("stopReason"), "reply_chars": len(text),
           "seconds": round(time.monotonic() - t0, 2), "frames": len(frames)}
    if code != 0:
        raise PhaseFailure(f"omp exited {code}: {err.strip()[-300:]}", out)
    if reply.get("stopReason") != "stop":
        raise PhaseFailure(f"the reply did not end on its own (stopReason "
                           f"{reply.get('stopReason')!r}: the model reached its output budget)",
                           out)
    return out


def tool_turn(lane: LaneUnderTest, profile, tmp: Path) -> dict:
    omp = Omp(lane, tmp / "omp-tool", profile.agent_tools)
    (omp.work / TOOL_FILE).write_text("The release train leaves at 16:40 from platform 3.\n")
    code, frames, err = omp.turn(f"Read the file {TOOL_FILE} and tell me when the train "
                                 f"leaves.")
    calls = [f for f in frames if f.get("type") == "tool_execution_end"]
    starts = [f for f in frames if f.get("type") == "tool_execution_start"]
    reply = _last_assistant(frames)
    args = [(f.get("toolName"), f.get("args", f.get("arguments", {}))) for f in starts]
    out = {"omp_exit": code, "omp_tools": list(profile.agent_tools) or "all",
           "tools_run": [f.get("toolName") for f in calls],
           "calls": [{"tool": n, "args": json.dumps(a)[:200]} for n, a in args],
           "stop_reason": reply.get("stopReason")}
    read = [a for n, a in args if n == "read" and TOOL_FILE in json.dumps(a)]
    if code != 0:
        raise PhaseFailure(f"omp exited {code}: {err.strip()[-300:]}", out)
    if not read:
        raise PhaseFailure(f"the model did not call `read` with {TOOL_FILE} (calls: "
                           f"{[(c['tool'], c['args'][:80]) for c in out['calls']] or 'none'})",
                           out)
    if reply.get("stopReason") != "stop":
        raise PhaseFailure(f"the turn after the tool did not end on its own (stopReason "
                           f"{reply.get('stopReason')!r})", out)
    return out
