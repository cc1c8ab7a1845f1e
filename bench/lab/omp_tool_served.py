"""The qualification's tool turn through the real server: the request OMP sent (a capture of
bench/lab/omp_tool_prompt.py), replayed N times with a fresh working directory and date in
its reminder, each after a "Say hello." on the same prefix (so the prefix cache serves part
of it, as in a session), and the path of each `read` call printed. Shows what sampling does
to the call: OMP names no temperature, so the model's own default applies.

    .venv/bin/python bench/lab/omp_tool_served.py CAPTURE ARTIFACT [N] [--temperature T]
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    import httpx

    from tests.serverproc import start_server

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("capture", type=Path)
    ap.add_argument("artifact")
    ap.add_argument("n", type=int, nargs="?", default=8)
    ap.add_argument("--temperature", type=float, help="send this temperature (default: none)")
    a = ap.parse_args(argv)
    cap = json.loads(a.capture.read_text())
    srv = start_server(Path(tempfile.mkdtemp()) / "state", "--checkpoints", "off",
                       model=a.artifact)
    headers = {"Authorization": f"Bearer {srv.key}"}

    def ask(body: dict) -> str:
        if a.temperature is not None:
            body = dict(body, temperature=a.temperature)
        r = httpx.post(srv.base_url + "/v1/responses", json=dict(body, stream=False),
                       headers=headers, timeout=600)
        r.raise_for_status()
        calls = [o for o in r.json()["output"] if o["type"] == "function_call"]
        return json.loads(calls[0]["arguments"]).get("path", "") if calls else ""

    rng, right = random.Random(3), 0
    try:
        for i in range(a.n):
            body = copy.deepcopy(cap["request"])
            d = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
            w = "/tmp/tmp" + "".join(rng.choice("abcdefghij0123456789_") for _ in range(8))
            first = body["input"][0]["content"][0]
            first["text"] = re.sub(r"Today: [0-9-]+; current working directory: '[^']*'",
                                   f"Today: {d}; current working directory: '{w}/work'",
                                   first["text"])
            body["prompt_cache_key"] = f"k{i}"
            hello = copy.deepcopy(body)
            hello["input"][0]["content"][-1]["text"] = "Say hello."
            ask(hello)
            path = ask(body)
            right += path == cap["file"]
            print(i, repr(path), flush=True)
    finally:
        srv.stop()
    print(json.dumps({"right": right, "n": a.n, "temperature": a.temperature}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
