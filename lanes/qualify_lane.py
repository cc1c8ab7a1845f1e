"""The lane under qualification: its state root driven through `./ninfer lane` commands run as
separate processes (this interpreter, `python -m server.cli lane ...`), and its server reached
over loopback HTTP with the root's own key file. What `qualify`'s phases share: requests, the
request log (<root>/state/logs/requests.jsonl), the stored token ids (the SQLite store, read
only)."""
from __future__ import annotations

import json
import secrets
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from lanes.instance import REPO

PY = sys.executable
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


class PhaseFailure(Exception):
    """A phase's pass rule did not hold; the message says which and by how much, and
    `measurements` keeps what was measured before it failed."""

    def __init__(self, message: str, measurements: dict | None = None):
        super().__init__(message)
        self.measurements = measurements or {}


class LaneUnderTest:
    def __init__(self, root: Path, lane: str, *, synthetic: bool = False):
        self.root, self.lane, self.synthetic = Path(root), lane, synthetic
        self.state = self.root / "state"
        self.url: str | None = None
        self._keys: dict[str, str] = {}

    # ---- lane commands -------------------------------------------------------------------
    def command(self, *args, timeout: float = 900.0) -> subprocess.CompletedProcess:
        """`./ninfer lane ARGS --root ROOT`, as its own process; raises PhaseFailure on a
        non-zero exit, naming the command and its last output."""
        argv = [PY, "-m", "server.cli", "lane", *map(str, args), "--root", str(self.root)]
        r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            tail = (r.stdout + r.stderr).strip().splitlines()[-12:]
            raise PhaseFailure(f"`ninfer lane {' '.join(map(str, args))}` exited "
                               f"{r.returncode}: " + " | ".join(tail))
        return r

    def start(self) -> float:
        """`lane start` (this interpreter, any free port); the seconds until healthy."""
        t0 = time.monotonic()
        extra = ["--synthetic-weights"] if self.synthetic else []
        self.command("start", "--python", PY, "--port", "0", *extra)
        self.refresh()
        return time.monotonic() - t0

    def stop(self) -> float:
        t0 = time.monotonic()
        self.command("stop")
        self.url = None
        return time.monotonic() - t0

    def status(self) -> dict:
        return json.loads(self.command("status", "--json").stdout)

    def refresh(self) -> dict:
        st = self.status()
        srv = st["server"]
        if srv is None or srv["health"] != 200:
            raise PhaseFailure(f"the lane's server is not healthy: {srv}")
        self.url = srv["url"]
        return st

    def server_pid(self) -> int:
        return json.loads((self.root / "run" / "server.json").read_text())["pid"]

    # ---- principals ----------------------------------------------------------------------
    def key(self, principal: str = "default") -> str:
        """The bearer key of `principal`: the key file's own first principal is "default"; any
        other is added to the key file (the server rereads it when it changes)."""
        if principal in self._keys:
            return self._keys[principal]
        path = self.state / "keys"
        lines = path.read_text().splitlines()
        for line in lines:
            parts = line.split()
            if len(parts) in (2, 3) and parts[0] == principal:
                self._keys[principal] = parts[1]
                return parts[1]
        if principal == "default":
            raise PhaseFailure(f"{path} has no default principal")
        key = f"nk-{principal}-{secrets.token_hex(16)}"
        path.write_text("\n".join(lines + [f"{principal} {key}"]) + "\n")
        time.sleep(1.2)  # the server checks its key file at most once a second
        self._keys[principal] = key
        return key

    # ---- HTTP ----------------------------------------------------------------------------
    def call(self, method: str, path: str, body: dict | None = None, *,
             principal: str = "default", timeout: float = 900.0) -> tuple[int, dict]:
        if self.url is None:
            raise PhaseFailure("the lane's server is not running")
        req = urllib.request.Request(
            self.url + path, method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.key(principal)}",
                     "Content-Type": "application/json"})
        try:
            with _DIRECT.open(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read() or b"{}")
            except ValueError:
                return e.code, {}

    def respond(self, body: dict, principal: str = "default") -> dict:
        """POST /v1/responses; a non-200 answer fails the phase with the server's error."""
        code, out = self.call("POST", "/v1/responses", {"model": self.model_id(), **body},
                              principal=principal)
        if code != 200:
            raise PhaseFailure(f"POST /v1/responses answered {code}: {out.get('error', out)}")
        return out

    def model_id(self) -> str:
        if not hasattr(self, "_model_id"):
            code, out = self.call("GET", "/v1/models")
            if code != 200 or not out.get("data"):
                raise PhaseFailure(f"GET /v1/models answered {code}")
            self._model_id = out["data"][0]["id"]
        return self._model_id

    # ---- what the server recorded --------------------------------------------------------
    def log(self, event: str | None = None) -> list[dict]:
        path = self.state / "logs" / "requests.jsonl"
        if not path.exists():
            return []
        recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        return [r for r in recs if event is None or r.get("event") == event]

    def done(self, response_id: str) -> dict:
        for rec in self.log("request_done"):
            if rec.get("request_id") == response_id:
                return rec
        raise PhaseFailure(f"no request_done record for {response_id}")

    def output_ids(self, response_id: str) -> list[int]:
        """The token ids the store holds for a response's output items, in order."""
        import numpy as np

        db = sqlite3.connect(f"file:{self.state / 'responses.db'}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT token_ids FROM output_items WHERE response_id = ? "
                              "ORDER BY position", (response_id,)).fetchall()
        finally:
            db.close()
        return [int(t) for (blob,) in rows if blob for t in np.frombuffer(blob, "<i4")]

    def saved_up_to(self, tokens: int, timeout: float = 120.0) -> None:
        """Until a checkpoint holding at least `tokens` tokens is saved (autosave is async)."""
        deadline = time.monotonic() + timeout
        while not any(r.get("frontier_tokens", 0) >= tokens
                      for r in self.log("checkpoint_saved")):
            if time.monotonic() > deadline:
                raise PhaseFailure(f"no checkpoint of {tokens} tokens within {timeout:.0f} s")
            time.sleep(0.2)


def fed(r: dict) -> int:
    """The tokens a response leaves in its session's state (a last sampled token that ended
    the response at its budget was never fed back)."""
    u = r["usage"]
    return u["input_tokens"] + u["output_tokens"] - (r["status"] == "incomplete")
