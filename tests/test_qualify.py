"""`./ninfer qualify --lane cpu`, run for real: a fresh lane root, the server as its own
process, the pinned OMP client, the role corpus against its recording. The receipt it writes
must bind what the release binds (the lane bundle's digest from the release's own function, the
profile hash, the model pin) and state every phase.

The phases that do not depend on what the model can do must pass on any model (the managed
start, restart exactness, rollback both ways, protected state, fresh sessions, the role corpus
against its recording). On the cpu lane's trained tiny-chat every phase passes: retrieval,
and OMP's tool turn, unforced, with the exact path (OMP names no temperature, so the model
samples with its artifact's default, greedy). A failing phase must give a failed receipt
(exit 1, the phase named), never a missing one. Bad input
(an unknown lane, a lane whose preflight fails, an instance that is not the lane's profile)
exits 78 with a failed receipt naming the reason.

The two tests on the real receipt run in the release tier (`./ninfer test --release`, which CI
runs after the default tier): the qualification takes 4 to 5 minutes of one test process."""
from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from lanes.profile import load_profile
from lanes.qualify_corpus import GOLDEN, differing
from lanes.qualify_phases import pack_tree, product_copy
from release.verify import PRIVATE
from tests.omp_client import OMP_VERSION, ensure_installed

REPO = Path(__file__).resolve().parent.parent
QUALITY_FREE = ("first_start", "decode", "restart", "multisession", "role_corpus", "rollback",
                "protected_state")


def qualify(out: Path, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess,
                                                                    dict]:
    r = subprocess.run([str(REPO / "ninfer"), "qualify", *args, "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout)
    files = list(out.glob("*.json"))
    assert len(files) == 1, (files, r.stderr[-3000:])
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o644
    return r, json.loads(files[0].read_bytes())


@pytest.fixture(scope="module")
def cpu_receipt(tmp_path_factory):
    ensure_installed()  # the pinned OMP (npm ci), as every OMP test has it
    out = tmp_path_factory.mktemp("receipt")
    r, receipt = qualify(out, "--lane", "cpu")
    print(f"\nqualify --lane cpu: {receipt['seconds']:.0f} s\n{r.stderr[-3000:]}")
    return r, receipt


@pytest.mark.release  # the whole qualification: 4 to 5 minutes
def test_the_cpu_receipt_binds_the_release_and_states_every_phase(cpu_receipt, tmp_path):
    from release.bundle import build_bundle

    r, receipt = cpu_receipt
    profile = load_profile("cpu")
    assert receipt["format"] == "ninfer-receipt/1" and receipt["lane"] == "cpu"
    # the release's epoch rule: the time of the newest commit of the tree qualified that
    # changed anything outside qualification/ (HEAD may move on while the qualification runs)
    b = receipt["bundle"]
    committed = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct",
                                b["commit"], "--", ".", ":(exclude)qualification"],
                               capture_output=True, text=True, check=True)
    assert b["epoch"] == int(os.environ.get("SOURCE_DATE_EPOCH") or committed.stdout)
    bundle = build_bundle("cpu", tmp_path / "b.tar", tree=REPO, epoch=b["epoch"])
    assert receipt["bundle_sha256"] == b["sha256"] == bundle["sha256"]
    assert receipt["profile_sha256"] == profile.canonical_hash()
    assert receipt["model"]["sha256"] == profile.model_sha256
    assert receipt["plan"]["digest"] and receipt["omp"]["version"] == OMP_VERSION
    assert receipt["machine"]["cpu"] and receipt["machine"]["cpus"] >= 1
    assert receipt["synthetic_weights"] is False
    assert not PRIVATE.search(json.dumps(receipt))  # publishable inside a release
    phases = receipt["phases"]
    assert sorted(phases) == sorted([
        "first_start", "retrieval", "decode", "speculative", "restart", "multisession",
        "role_corpus", "agent_protocol", "tool_turn", "rollback", "protected_state"])
    for name, p in phases.items():
        assert p["verdict"] in ("pass", "fail", "not_applicable"), name
        assert p["seconds"] >= 0 and isinstance(p["measurements"], dict), name
    for name in QUALITY_FREE:
        assert phases[name]["verdict"] == "pass", (name, phases[name])
    assert phases["speculative"]["verdict"] == "not_applicable"  # the cpu lane's is off

    ret = phases["retrieval"]["measurements"]
    assert ret["prompt_tokens"] >= 8192 and ret["planted_depth"] >= 0.90
    restart = phases["restart"]["measurements"]
    assert restart["path"] == "disk-restored" and 1 <= restart["compared_tokens"] <= 32
    assert restart["compared_tokens"] == 32 or restart["reference_stopped"]
    assert restart["cached_tokens"] == restart["expected_cached_tokens"]
    ms = phases["multisession"]["measurements"]
    assert (ms["sessions"], ms["root_fallbacks"]) == (24, 0) and ms["median_ttft_s"] > 0
    assert [s["command"] for s in phases["rollback"]["measurements"]["steps"]] == [
        "install", "rollback", "rollback", "rollback"]
    assert phases["role_corpus"]["measurements"]["cases"] >= 64
    prot = phases["protected_state"]["measurements"]
    assert prot["listening"] and all(a.startswith("127.") for a in prot["listening"])
    assert phases["decode"]["measurements"]["decode_tokens_per_s"] > 0
    tool = phases["tool_turn"]["measurements"]
    assert tool["omp_tools"] == list(profile.agent_tools) and "read" in tool["tools_run"]
    if receipt["model"]["id"] == "tiny-chat":  # the lane's trained model: the receipt passes
        assert [json.loads(c["args"])["path"] for c in tool["calls"]] == ["notes_for_review.txt"]
        assert receipt["verdict"] == "pass" and r.returncode == 0, receipt["reason"]


@pytest.mark.release
def test_a_failed_phase_fails_the_receipt_and_is_named(cpu_receipt):
    r, receipt = cpu_receipt
    failed = [n for n, p in receipt["phases"].items() if p["verdict"] == "fail"]
    if receipt["model"]["sha256"] == load_profile("cpu").model_sha256 and \
            receipt["model"]["id"] == "tiny":
        # the random embedded model cannot recall the planted value
        assert "retrieval" in failed
        assert "was not reproduced" in receipt["phases"]["retrieval"]["reason"]
    assert receipt["verdict"] == ("fail" if failed else "pass")
    assert r.returncode == (1 if failed else 0), r.stderr[-2000:]
    for name in failed:
        assert name in receipt["reason"] and receipt["phases"][name]["reason"]
        assert f"{name}: fail" in r.stderr


def test_the_role_corpus_names_each_case_that_differs():
    recorded = json.loads(GOLDEN.read_text())["recordings"]
    cases = next(iter(recorded.values()))["cases"]
    assert len(cases) >= 64
    assert differing(dict(cases), cases) == []
    changed = dict(cases)
    changed["plain-03"] = changed["plain-03"].replace('"status"', '"status" ', 1)
    del changed["fork-01b"]
    assert differing(changed, cases) == ["fork-01b", "plain-03"]


@pytest.mark.parametrize("lane, reason", [
    ("no-such-lane", ["unknown lane 'no-such-lane'"]),
    ("rtx5090", ["preflight refused: ", "lane rtx5090 needs an NVIDIA GeForce RTX 5090"]),
])
def test_an_unknown_lane_or_a_failed_preflight_gives_a_failed_receipt(tmp_path, lane, reason):
    r, receipt = qualify(tmp_path, "--lane", lane, timeout=300)
    assert r.returncode == 78, r.stderr
    assert receipt["verdict"] == "fail", receipt
    assert all(part in receipt["reason"] for part in reason), receipt["reason"]
    assert receipt["phases"] == {} and receipt["lane"] == lane


def test_an_instance_that_is_not_the_lane_profile_is_refused(tmp_path):
    tree = product_copy(tmp_path / "tree", "lanes/profiles/cpu.toml",
                        lambda t: t.replace("max_queue = 16", "max_queue = 15"))
    iid, path = pack_tree(tree, tmp_path / "packs")
    r, receipt = qualify(tmp_path / "out", "--lane", "cpu", "--from", path, timeout=300)
    assert r.returncode == 78, r.stderr
    assert f"instance {iid[:16]} does not match lane cpu's profile" in receipt["reason"]
    assert receipt["profile_sha256"] == load_profile("cpu").canonical_hash()


@pytest.mark.slow
def test_synthetic_weights_skip_the_model_phases_and_never_make_a_lane_ready(tmp_path):
    from release import manifest as M

    r, receipt = qualify(tmp_path, "--lane", "cpu", "--synthetic-weights")
    skipped = ["retrieval", "role_corpus", "agent_protocol", "tool_turn"]
    assert receipt["synthetic_weights"] is True
    assert receipt["phases"]["first_start"]["measurements"]["synthetic_weights"] is True
    assert receipt["skipped_for_synthetic_weights"] == skipped
    assert [n for n, p in receipt["phases"].items() if p["verdict"] == "skipped"] == sorted(
        skipped)
    for name in QUALITY_FREE:
        if name != "role_corpus":
            assert receipt["phases"][name]["verdict"] == "pass", (name, receipt["phases"][name])
    assert r.returncode == 0 and receipt["verdict"] == "pass", r.stderr[-2000:]
    blockers = M.receipt_blockers("cpu", receipt, receipt["bundle_sha256"],
                                  receipt["profile_sha256"], receipt["model"]["sha256"])
    assert blockers == ["lane cpu: qualified on synthetic weights (or does not say) "
                        "(receipt field synthetic_weights: True)"]
