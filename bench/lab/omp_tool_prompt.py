"""The qualification's tool turn (lanes/qualify_omp.py), outside OMP: capture the first
`POST /v1/responses` the real OMP client sends for it, then run a candidate model straight on
that request's prompt (rendered and tokenized by the server's own code), greedy, with no
constraint, and say whether it calls `read` with the file's path. A screen for a training
run (the GPU machine has no OMP), not the qualification itself.

    # here, once (OMP from npm, the server on the cpu lane): the request as OMP sends it
    .venv/bin/python bench/lab/omp_tool_prompt.py capture omp_tool_request.json
    # anywhere, a candidate's artifact (engine.io.loader.build_embedded)
    python3 bench/lab/omp_tool_prompt.py probe omp_tool_request.json --artifact tc.ninfer
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

ASK = "Read the file {f} and tell me when the train leaves."


def capture(out: Path, omp_args: list[str]) -> int:
    from lanes.qualify_omp import SYSTEM, TOOL_FILE
    from tests.omp_client import OmpClient, Provider
    from tests.recording_http import RecordingServer
    from tests.serverproc import start_server

    tmp = Path(tempfile.mkdtemp())
    srv = start_server(tmp / "state", "--checkpoints", "off", model=None)
    proxy = RecordingServer(upstream=srv.base_url)
    try:
        omp = OmpClient(tmp / "omp", [Provider("ninfer", proxy.api_url, srv.key,
                                               model="tiny-chat", max_tokens=64)])
        (omp.workdir / TOOL_FILE).write_text("The release train leaves at 16:40.\n")
        omp.run_print(ASK.format(f=TOOL_FILE), *SYSTEM, *omp_args, "--mode", "json")
    finally:
        proxy.stop()
        srv.stop()
    from engine.io.loader import load_model
    from server.chains import render_full
    from server.request_model import parse_response_request

    body = next(r for r in proxy.requests if r.path.endswith("/responses")).json()
    model = load_model(tmp / "state" / "models" / "tiny-chat.ninfer")
    req = parse_response_request(body)
    ids = render_full(model, list(req.messages), req).ids
    # the client's own system text and tools as the template takes them: what training
    # (engine/train/data.py load_client) renders some tool rows in
    client = {"system": req.messages[0]["content"] if req.messages[0]["role"] == "system"
              else "", "tools": list(req.template_tools)}
    out.write_text(json.dumps({"request": body, "ids": ids, "file": TOOL_FILE,
                               "client": client}))
    print(f"{out}: {len(ids)} prompt tokens")
    return 0


def probe(request: Path, artifact: Path, max_new: int) -> int:
    from engine.io.loader import load_model
    from engine.train.evaluate import Greedy
    model = load_model(artifact)
    captured = json.loads(request.read_text())
    ids, path = captured["ids"], captured["file"]
    g = Greedy(model, max_len=-(-len(ids) // 256) * 256 + max_new + 8)
    g.margins = margins = []
    out, _ = g(ids, max_new=max_new)
    text = model.tokenizer.decode(out)
    called = "<function=read>" in text and path in text
    # the smallest gap between the chosen token's logit and the runner-up's up to the end of
    # the call: how near a tie the call is (a served run's other chunking can flip a tie)
    end = next((i for i in range(len(out)) if "</function>" in model.tokenizer.decode(
        out[:i + 1])), len(out) - 1)
    print(json.dumps({"prompt_tokens": len(ids), "read_call_with_path": called,
                      "min_margin": round(min(margins[:end + 1]), 3),
                      "output": text[:300]}))
    return 0 if called else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("capture", "probe"))
    ap.add_argument("request", type=Path)
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--omp-args", default="", help="capture: more OMP arguments, space-separated "
                    "(e.g. '--tools read,bash')")
    a = ap.parse_args(argv)
    if a.what == "capture":
        return capture(a.request, a.omp_args.split())
    return probe(a.request, a.artifact, a.max_new)


if __name__ == "__main__":
    sys.exit(main())
