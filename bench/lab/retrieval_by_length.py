"""Where the served tiny-chat's retrieval breaks: the qualification's retrieval prompt (its
filler, planted line and question, lanes/qualify_phases.py) at growing lengths, on a server of
the cpu lane's model, greedy; prints the lines of filler, the prompt tokens and the answer.

    .venv/bin/python bench/lab/retrieval_by_length.py
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from lanes.qualify_phases import SECRET, retrieval_text  # noqa: E402
from tests.serverproc import start_server  # noqa: E402

LINES = (0, 2, 8, 24, 64, 128, 256, 320)  # lines of filler; the last is ~9K tokens


def main() -> int:
    srv = start_server(Path(tempfile.mkdtemp()), "--checkpoints", "off", model=None)
    try:
        h = {"Authorization": f"Bearer {srv.key}"}
        for n in LINES:
            r = httpx.post(srv.base_url + "/v1/responses", headers=h, timeout=600,
                           json={"model": "tiny-chat", "input": retrieval_text(n)[1],
                                 "max_output_tokens": 24, "temperature": 0}).json()
            ans = "".join(c.get("text", "") for it in r["output"] if it["type"] == "message"
                          for c in it["content"])
            print(n, r["usage"]["input_tokens"], repr(ans[:40]), SECRET in ans, flush=True)
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
