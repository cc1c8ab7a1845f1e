"""A lane with [speculative] on, through the real server: the engine runs verify passes, and the
request log and /metrics carry their counts (slow: a server start compiles the cpu lane)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serverproc import REPO, start_server


@pytest.mark.slow
def test_speculative_lane_serves_and_counts(tmp_path):
    lane = tmp_path / "cpu-spec.toml"
    lane.write_text((REPO / "lanes" / "profiles" / "cpu.toml").read_text()
                    + '\n[speculative]\nmethod = "prompt_lookup"\ndraft_tokens = 4\n')
    srv = start_server(tmp_path / "state", "--lane", str(lane), "--checkpoints", "off")
    try:
        client = openai.OpenAI(base_url=srv.api_url, api_key=srv.key, max_retries=0)
        resp = client.responses.create(model="tiny", input="a b c a b c a b c a b", temperature=0,
                                       max_output_tokens=24)
        out = resp.usage.output_tokens
        r = httpx.get(srv.base_url + "/metrics", headers={"Authorization": f"Bearer {srv.key}"})
        assert r.status_code == 200
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    finally:
        srv.stop()
    recs = [json.loads(x) for x in (tmp_path / "state" / "logs" / "requests.jsonl")
            .read_text().splitlines()]
    spec = [r for r in recs if r["event"] == "request_done"][-1]["speculative"]
    # every decode step was a verify pass: passes + accepted drafts = tokens after the first
    assert spec["verify_passes"] >= 1
    assert spec["verify_passes"] + sum(spec["accepted"]) == out - 1
    assert samples[("ninfer_speculative_verify_passes_total", ())] == spec["verify_passes"]
    for i, n in enumerate(spec["drafted"]):
        assert samples[("ninfer_speculative_drafted_tokens_total", (("position", str(i)),))] == n
