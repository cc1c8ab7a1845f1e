"""The release tier: the whole release built twice and compared byte for byte, verified, and
refused after one flipped byte in each kind of file, an unlisted file, a symlink, a removed
file, a changed manifest and a stale receipt."""
from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from release import manifest as M
from release.verify import verify
from tests.release_build import shared_release

pytestmark = pytest.mark.release
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    a, b, facts = shared_release(tmp_path_factory)
    print(f"\nrelease built twice: {facts['seconds']} s")
    return a, b


def _tree(d: Path) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*"))


def test_two_builds_are_byte_identical(releases):
    a, b = releases
    assert _tree(a) == _tree(b)
    files = [f for f in _tree(a) if (a / f).is_file()]
    diff = [f for f in files if not filecmp.cmp(a / f, b / f, shallow=False)]
    assert diff == []
    doc = json.loads((a / "manifest.json").read_text())
    assert set(doc["lanes"]) == {"cpu", "h200", "rtx3090", "rtx4090", "rtx5090"}
    for kind in ("engine-bundle.tar", "sbom.spdx.json", "sbom.cdx.json", "profile.json",
                 "oci/index.json"):
        assert all(f"lanes/{n}/{kind}" in doc["files"] for n in doc["lanes"])


def _run_verify(d: Path, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "release", "verify", str(d), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


def test_the_release_verifies_and_is_a_candidate_until_qualified(releases):
    """The cpu lane has a receipt (qualification/cpu.json, `./ninfer qualify --lane cpu` on
    the tree it binds): the lane is ready when that receipt passed and qualified this very
    bundle, else a candidate whose blockers name the receipt's fields (a failed verdict, a
    later change to the tree). The GPU lanes have no receipt: the release stays a candidate
    and --require-ready names each."""
    a, _ = releases
    sha = M.sha256_file(a / "manifest.json")
    out = _run_verify(a, "--manifest-sha256", sha)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verified (candidate)" in out.stdout
    out = _run_verify(a, "--require-ready")
    assert out.returncode == 1
    for lane in ("h200", "rtx3090", "rtx4090", "rtx5090"):
        assert f"no qualification receipt (qualification/{lane}.json)" in out.stdout
    cpu = json.loads((a / "manifest.json").read_text())["lanes"]["cpu"]
    assert cpu["receipt"] and cpu["receipt"]["path"] == "qualification/cpu.json"
    assert "no qualification receipt (qualification/cpu.json)" not in out.stdout
    assert cpu["status"] == "ready" or all("receipt field" in b for b in cpu["blockers"]), \
        cpu["blockers"]
    out = _run_verify(a, "--manifest-sha256", "0" * 64)
    assert out.returncode == 1 and "FAIL manifest.json: --manifest-sha256" in out.stdout


def _flip(path: Path, offset: int) -> int:
    data = bytearray(path.read_bytes())
    offset = offset % len(data)
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    return offset


def _oci_blob(d: Path, lane: str, what: str) -> Path:
    doc = json.loads((d / "manifest.json").read_text())
    digest = doc["lanes"][lane]["oci"][what]
    digest = digest[-1] if isinstance(digest, list) else digest
    return d / doc["lanes"][lane]["oci"]["path"] / "blobs" / "sha256" / digest.split(":")[1]


@pytest.mark.parametrize("target", [
    "manifest.json", "SHA256SUMS", "compatibility.json", "locks/requirements.lock",
    "lanes/cpu/profile.json", "lanes/cpu/engine-bundle.tar", "lanes/cpu/sbom.spdx.json",
    "lanes/cpu/sbom.cdx.json", "lanes/rtx5090/engine-bundle.tar", "oci:cpu:layers",
    "oci:cpu:config", "oci:cpu:manifest", "lanes/cpu/oci/index.json"])
def test_a_flipped_byte_is_named(releases, target):
    a, _ = releases
    path = _oci_blob(a, *target.split(":")[1:]) if target.startswith("oci:") else a / target
    rel = path.relative_to(a).as_posix()
    original = path.read_bytes()
    try:
        _flip(path, len(original) // 2)
        failures = verify(a)
    finally:
        path.write_bytes(original)
    assert failures, rel
    assert any(rel in f or (rel == "manifest.json" and "manifest.json" in f) for f in failures), (
        rel, failures[:5])
    assert verify(a) == []


def test_unlisted_missing_symlinked_and_escaping_files_fail(releases, tmp_path):
    a, _ = releases
    (a / "extra.txt").write_text("hello\n")
    try:
        assert any("FAIL extra.txt: listed" in f for f in verify(a))
    finally:
        (a / "extra.txt").unlink()
    os.symlink("manifest.json", a / "link.json")
    try:
        assert any("link.json" in f and "symlink" in f for f in verify(a))
    finally:
        (a / "link.json").unlink()
    sbom = a / "lanes/rtx3090/sbom.cdx.json"
    saved = sbom.read_bytes()
    sbom.unlink()
    try:
        assert any("FAIL lanes/rtx3090/sbom.cdx.json: present" in f for f in verify(a))
    finally:
        sbom.write_bytes(saved)
    sums = a / "SHA256SUMS"
    saved = sums.read_bytes()
    sums.write_bytes(saved + b"0" * 64 + b"  ../outside\n")
    try:
        assert any("FAIL SHA256SUMS: format" in f for f in verify(a))
    finally:
        sums.write_bytes(saved)
    assert verify(a) == []


def test_edited_documents_are_caught_even_when_rehashed(releases, tmp_path):
    """An edit made consistent with SHA256SUMS and the manifest's table (as an attacker who can
    write the directory but not the published manifest hash would) still fails: the profile's
    host, a placeholder, and a receipt for another bundle."""
    a, _ = releases
    copy = tmp_path / "rel"
    shutil.copytree(a, copy, symlinks=True)

    def rehash():
        doc = json.loads((copy / "manifest.json").read_text())
        files = M.listing(copy)
        doc["files"] = {f: M.sha256_file(copy / f) for f in files
                        if f not in ("manifest.json", "SHA256SUMS")}
        (copy / "manifest.json").write_bytes(M.dumps(doc))
        (copy / "SHA256SUMS").write_bytes(M.sums(copy, [f for f in M.listing(copy)
                                                         if f != "SHA256SUMS"]))
        return doc

    prof = copy / "lanes/cpu/profile.json"
    doc = json.loads(prof.read_text())
    doc["profile"]["host"] = "0.0.0.0"
    prof.write_bytes(M.dumps(doc))
    rehash()
    failures = verify(copy)
    assert any("lanes/cpu/profile.json: fail-closed profile" in f for f in failures), failures

    doc["profile"]["host"] = "127.0.0.1"
    doc["profile"]["model"] = "embedded:tiny TODO"
    prof.write_bytes(M.dumps(doc))
    rehash()
    assert any("no private paths or placeholders" in f for f in verify(copy))

    shutil.copy(a / "lanes/cpu/profile.json", prof)
    lock = copy / "locks/requirements.lock"
    saved = lock.read_bytes()
    lock.write_bytes(saved.replace(b"\njax==0.10.2 ", b"\njax==0.11.2 "))
    rehash()
    assert any("locks/requirements.lock: lock runs the bundle: requirements.lock installs jax "
               "0.11.2 but the bundle's forwards were exported with jax 0.10.2" in f
               for f in verify(copy)), verify(copy)
    lock.write_bytes(saved)
    receipt = {"format": M.RECEIPT_FORMAT, "lane": "cpu", "verdict": "pass",
               "bundle_sha256": "0" * 64, "synthetic_weights": False,
               "profile_sha256": json.loads(prof.read_text())["profile_sha256"]}
    (copy / "qualification").mkdir(exist_ok=True)
    (copy / "qualification/cpu.json").write_bytes(M.dumps(receipt))
    doc = rehash()
    doc["lanes"]["cpu"]["receipt"] = {"path": "qualification/cpu.json",
                                      "sha256": M.sha256_file(copy / "qualification/cpu.json")}
    (copy / "manifest.json").write_bytes(M.dumps(doc))
    rehash()
    out = _run_verify(copy, "--require-ready")
    assert out.returncode == 1
    assert "lane cpu: the receipt qualified another bundle" in out.stdout
