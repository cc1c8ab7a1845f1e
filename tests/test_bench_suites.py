"""`./ninfer bench SUITE` (bench/suites.py): bad input exits 2 with the list of suites; a suite
this machine cannot run says so and writes nothing; the cpu suite (slow tier) writes its
results file with the command, date, machine, commit, plan, figures and ratios."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "bench.suites", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args", [["nope"], ["cpu", "--frob"], [], ["cpu", "--reps", "0"]])
def test_bad_suite_or_option_exits_2_with_the_suites(args):
    out = _bench(*args)
    assert out.returncode == 2, out.stderr
    assert "cpu" in out.stderr and ("h200" in out.stderr or "--reps" in out.stderr)


def test_a_gpu_suite_without_a_gpu_says_so_and_writes_nothing(tmp_path):
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("this machine has the GPU the suite needs")
    out = _bench("h200", "--out", str(tmp_path / "h200.json"))
    assert out.returncode == 1
    assert "needs a GPU" in out.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cpu_suite_writes_its_results_file(tmp_path):
    out = _bench("cpu", "--prompt-tokens", "256", "--decode-tokens", "8", "--reps", "1",
                 "--out", str(tmp_path / "cpu.json"), timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "cpu.json").read_text())
    assert res["suite"] == "cpu" and res["command"].startswith("./ninfer bench cpu")
    assert res["plan"]["preset"] == "cpu" and len(res["commit"]["sha"]) == 40
    f = res["figures"]
    assert 200 < f["prompt_tokens"] < 400 and f["peer"]["prompt_tokens"] == f["prompt_tokens"]
    assert f["ttft_s"] > 0 and f["decode_tok_s"] > 0 and f["peer"]["decode_tok_s"] > 0
    assert set(res["ratios"]) == {"ttft_over_peer_prefill", "decode_over_peer",
                                  "decode_of_roofline"}
    assert [r["k"] for r in f["speculative"]["transcript"]["prompt_lookup"]] == [2, 4, 8]


def test_cpu_suite_states_prompt_lookup_on_the_coding_transcript():
    """`./ninfer bench cpu`'s speculative figures: each K's acceptance and tokens a verify
    pass, from the transcript (a file read, then written back with an edit), which prompt
    lookup drafts well; the cpu lane itself serves with speculation off."""
    from bench.suites import _speculative_cpu
    from lanes.profile import load_profile

    spec = _speculative_cpu(load_profile("cpu"))
    assert spec["lane_setting"] is None
    rows = spec["transcript"]["prompt_lookup"]
    assert [r["k"] for r in rows] == [2, 4, 8]
    for r in rows:
        assert 0.5 < r["acceptance_rate"] <= 1 and 1.5 < r["tokens_per_pass"] <= r["k"] + 1
        assert r["accepted"] <= r["drafted"]
    # longer drafts give more tokens a pass on text that repeats
    assert rows[0]["tokens_per_pass"] < rows[1]["tokens_per_pass"] < rows[2]["tokens_per_pass"]
