"""Where the served tiny-chat's retrieval breaks: the qualification's retrieval prompt (its
filler, planted line and question, lanes/qualify_phases.py) at growing lengths, on a server of
the cpu lane's model, greedy; prints the lines of filler, the prompt tokens and the answer.

    .venv/bin/python bench/lab/retrieval_by_length.py
    python3 bench/lab/retrieval_by_length.py --artifact tiny-chat.ninfer   # no server

With --artifact the prompts go straight to the model's forward (engine.train.evaluate's greedy
loop over a contiguous cache, the same chat template), for a candidate that is not installed,
on any backend (the GPU training run uses it).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lanes.qualify_phases import SECRET, retrieval_text  # noqa: E402

LINES = (0, 2, 8, 24, 64, 128, 256, 311, 320)  # lines of filler; 311 is the qualification


def direct(artifact: Path) -> int:
    from engine.io.loader import load_model
    from engine.train.data import _render
    from engine.train.evaluate import Greedy

    model = load_model(artifact)
    g = Greedy(model, max_len=10240)
    for n in LINES:
        ids = model.tokenizer.encode(_render("", [{"role": "user",
                                                   "content": retrieval_text(n)[1]}], None, False))
        out, _ = g(ids, max_new=24)
        ans = model.tokenizer.decode(out).removesuffix("<|im_end|>")
        print(n, len(ids), repr(ans[:40]), SECRET in ans, flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", type=Path, help="run the model in-process, no server")
    args = ap.parse_args(argv)
    if args.artifact:
        return direct(args.artifact)
    import httpx

    from tests.serverproc import start_server

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
