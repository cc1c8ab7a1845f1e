"""Bad input to the release build and verifier that needs no build: a dirty lock stops the
build naming the package, and nothing is left behind; a directory that is no release, or whose
manifest is truncated, fails naming the file."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from release.build import BuildError, build
from release.verify import verify

REPO = Path(__file__).resolve().parent.parent


def _tree(tmp_path: Path, lock_text: str) -> Path:
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(REPO / "requirements.in", tree / "requirements.in")
    (tree / "requirements.lock").write_text(lock_text)
    return tree


def test_a_lock_missing_a_requirement_stops_the_build_naming_it(tmp_path):
    lock = (REPO / "requirements.lock").read_text()
    start = lock.index("\nsanic==")
    end = lock.index("\n", lock.index("# via", start) + 1)
    tree = _tree(tmp_path, lock[:start] + lock[end:])
    with pytest.raises(BuildError, match="sanic"):
        build(tmp_path / "dist" / "v0.16.0", tree=tree, epoch=0, lanes=["cpu"],
              log=lambda *_: None)
    assert list((tmp_path / "dist").iterdir()) == []  # no half-written release, no staging


def test_an_unhashed_requirement_stops_the_build_naming_it(tmp_path):
    lock = (REPO / "requirements.lock").read_text()
    tree = _tree(tmp_path, lock + "\nzzz-unhashed==1.0\n")
    with pytest.raises(BuildError, match="zzz-unhashed"):
        build(tmp_path / "dist" / "v0.16.0", tree=tree, epoch=0, lanes=["cpu"],
              log=lambda *_: None)


def test_verify_names_a_missing_directory_and_a_truncated_manifest(tmp_path):
    assert verify(tmp_path / "nope") == [f"FAIL {tmp_path / 'nope'}: present: not a directory"]
    d = tmp_path / "rel"
    d.mkdir()
    (d / "manifest.json").write_text('{"format": "ninfer-rel')
    (failure,) = verify(d)
    assert failure.startswith("FAIL manifest.json: parse: not readable JSON")
