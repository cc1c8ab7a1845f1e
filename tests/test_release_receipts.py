"""A lane's qualification receipt against what the release binds (release/manifest.py's
receipt_blockers, used by both `release build` and `release verify`): a receipt for another
bundle, profile or model, an unqualified verdict or synthetic weights blocks the lane, and each
blocker names the receipt field. The receipts here are the ones `./ninfer qualify` writes
(its write_receipt), read back from disk."""
from __future__ import annotations

import json
import os
import stat

import pytest

from lanes.qualify import write_receipt
from release import manifest as M

BUNDLE, PROFILE, MODEL = "b" * 64, "p" * 64, "m" * 64


def _receipt(**edit) -> dict:
    r = {"format": M.RECEIPT_FORMAT, "lane": "cpu", "verdict": "pass", "bundle_sha256": BUNDLE,
         "profile_sha256": PROFILE, "model": {"id": "tiny", "sha256": MODEL},
         "synthetic_weights": False, "phases": {}}
    r.update(edit)
    return r


def _blockers(receipt, tmp_path) -> list[str]:
    path = write_receipt(receipt, tmp_path / "qualification")
    return M.receipt_blockers("cpu", json.loads(path.read_bytes()), BUNDLE, PROFILE, MODEL)


def test_a_matching_passed_receipt_blocks_nothing(tmp_path):
    assert _blockers(_receipt(), tmp_path) == []


@pytest.mark.parametrize("edit, field", [
    ({"bundle_sha256": "0" * 64}, "bundle_sha256"),
    ({"profile_sha256": "1" * 64}, "profile_sha256"),
    ({"model": {"id": "tiny", "sha256": "2" * 64}}, "model.sha256"),
    ({"model": None}, "model.sha256"),
    ({"lane": "h200"}, "lane"),
    ({"verdict": "fail"}, "verdict"),
    ({"synthetic_weights": True}, "synthetic_weights"),
    ({"format": "ninfer-receipt/0"}, "format"),
])
def test_each_mismatch_names_the_receipt_field(tmp_path, edit, field):
    blockers = _blockers(_receipt(**edit), tmp_path)
    assert len(blockers) == 1, blockers
    assert blockers[0].startswith("lane cpu: ") and f"(receipt field {field}: " in blockers[0]


def test_no_receipt_and_an_unpinned_model(tmp_path):
    assert M.receipt_blockers("cpu", None, BUNDLE, PROFILE, MODEL) == [
        "lane cpu: no qualification receipt (qualification/cpu.json)"]
    # a lane whose model is not pinned is blocked elsewhere; the receipt's model is not checked
    assert M.receipt_blockers("cpu", _receipt(model=None), BUNDLE, PROFILE, None) == []


def test_the_receipt_is_written_atomically_world_readable(tmp_path):
    out = tmp_path / "q"
    old = os.umask(0o077)
    try:
        path = write_receipt(_receipt(), out)
        path2 = write_receipt(_receipt(verdict="fail"), out)
    finally:
        os.umask(old)
    assert path == path2 == out / "cpu.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert json.loads(path.read_bytes())["verdict"] == "fail"
    assert sorted(p.name for p in out.iterdir()) == ["cpu.json"]  # no temporary left
    bad = write_receipt(_receipt(lane="../../etc"), out)
    assert bad == out / "invalid-lane.json"
