"""Driving `./ninfer lane` and the server it runs, for tests/test_lane_lifecycle.py: every
lane command as `python -m server.cli lane ...` (this interpreter, this tree), the server's
answers and its request log (<root>/state/logs/requests.jsonl)."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.serverproc import REPO, read_key

PY = sys.executable
SESSION = "lane-session-1"
LANE_MODEL = "tiny-chat"  # what `lane start` serves: the CPU lane's own model


def lane(*args, cwd=REPO, timeout=600, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "server.cli", "lane", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)


def ok(*args, **kw) -> subprocess.CompletedProcess:
    r = lane(*args, **kw)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def start_through_the_script(root) -> bool:
    """`lane start` without --python: the instance's own `./ninfer`, its `.venv` linked to
    this interpreter's venv when that venv's stamp matches the lock (False, nothing done,
    when it does not: the script would build a venv from the network)."""
    venv = Path(sys.prefix)
    lock = hashlib.sha256((REPO / "requirements.lock").read_bytes()).hexdigest()
    stamp = venv / ".ninfer-stamp"
    if not stamp.is_file() or f"requirements.lock={lock} py={platform.python_version()}" \
            not in stamp.read_text().splitlines():
        return False
    (Path(root) / "current" / ".venv").symlink_to(venv)
    ok("start", "--root", root, "--port", "0", env=dict(os.environ, NINFER_PYTHON=PY))
    return True


def wait_gone(pid: int, timeout: float = 60.0) -> None:
    """Until `pid` has exited (a zombie counts: nothing may reap it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    raise AssertionError(f"pid {pid} still runs")


def status(root) -> dict:
    return json.loads(ok("status", "--root", root, "--json").stdout)


def ask(root, text, prev=None, n=8) -> dict:
    st = status(root)
    assert st["server"]["health"] == 200 and st["server"]["is_current"], st
    body = {"model": LANE_MODEL, "input": text, "max_output_tokens": n, "temperature": 0,
            "prompt_cache_key": SESSION}
    if prev is not None:
        body["previous_response_id"] = prev["id"]
    key = read_key(Path(root) / "state" / "keys")
    r = httpx.post(st["server"]["url"] + "/v1/responses", json=body, timeout=600,
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


def fed(r) -> int:
    u = r["usage"]
    return u["input_tokens"] + u["output_tokens"] - (r["status"] == "incomplete")


def done_record(root, response_id) -> dict:
    for line in (Path(root) / "state" / "logs" / "requests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("request_id") == response_id and rec["event"] == "request_done":
            return rec
    raise LookupError(response_id)


def last_restore(root) -> dict:
    lines = (Path(root) / "state" / "logs" / "requests.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if json.loads(x)["event"] == "checkpoint_restore"][-1]


def turn(root, text, prev) -> tuple[dict, tuple]:
    """A response continuing `prev`, and (path, checkpoint, cached_tokens) from the log."""
    r = ask(root, text, prev=prev)
    rec = done_record(root, r["id"])
    return r, (rec["path"], rec["checkpoint"], rec["cached_tokens"])


def serving(root, current, previous) -> None:
    st = status(root)
    assert (st["current"], st["previous"], st["server"]["instance"]) == (current, previous,
                                                                          current)


def chain_intact(root, responses) -> None:
    st = status(root)
    key = read_key(Path(root) / "state" / "keys")
    for r in responses:
        got = httpx.get(st["server"]["url"] + f"/v1/responses/{r['id']}", timeout=60,
                        headers={"Authorization": f"Bearer {key}"})
        assert got.status_code == 200 and got.json()["output"] == r["output"], got.text


PROMPT = "Review these entries:\n" + "\n".join(
    f"{i}. parse tree vector merge cache {i * 37 % 101}" for i in range(40))


def saved_up_to(root, tokens: int, timeout: float = 60.0) -> None:
    """Wait for a checkpoint of the session holding `tokens` tokens (autosave is async)."""
    deadline = time.monotonic() + timeout
    log = Path(root) / "state" / "logs" / "requests.jsonl"
    while not any(rec["event"] == "checkpoint_saved" and rec["frontier_tokens"] >= tokens
                  for rec in map(json.loads, log.read_text().splitlines())):
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.2)
