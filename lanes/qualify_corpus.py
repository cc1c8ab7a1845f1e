"""The role corpus: fixed requests (qualification/corpus/requests.json: plain, tools, forced
tool choice, JSON schema, reasoning, continuation, fork) answered by the lane, their outputs
compared byte for byte with the recording for the same (model, plan, lane) in
qualification/corpus/golden.json. A case's output is the canonical JSON of its status, its
output items' visible content (message text, function-call names and arguments, reasoning
text) and their token ids, without the per-response ids.

Record (or re-record) the lane's entry: ./ninfer qualify --lane L --record-corpus
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from lanes.instance import REPO
from lanes.qualify_lane import LaneUnderTest, PhaseFailure

CORPUS = REPO / "qualification" / "corpus" / "requests.json"
GOLDEN = REPO / "qualification" / "corpus" / "golden.json"
GOLDEN_FORMAT = "ninfer-role-corpus-golden/1"


def corpus_key(model_sha256: str, plan: dict, lane: str) -> str:
    """The triple a recording belongs to: model artifact, kernel plan (its canonical hash),
    lane."""
    plan_sha = hashlib.sha256(json.dumps(plan, sort_keys=True, separators=(",", ":")).encode()
                              ).hexdigest()
    return f"model={model_sha256} plan={plan_sha} lane={lane}"


def _visible(item: dict) -> dict:
    t = item.get("type")
    if t == "message":
        return {"type": t, "text": "".join(c.get("text", "") for c in item.get("content", []))}
    if t == "function_call":
        return {"type": t, "name": item.get("name"), "arguments": item.get("arguments")}
    if t == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        return {"type": t, "text": "".join(p.get("text", "") for p in parts)}
    return {"type": t}


def run_corpus(lane: LaneUnderTest, corpus: Path = CORPUS) -> tuple[dict[str, str], float]:
    """Every case's output (canonical JSON) and the seconds it took."""
    cases = json.loads(corpus.read_text())["cases"]
    ids, outputs, roots = {}, {}, {}
    t0 = time.monotonic()
    for case in cases:
        # a principal for each chain (a case and the cases after it): no case reuses state
        # another chain computed, so each output is computed the same way in every run,
        # whatever the engine kept or evicted before (a reused prefix is exact in tokens but
        # not in the last bits of the state, which a near-tie under a grammar can show)
        root = roots[case["id"]] = roots[case["after"]] if case.get("after") else case["id"]
        body = dict(case["body"], prompt_cache_key=f"corpus-{case.get('after') or case['id']}")
        if case.get("after"):
            body["previous_response_id"] = ids[case["after"]]
        r = lane.respond(body, principal=f"qualify-corpus-{root}")
        ids[case["id"]] = r["id"]
        doc = {"status": r["status"], "items": [_visible(i) for i in r["output"]],
               "token_ids": lane.output_ids(r["id"])}
        outputs[case["id"]] = json.dumps(doc, sort_keys=True, ensure_ascii=False,
                                         separators=(",", ":"))
    return outputs, time.monotonic() - t0


def _load(golden: Path) -> dict:
    if not golden.exists():
        return {"format": GOLDEN_FORMAT, "recordings": {}}
    doc = json.loads(golden.read_text())
    if doc.get("format") != GOLDEN_FORMAT:
        raise PhaseFailure(f"{golden}: not a {GOLDEN_FORMAT} file")
    return doc


def record(key: str, outputs: dict[str, str], golden: Path = GOLDEN) -> None:
    doc = _load(golden)
    doc["recordings"][key] = {"recorded": time.strftime("%Y-%m-%d", time.gmtime()),
                              "cases": dict(sorted(outputs.items()))}
    tmp = golden.with_name(f".{golden.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    os.replace(tmp, golden)


def differing(outputs: dict[str, str], recorded: dict[str, str]) -> list[str]:
    """Every case whose output is not byte-identical to its recording (a case missing on
    either side counts)."""
    return sorted(c for c in set(outputs) | set(recorded) if outputs.get(c) != recorded.get(c))


def role_corpus(lane: LaneUnderTest, key: str, *, recording: bool = False,
                golden: Path = GOLDEN) -> dict:
    outputs, seconds = run_corpus(lane)
    out = {"cases": len(outputs), "corpus_seconds": round(seconds, 2), "key": key}
    if recording:
        record(key, outputs, golden)
        return {**out, "recorded": str(golden.relative_to(REPO))}
    want = _load(golden)["recordings"].get(key)
    if want is None:
        raise PhaseFailure(f"no recording for {key} in {golden.relative_to(REPO)}; record it "
                           f"with ./ninfer qualify --lane {lane.lane} --record-corpus", out)
    differ = differing(outputs, want["cases"])
    out["differ"] = differ
    if differ:
        raise PhaseFailure(f"{len(differ)} of {len(outputs)} cases differ from the recording: "
                           + ", ".join(differ), out)
    return out
