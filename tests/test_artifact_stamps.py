"""Verified-artifact stamps (server/artifact_stamps.py): a restart skips the hash pass only for
the exact file it verified before; any change, forgery or missing stamp means a full pass.
Real files and real os.stat throughout."""
from __future__ import annotations

import json
import os
import shutil
import stat
import time

import pytest

from engine.io.artifact import ArtifactError, open_artifact
from engine.io.loader import load_model, verify_artifact
from server.artifact_stamps import RACY_MARGIN_S, ArtifactStamps
from server.cli import build_parser


@pytest.fixture(scope="module")
def artifacts(embedded_models_dir, tmp_path_factory):
    """Copies of the embedded tiny artifact, aged past the racy margin (a stamp is only written
    for a file whose ctime is older than that when its hash pass starts), and its sha256."""
    d = tmp_path_factory.mktemp("stamped")
    src = embedded_models_dir / "tiny.ninfer"
    paths = {}
    for name in ("plain", "rewrite", "restore", "loaded"):
        paths[name] = d / f"{name}.ninfer"
        shutil.copyfile(src, paths[name])
    time.sleep(RACY_MARGIN_S + 0.2)
    with open_artifact(src) as art:
        return paths, art.sha256


def _verify(path, stamps, mode="stamp", expected=None):
    with open_artifact(path, verify=False) as art:
        how = verify_artifact(art, expected, stamps=stamps, mode=mode)
        return how, art.sha256


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_unchanged_file_skips_the_hash_pass(artifacts, tmp_path):
    paths, sha = artifacts
    stamps = ArtifactStamps(tmp_path)
    assert _verify(paths["plain"], stamps, expected=sha) == ("full", sha)
    stamp = tmp_path / "verified" / f"{sha}.json"
    assert _mode(stamp) == 0o600 and _mode(stamp.parent) == 0o700
    assert _mode(tmp_path / "secrets" / "artifact-stamp.key") == 0o600
    assert _verify(paths["plain"], stamps, expected=sha) == ("stamp", sha)
    assert _verify(paths["plain"], stamps) == ("stamp", sha)  # no pin: found by identity
    # A new ArtifactStamps over the same state dir (a restart) trusts it too.
    assert _verify(paths["plain"], ArtifactStamps(tmp_path), expected=sha) == ("stamp", sha)


def test_full_mode_and_no_state_dir_always_hash(artifacts, tmp_path):
    paths, sha = artifacts
    stamps = ArtifactStamps(tmp_path)
    _verify(paths["plain"], stamps, expected=sha)
    assert _verify(paths["plain"], stamps, mode="full", expected=sha) == ("full", sha)
    assert _verify(paths["plain"], None, mode="stamp", expected=sha) == ("full", sha)


def test_another_pin_is_not_vouched_for(artifacts, tmp_path):
    paths, sha = artifacts
    stamps = ArtifactStamps(tmp_path)
    _verify(paths["plain"], stamps, expected=sha)
    other = "0" * 64
    with pytest.raises(ArtifactError, match="not the expected"):
        _verify(paths["plain"], stamps, expected=other)


def test_same_size_rewrite_with_mtime_restored_is_fully_verified(artifacts, tmp_path):
    """Flip one payload byte in place (same inode, same size), put atime/mtime back: the stamp's
    ctime no longer matches, the full pass runs and finds the corrupt part."""
    paths, sha = artifacts
    path, stamps = paths["rewrite"], ArtifactStamps(tmp_path)
    assert _verify(path, stamps, expected=sha) == ("full", sha)
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(8192)
        byte = f.read(1)
        f.seek(8192)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == \
        (before.st_ino, before.st_size, before.st_mtime_ns)
    with pytest.raises(ArtifactError, match="corrupt"):
        _verify(path, stamps, expected=sha)


def test_content_restored_is_verified_again_and_not_stamped_while_racy(artifacts, tmp_path,
                                                                       monkeypatch):
    """Rewrite the same bytes (content equal to the stamped one, mtime restored): ctime moved,
    so the full pass runs; the file is too fresh to be stamped, so the next load runs it too.
    The racy margin is widened for the test: with the shipped 1 s, a CI worker descheduled for
    over a second between the write and the pass (it happened) makes the file old enough to be
    stamped, correctly."""
    from server import artifact_stamps

    monkeypatch.setattr(artifact_stamps, "RACY_MARGIN_S", 3600.0)
    paths, sha = artifacts
    path, stamps = paths["restore"], ArtifactStamps(tmp_path)
    assert _verify(path, stamps, expected=sha) == ("full", sha)
    before = os.stat(path)
    data = path.read_bytes()
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert _verify(path, stamps, expected=sha) == ("full", sha)
    assert _verify(path, stamps, expected=sha) == ("full", sha)


def _tamper(stamp, edit):
    body = json.loads(stamp.read_text())
    edit(body)
    stamp.write_text(json.dumps(body))


def _flip_hex(text: str) -> str:
    return ("1" if text[0] != "1" else "2") + text[1:]


@pytest.mark.parametrize("edit", [
    lambda b: b.update(hmac=_flip_hex(b["hmac"])),
    lambda b: b.update(st_ctime_ns=b["st_ctime_ns"] + 1),
    lambda b: b.update(st_size=b["st_size"] + 1),
    lambda b: b.update(sha256=_flip_hex(b["sha256"])),
    lambda b: b.pop("hmac"),
], ids=["hmac", "ctime", "size", "sha256", "no-hmac"])
def test_tampered_stamp_is_ignored(artifacts, tmp_path, edit):
    paths, sha = artifacts
    stamps = ArtifactStamps(tmp_path)
    _verify(paths["plain"], stamps, expected=sha)
    _tamper(tmp_path / "verified" / f"{sha}.json", edit)
    assert _verify(paths["plain"], stamps, expected=sha) == ("full", sha)


def test_stamp_from_another_key_or_corrupt_is_ignored(artifacts, tmp_path):
    paths, sha = artifacts
    other = tmp_path / "other"
    _verify(paths["plain"], ArtifactStamps(other), expected=sha)
    mine = tmp_path / "mine"
    stamps = ArtifactStamps(mine)
    (mine / "verified").mkdir(mode=0o700)
    forged = mine / "verified" / f"{sha}.json"
    shutil.copyfile(other / "verified" / f"{sha}.json", forged)
    assert _verify(paths["plain"], stamps, expected=sha) == ("full", sha)  # rewrites it
    forged.write_text("{not json")
    assert _verify(paths["plain"], stamps, expected=sha) == ("full", sha)


def test_load_model_reports_the_verification(artifacts, tmp_path):
    paths, sha = artifacts
    stamps, runs = ArtifactStamps(tmp_path), []
    for _ in range(2):
        timings = {}
        model = load_model(paths["loaded"], expected_sha256=sha, timings=timings, stamps=stamps,
                           verify="stamp")
        runs.append(timings["verify"])
        assert model.sha256 == sha
    assert runs == ["full", "stamp"]


def test_serve_option():
    p = build_parser()
    assert p.parse_args(["serve"]).verify_artifact == "stamp"
    assert p.parse_args(["serve", "--verify-artifact", "full"]).verify_artifact == "full"
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--verify-artifact", "none"])
