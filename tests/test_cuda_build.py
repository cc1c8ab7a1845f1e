"""The CUDA ops build for every lane's card with this machine's nvcc (no GPU needed): the
library holds code for exactly that architecture (read from its fatbinary), two builds are
byte-identical, and the checkpoint fingerprint changes with the ops' sources."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from engine.kernels import cuda_build
from lanes.profile import load_profile

LANE_CARDS = {"rtx3090": "86", "rtx4090": "89", "h200": "90", "rtx5090": "120"}
NVCC = cuda_build._nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs the CUDA toolkit's nvcc")


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_each_lane_names_its_cards_architecture():
    for lane, arch in LANE_CARDS.items():
        assert load_profile(lane).table("card")["arch"] == f"sm_{arch}"


@needs_nvcc
def test_the_ops_build_for_an_ampere_card(tmp_path):
    """The default tier's one build: sm_86 (the oldest lane card; the sm_90-only instructions
    are compiled out below sm_90)."""
    lib = cuda_build.build(cuda_build.INT4_SOURCE, "86", NVCC, out=tmp_path / "ops-sm86.so")
    assert cuda_build.fatbin_archs(lib) == {"sm": {86}, "ptx": set()}
    assert not list(tmp_path.glob(".build-*"))  # the build directory is gone


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(LANE_CARDS.values()))
def test_every_lane_card_builds_twice_byte_identical(tmp_path, arch):
    a = cuda_build.build(cuda_build.INT4_SOURCE, arch, NVCC, out=tmp_path / "a" / "ops.so")
    b = cuda_build.build(cuda_build.INT4_SOURCE, arch, NVCC, out=tmp_path / "b" / "ops.so")
    assert _sha(a) == _sha(b)
    assert cuda_build.fatbin_archs(a)["sm"] == {int(arch)}


def test_the_fatbin_reader_refuses_what_is_not_a_library(tmp_path):
    p = tmp_path / "x.so"
    p.write_bytes(b"not an elf")
    with pytest.raises(ValueError, match="not a 64-bit ELF"):
        cuda_build.fatbin_archs(p)


def test_the_engine_build_id_covers_the_cuda_sources(tmp_path):
    from server.checkpoints.fingerprint import engine_build_id

    root = tmp_path / "engine"
    shutil.copytree(Path(cuda_build.__file__).resolve().parents[1], root,
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = engine_build_id(root)
    cu = root / "kernels" / "cuda" / "int4_gemv.cu"
    cu.write_text(cu.read_text() + "\n// changed\n")
    assert engine_build_id(root) != before
