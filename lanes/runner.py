"""The managed server process of a lane root: start detached, stop gracefully, report.

`start` runs the current instance's server in a new session, its output appended to
<root>/run/server.log, and records it in <root>/run/server.json (pid, the kernel's start time
of that pid, so that a reused pid is never taken for it, instance, port, URL). The command is
`<instance>/ninfer serve --lane L --state-dir <root>/state`, or, with a Python that already
has the locked requirements (`--python`), `PY -m server.cli serve ...` run inside the instance
(its directory first on sys.path, so the instance's code is what runs). `stop` is SIGTERM: the
server's graceful stop drains, saves every live session to its checkpoints and exits."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from lanes.cli import EX_CONFIG
from lanes.instance import LaneError
from server.checkpoints.files import publish_file

_LISTENING = re.compile(r"listening on (http://\S+)")


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (None: no such process, or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def record(root) -> dict | None:
    """The recorded server when it still runs (a stale record is removed), else None."""
    path = root.run / "server.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    if _proc_start(info["pid"]) == info["start_time"]:
        return info
    path.unlink(missing_ok=True)
    return None


def health(url: str | None, timeout: float = 2.0) -> int | str:
    """GET <url>/health: its status code, or why there is none."""
    if not url:
        return "no URL yet"
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with direct.open(url + "/health", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError) as e:
        return f"unreachable ({getattr(e, 'reason', e)})"


def _log_tail(path: Path, offset: int, lines: int = 25) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def start(root, iid: str, lane: str, *, python: str | None = None, port: int | None = None,
          timeout: float = 600.0, synthetic: bool = False) -> dict:
    """Start the server of instance `iid` (the current one: the caller holds the root's lock)
    and wait until /health answers 200. `synthetic`: serve random weights of the lane's shapes
    (`serve --synthetic-weights`), kept in the record so that a restart does the same."""
    inst = root.instance(iid)
    cmd = [python, "-m", "server.cli"] if python else [str(root.path / "current" / "ninfer")]
    cmd += ["serve", "--lane", lane, "--state-dir", str(root.state)]
    if port is not None:
        cmd += ["--port", str(port)]
    if synthetic:
        cmd += ["--synthetic-weights"]
    root.run.mkdir(exist_ok=True)
    log = root.run / "server.log"
    with open(log, "ab") as out:
        out.write(f"--- ninfer lane start {time.strftime('%Y-%m-%dT%H:%M:%S')} instance "
                  f"{iid} ---\n".encode())
        out.flush()
        offset = out.tell()
        try:
            proc = subprocess.Popen(cmd, cwd=inst, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise LaneError(f"cannot run {cmd[0]}: {e.strerror}", EX_CONFIG) from None
    info = {"pid": proc.pid, "start_time": _proc_start(proc.pid), "instance": iid,
            "lane": lane, "python": python, "port": port, "synthetic": synthetic, "url": None,
            "log": str(log),
            "started_at": time.time()}
    _publish(root, info)
    deadline = time.monotonic() + timeout
    while True:
        code = proc.poll()
        if code is not None:
            (root.run / "server.json").unlink(missing_ok=True)
            tail = _log_tail(log, offset)
            raise LaneError(f"the server exited with status {code} before it was healthy:\n"
                            f"{tail}", EX_CONFIG if code == EX_CONFIG else 1)
        if info["url"] is None:
            m = _LISTENING.search(_log_tail(log, offset, 200))
            if m:
                info["url"] = m.group(1).replace("://localhost:", "://127.0.0.1:")
                _publish(root, info)
        if health(info["url"]) == 200:
            return info
        if time.monotonic() > deadline:
            raise LaneError(f"the server (pid {proc.pid}) is not healthy after {timeout:.0f} s;"
                            f" it still runs: see {log}, `./ninfer lane stop` to stop it")
        time.sleep(0.2)


def _publish(root, info: dict) -> None:
    publish_file(root.run / "server.json", json.dumps(info, sort_keys=True).encode())


def stop(root, timeout: float = 180.0) -> dict | None:
    """SIGTERM the recorded server and wait for it to exit; the record it had (None: none
    ran). A server still saving after `timeout` is left running (LaneError)."""
    info = record(root)
    if info is None:
        return None
    try:
        os.kill(info["pid"], signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while _proc_start(info["pid"]) == info["start_time"]:
        if time.monotonic() > deadline:
            raise LaneError(f"the server (pid {info['pid']}) is still stopping after "
                            f"{timeout:.0f} s (saving sessions?); run `./ninfer lane stop` "
                            f"again to keep waiting")
        time.sleep(0.1)
    (root.run / "server.json").unlink(missing_ok=True)
    return info


def stop_report(root) -> str:
    """One line from the server's last stop report (state/stop_report.json)."""
    try:
        r = json.loads((root.state / "stop_report.json").read_text())
    except (FileNotFoundError, ValueError):
        return "no stop report"
    return ", ".join(f"{k.replace('_', ' ')} {len(r.get(k, []))}"
                     for k in ("saved", "already_saved", "nothing_to_save", "refused"))
