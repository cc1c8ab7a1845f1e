"""Engine bundles (release/bundle.py) and exported forwards (engine/runtime/exported.py).

Default tier: a small engine of the embedded tiny model (fp32) served from its exported
forwards gives the live engine's greedy tokens and never traces the model; exports refuse a
runner they were not made for; the CPU lane's bundle is byte-identical across processes and
refuses a flipped byte, a missing file, an unlisted file and a truncated tar, naming the file;
`serve --bundle` refuses a bundle of another JAX version with exit 78.
Release tier: the CPU lane's bundle served at its real shapes (greedy tokens, and the server
end to end), and GPU lanes' CUDA exports built on this CPU machine.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.engine_runs import exported_and_live

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
SMALL = dict(context_tokens=256, prefill_chunk=32, max_concurrency=2, max_queue=2)


@pytest.mark.release  # ~1 minute of compiling: the release tier's, beside the lane-shape one
def test_exported_forwards_give_the_live_engines_greedy_tokens(tiny_model):
    from engine.engine import Engine
    from engine.runtime.exported import export_forwards

    ids = tiny_model.tokenizer.encode(PROMPT)[:40]
    source = Engine(tiny_model, **SMALL)
    blobs = export_forwards(source.runner, source.mem.cache, "cpu")
    assert sorted(blobs) == sorted(source.runner.shapes())
    assert export_forwards(source.runner, source.mem.cache, "cpu") == blobs  # reproducible
    assert not any(b"test_bundle.py" in b or str(REPO).encode() in b for b in blobs.values())

    got, live, counts, done = exported_and_live(tiny_model, ids, 36, blobs, **SMALL)
    assert counts["exported"] == len(blobs) and counts["compiled"] == 0
    assert done.finish_reason == "length" and len(got) == 36
    assert got == live


def _with_header(blob: bytes, **change) -> bytes:
    from engine.runtime.exported import MAGIC, read_header

    header, body = read_header(blob)
    header.update(change)
    return MAGIC + json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\n" \
        + body


def test_exports_refuse_another_runner(tiny_model):
    import dataclasses

    from engine.engine import Engine
    from engine.runtime.exported import ExportMismatch, export_forwards

    eng = Engine(tiny_model, **SMALL)
    blobs = export_forwards(eng.runner, eng.mem.cache, "cpu")
    one_row = Engine(tiny_model, **{**SMALL, "max_concurrency": 1})
    with pytest.raises(ExportMismatch, match="this engine runs"):
        one_row.load_exported(blobs)
    sw = (eng.B, 1)
    with pytest.raises(ExportMismatch, match="exported for platform 'cuda'"):
        eng.load_exported({**blobs, sw: _with_header(blobs[sw], platform="cuda")})
    with pytest.raises(ExportMismatch, match="kernel plan"):
        eng.load_exported({**blobs, sw: _with_header(blobs[sw], plan="0" * 64)})
    with pytest.raises(ExportMismatch, match="no ninfer-exported"):
        eng.load_exported({**blobs, sw: blobs[sw][20:]})
    other = Engine(tiny_model, **{**SMALL, "context_tokens": 512})  # another cache: signature
    with pytest.raises(ExportMismatch, match="another model config, params, cache"):
        other.load_exported(blobs)
    narrow = Engine(tiny_model, **SMALL, plan=dataclasses.replace(eng.plan, narrow_decode=True))
    with pytest.raises(ExportMismatch):
        narrow.load_exported(blobs)
    assert not eng.runner._compiled  # nothing was loaded from a refused set


# ---- the CPU lane's bundle ----------------------------------------------------------------
_BUILD = ("import json, sys; from release.bundle import build_bundle; "
          "print(json.dumps(build_bundle('cpu', sys.argv[1], epoch=1700000000)))")


@pytest.fixture(scope="module")
def cpu_bundle(tmp_path_factory):
    """The CPU lane's bundle built in this process and, separately, in another one."""
    from release.bundle import build_bundle

    d = tmp_path_factory.mktemp("bundle")
    t = time.monotonic()
    info = build_bundle("cpu", d / "a.tar", epoch=1700000000)
    info["build_s"] = time.monotonic() - t
    other = subprocess.run([sys.executable, "-c", _BUILD, str(d / "b.tar")], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert other.returncode == 0, other.stderr[-3000:]
    print(f"cpu bundle: {info}")
    return d, info, json.loads(other.stdout.strip().splitlines()[-1])


def test_cpu_bundle_is_byte_identical_across_builds(cpu_bundle):
    d, a, b = cpu_bundle
    assert (d / "a.tar").read_bytes() == (d / "b.tar").read_bytes()
    assert a["sha256"] == b["sha256"] and a["size"] == (d / "a.tar").stat().st_size


def test_cpu_bundle_contents(cpu_bundle):
    from engine.runtime.exported import read_header
    from lanes.profile import load_profile
    from release.bundle import FORMAT, open_bundle

    d, _, _ = cpu_bundle
    with tarfile.open(d / "a.tar") as tf:
        members = tf.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {
        (1700000000, 0, 0, "", "")}
    assert {m.mode for m in members} <= {0o644, 0o755}
    b = open_bundle(d / "a.tar", expect_lane="cpu")
    profile = load_profile("cpu")
    m = b.manifest
    assert m["format"] == FORMAT and m["lane"] == "cpu" and m["platform"] == "cpu"
    assert m["plan_digest"] == profile.plan.digest() and m["batch"] == profile.max_concurrency
    assert "code/engine/runtime/exported.py" in b.files and "code/ninfer" in b.files
    assert "code/release/bundle.py" in b.files  # serve --bundle reads bundles with it
    assert not any(n.startswith(("code/tests/", "code/bench/")) for n in b.files)
    fw = b.forwards("cpu")
    assert sorted(fw) == sorted(tuple(s) for s in m["shapes"])
    assert all(read_header(x)[0]["platform"] == "cpu" for x in fw.values())
    assert b.profile()["name"] == "cpu" and b.cuda_libraries() == {}
    from release.bundle import BundleError
    with pytest.raises(BundleError, match="not 'h200'"):
        open_bundle(d / "a.tar", expect_lane="h200")


def _rewrite(src: Path, dst: Path, edit) -> None:
    """Copy a bundle tar, `edit(name, data)` -> new data, or None to leave the file out."""
    with tarfile.open(src) as tf, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as out:
        for m in tf.getmembers():
            data = edit(m.name, tf.extractfile(m).read())
            if data is not None:
                m.size = len(data)
                out.addfile(m, io.BytesIO(data))


def test_tampered_bundles_are_refused_naming_the_file(cpu_bundle, tmp_path):
    from release.bundle import BundleError, open_bundle

    d, _, _ = cpu_bundle
    src = d / "a.tar"
    target = "exported/cpu/2x1.jaxexport"
    with tarfile.open(src) as tf:
        offset = tf.getmember(target).offset_data
    flipped = bytearray(src.read_bytes())
    flipped[offset + 1000] ^= 0x01  # one bit of one byte inside the file's data
    (tmp_path / "flip.tar").write_bytes(bytes(flipped))
    with pytest.raises(BundleError, match=f"{target} does not match its sha256"):
        open_bundle(tmp_path / "flip.tar")
    _rewrite(src, tmp_path / "missing.tar",
             lambda n, b: None if n == "code/engine/engine.py" else b)
    with pytest.raises(BundleError, match="code/engine/engine.py is missing"):
        open_bundle(tmp_path / "missing.tar")
    _rewrite(src, tmp_path / "code.tar",
             lambda n, b: b + b"\n# changed\n" if n == "code/server/cli.py" else b)
    with pytest.raises(BundleError, match="code/server/cli.py does not match"):
        open_bundle(tmp_path / "code.tar")
    data = src.read_bytes()
    (tmp_path / "short.tar").write_bytes(data[:offset + 100])
    with pytest.raises(BundleError, match=target.replace(".", r"\.")):
        open_bundle(tmp_path / "short.tar")


def test_serve_refuses_a_bundle_of_another_jax(cpu_bundle, tmp_path):
    """`serve --bundle` with a bundle exported by another JAX: exit 78 before anything is
    bound, saying why; a bundle of another lane than --lane, the same."""
    d, _, _ = cpu_bundle

    def other_jax(name, data):
        if name != "bundle.json":
            return data
        return json.dumps({**json.loads(data), "jax": "0.0.1"}).encode()
    _rewrite(d / "a.tar", tmp_path / "old.tar", other_jax)
    for bundle, lane, says in ((tmp_path / "old.tar", [], "exported with jax 0.0.1"),
                               (d / "a.tar", ["--lane", "h200"], "not 'h200'")):
        r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--bundle",
                            str(bundle), *lane, "--port", "0", "--state-dir",
                            str(tmp_path / "state")], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 78, r.stderr[-2000:]
        assert says in r.stderr
    assert not (tmp_path / "state").exists()


# ---- release tier -------------------------------------------------------------------------
@pytest.mark.release
def test_cpu_lane_bundle_forwards_give_the_live_tokens(cpu_bundle, shared_state_dir):
    """An engine at the CPU lane's real shapes (2 rows, 256-token pieces, its KV pool) and on
    its own model, whose forwards come from the lane's bundle, generates the live-jitted
    engine's greedy tokens."""
    from engine.io.loader import ensure_embedded, load_model
    from lanes.profile import load_profile
    from release.bundle import open_bundle

    d, _, _ = cpu_bundle
    p = load_profile("cpu")
    tiny_model = load_model(ensure_embedded(shared_state_dir, p.model.split(":", 1)[1],
                                            p.model_sha256))
    kw = dict(context_tokens=p.context_tokens, prefill_chunk=p.prefill_chunk,
              max_concurrency=p.max_concurrency, capacity_tokens=p.kv_capacity_tokens,
              plan=p.plan, max_queue=2)
    ids = tiny_model.tokenizer.encode(PROMPT * 3)[:300]  # pieces of 256 and 64 (44 padded)
    blobs = open_bundle(d / "a.tar", expect_lane="cpu").forwards("cpu")
    got, live, counts, _ = exported_and_live(tiny_model, ids, 33, blobs, **kw)
    assert got == live and len(got) == 33 and counts["compiled"] == 0


@pytest.mark.release
def test_serve_from_the_cpu_lane_bundle(cpu_bundle, embedded_models_dir, tmp_path):
    """`serve --bundle` (no --lane): the bundle's lane, every forward from the bundle, nothing
    compiled, and a request served."""
    import httpx

    from tests.serverproc import start_server

    d, _, _ = cpu_bundle
    state = tmp_path / "state"
    state.mkdir()
    (state / "models").symlink_to(embedded_models_dir)
    srv = start_server(state, "--bundle", str(d / "a.tar"))
    try:
        log = "".join(srv.log)
        assert f"4 forwards loaded from bundle {d / 'a.tar'}" in log
        assert "lane cpu listening" in log
        phases = srv.startup_phases()
        assert phases["exec_exported"] == 4 and phases["exec_compiled"] == 0
        r = httpx.post(srv.api_url + "/responses", timeout=120,
                       headers={"Authorization": f"Bearer {srv.key}"},
                       json={"model": "tiny-chat", "input": "Hello", "max_output_tokens": 8,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["output_tokens"] == 8
    finally:
        srv.stop()


@pytest.mark.release
@pytest.mark.parametrize("lane", ["h200", "rtx3090", "rtx4090", "rtx5090"])
def test_gpu_lane_bundle_built_on_this_cpu_machine(lane, tmp_path_factory):
    """A GPU lane's bundle in the release tier's release (tests/release_build.py): its
    forwards exported for CUDA at the lane's 27B shapes from abstract params (no weights, no
    GPU), the Triton kernels in compiled form, and (h200) the CUDA ops built for the card's
    arch and called by the forwards."""
    from jax import export

    from engine.runtime.exported import read_header
    from lanes.profile import load_profile
    from release.bundle import open_bundle
    from tests.release_build import shared_release

    release, _, _ = shared_release(tmp_path_factory)
    path = release / "lanes" / lane / "engine-bundle.tar"
    print(f"{lane} bundle: {path.stat().st_size:,} bytes")
    b = open_bundle(path, expect_lane=lane)
    p = load_profile(lane)
    assert b.platform == "cuda" and b.manifest["plan_digest"] == p.plan.digest()
    fw = b.forwards("cuda")
    assert len(fw) == len(b.manifest["shapes"]) == 1 + len(
        [s for s in b.manifest["shapes"] if s[0] == 1 and s[1] > 1])
    header, body = read_header(fw[(p.max_concurrency, 1)])
    assert header["platform"] == "cuda"
    exp = export.deserialize(bytearray(body))
    assert exp.platforms == ("cuda",)
    text = exp.mlir_module()
    assert "__gpu$xla.gpu.triton" in text  # compiled Pallas kernels, not the interpreter
    libs = b.cuda_libraries()
    if p.plan.uses_cuda:
        assert len(libs) == 1 and "ninfer_int4" in text
        (lib,) = libs.values()
        assert lib[:4] == b"\x7fELF"
    else:
        assert libs == {} and "ninfer_int4" not in text


def test_prebuilt_cuda_ops_are_taken_by_arch_under_the_runtime_name(tmp_path):
    """`release build --cuda-ops DIR` (Bazel's //engine:cuda_ops) puts DIR's library for the
    lane's arch into the bundle, named as the runtime names that build; a missing library or a
    plan built with other flags is refused, naming it."""
    import dataclasses

    from engine.kernels import cuda_build
    from lanes.profile import load_profile
    from release.bundle import BundleError, _cuda_libraries

    nvcc = cuda_build._nvcc()
    if nvcc is None:
        pytest.fail("this machine's nvcc is part of the build (README: Release)")
    profile = load_profile("h200")
    arch = profile.plan.cuda_arch
    with pytest.raises(BundleError, match=f"int4_gemv-sm{arch}.so is missing"):
        _cuda_libraries(profile, tmp_path)
    (tmp_path / f"int4_gemv-sm{arch}.so").write_bytes(b"\x7fELF prebuilt")
    got = _cuda_libraries(profile, tmp_path)
    name = cuda_build.library_path(cuda_build.INT4_SOURCE, arch, nvcc,
                                   tuple(profile.plan.cuda_flags)).name
    assert got == {f"cuda/{name}": b"\x7fELF prebuilt"}
    other = dataclasses.replace(profile, plan=dataclasses.replace(
        profile.plan, cuda_flags=("-O2", "-std=c++17")))
    with pytest.raises(BundleError, match=r"cuda_flags \['-O2', '-std=c\+\+17'\]"):
        _cuda_libraries(other, tmp_path)
