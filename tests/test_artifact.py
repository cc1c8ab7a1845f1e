"""The .ninfer container: round trips, determinism, atomic writes, and loud refusal of bad files."""
from __future__ import annotations

import hashlib
import json
import struct

import ml_dtypes
import numpy as np
import pytest

from engine.io import artifact as A
from engine.io.artifact import ALIGN, MAGIC, ArtifactError, open_artifact, write_artifact
from engine.model.config import TEST_SMALL
from engine.ops.quant import FP8_ROW, INT4_G64, INT8_ROW, QTensor, quantize

CFG = TEST_SMALL
_FMT_CYCLE = [None, INT8_ROW, FP8_ROW, INT4_G64]


def _tensors(cfg=CFG, quantized=False, seed=0):
    """Deterministic tensors: 1-D fp32, 2-D bf16, or 2-D cycling through the quantized formats."""
    rng = np.random.default_rng(seed)
    for i, (name, shape) in enumerate(cfg.tensor_specs().items()):
        w = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1:
            yield name, w
        elif quantized and "conv1d" not in name and _FMT_CYCLE[i % 4]:
            yield name, quantize(w, _FMT_CYCLE[i % 4])
        else:
            yield name, w.astype(ml_dtypes.bfloat16)


META = dict(tokenizer_json='{"model": {"type": "BPE"}, "x": "\u00e9"}',
            chat_template="{{ messages }}", source={"kind": "test", "description": "unit"},
            special_tokens={"eos_token_ids": [7]}, extra={"recipe": "mixed"})


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / "m.ninfer"
    sha = write_artifact(path, CFG, _tensors(quantized=True), **META)
    return path, sha


def _copy(good, tmp_path, name="c.ninfer"):
    dst = tmp_path / name
    dst.write_bytes(good[0].read_bytes())
    return dst


def _header(path):
    return A.HEADER.unpack(path.read_bytes()[:A.HEADER.size])


def _rewrite_directory(path, mutate):
    """Apply `mutate` to the directory JSON and re-seal it (new hash, new length): a file that is
    internally consistent at the container level, so only the semantic checks can catch it."""
    raw = bytearray(path.read_bytes())
    magic, ver, align, off, length, _ = _header(path)
    d = json.loads(bytes(raw[off:off + length]))
    mutate(d)
    blob = A.canonical_json(d)
    raw[off:] = blob
    raw[:A.HEADER.size] = A.HEADER.pack(magic, ver, align, off, len(blob),
                                          hashlib.sha256(blob).digest())
    path.write_bytes(bytes(raw))


# ---- round trips ------------------------------------------------------------------------------
def test_roundtrip_values_metadata_and_identity(good):
    path, sha = good
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    with open_artifact(path, expected_sha256=sha) as art:
        assert art.sha256 == sha and art.config == CFG
        assert art.tokenizer_json == META["tokenizer_json"]
        assert art.chat_template == META["chat_template"]
        assert art.special_tokens == META["special_tokens"]
        assert art.source == META["source"] and art.extra == META["extra"]
        assert art.tensor_names == list(CFG.tensor_specs())  # file order = stream order
        loaded = art.load_all()
        for name, want in _tensors(quantized=True):
            got = loaded[name]
            if isinstance(want, QTensor):
                assert isinstance(got, QTensor) and (got.fmt, got.shape) == (want.fmt, want.shape)
                for k in ("data", "scale"):
                    assert got.parts()[k].dtype == want.parts()[k].dtype
                    assert np.array_equal(got.parts()[k], want.parts()[k])
            else:
                assert got.dtype == want.dtype and np.array_equal(got, want)
                assert not got.flags.writeable  # a view of the read-only map
        entry = art.entry("lm_head")
        assert all(p["offset"] % ALIGN == 0 for p in entry["parts"].values())


def test_fp32_roundtrip_and_header_layout(tmp_path):
    path = tmp_path / "f.ninfer"
    tensors = {n: v.astype(np.float32) if not isinstance(v, QTensor) else v
               for n, v in _tensors(seed=3)}
    write_artifact(path, CFG, iter(tensors.items()))
    raw = path.read_bytes()
    magic, ver, align, off, length, digest = _header(path)
    assert (magic, ver, align) == (MAGIC, 1, ALIGN) and off % ALIGN == 0
    assert off + length == len(raw) and raw[A.HEADER.size:ALIGN] == bytes(ALIGN - A.HEADER.size)
    d = json.loads(raw[off:])
    assert raw[off:] == A.canonical_json(d)  # sorted keys, compact
    assert d["model"]["config_hash"] == CFG.canonical_hash()
    with open_artifact(path) as art:
        for n, v in tensors.items():
            assert np.array_equal(art.load(n), v)
        assert art.tokenizer_json is None and art.chat_template is None


def test_identical_inputs_give_identical_bytes(tmp_path, good):
    again = tmp_path / "again.ninfer"
    assert write_artifact(again, CFG, _tensors(quantized=True), **META) == good[1]
    assert again.read_bytes() == good[0].read_bytes()


def test_progress_reports_every_tensor(tmp_path):
    calls = []
    write_artifact(tmp_path / "p.ninfer", CFG, _tensors(), progress=lambda *a: calls.append(a))
    n = len(CFG.tensor_specs())
    assert [c[0] for c in calls] == list(range(1, n + 1)) and all(c[1] == n for c in calls)
    assert calls[-1][3] % ALIGN == 0


# ---- atomic, strict writing -------------------------------------------------------------------
def test_failed_write_leaves_old_file_and_no_temp(tmp_path, good):
    path = _copy(good, tmp_path)
    before = path.read_bytes()

    def broken():
        for i, item in enumerate(_tensors()):
            if i == 10:
                raise RuntimeError("disk on fire")
            yield item

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_artifact(path, CFG, broken())
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def _drop(name):
    return lambda ts: ((n, v) for n, v in ts if n != name)


def _dup(ts):
    ts = list(ts)
    return iter(ts + ts[:1])


def _extra(ts):
    yield from ts
    yield "layers.99.mlp.up_proj", np.zeros((4, 4), np.float32)


def _reshape(ts):
    for n, v in ts:
        yield n, (v[:, :-1] if n == "lm_head" else v)


def _f64(ts):
    for n, v in ts:
        yield n, (v.astype(np.float64) if n == "norm" else v)


@pytest.mark.parametrize("edit, msg", [
    (_drop("layers.1.self_attn.k_norm"), "missing"),
    (_dup, "given twice"),
    (_extra, "unexpected tensor"),
    (_reshape, "shape mismatch"),
    (_f64, "float64 cannot be stored"),
])
def test_writer_refuses_bad_tensor_sets(tmp_path, edit, msg):
    path = tmp_path / "bad.ninfer"
    with pytest.raises(ArtifactError, match=msg):
        write_artifact(path, CFG, edit(_tensors()))
    assert list(tmp_path.iterdir()) == []


# ---- strict reading ---------------------------------------------------------------------------
def _flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


def test_bad_magic(tmp_path, good):
    path = _copy(good, tmp_path)
    _flip(path, 0)
    with pytest.raises(ArtifactError, match="bad magic"):
        open_artifact(path)


def test_unsupported_version(tmp_path, good):
    path = _copy(good, tmp_path)
    raw = bytearray(path.read_bytes())
    raw[8:12] = struct.pack("<I", 2)
    path.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="unsupported format version 2"):
        open_artifact(path)


@pytest.mark.parametrize("keep", [0, 30, ALIGN, 3 * ALIGN + 5, -1])
def test_truncated(tmp_path, good, keep):
    path = _copy(good, tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:keep] if keep >= 0 else raw[:-1])
    with pytest.raises(ArtifactError, match="truncated"):
        open_artifact(path)


def test_trailing_bytes(tmp_path, good):
    path = _copy(good, tmp_path)
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(ArtifactError, match="trailing bytes"):
        open_artifact(path)


def test_directory_hash_mismatch(tmp_path, good):
    path = _copy(good, tmp_path)
    _flip(path, _header(path)[3] + 10)
    with pytest.raises(ArtifactError, match="directory hash mismatch"):
        open_artifact(path)


def test_payload_hash_mismatch(tmp_path, good):
    path = _copy(good, tmp_path)
    with open_artifact(path) as art:
        off = art.entry("layers.2.mlp.down_proj")["parts"]["data"]["offset"]
    _flip(path, off + 3)
    with pytest.raises(ArtifactError, match="payload hash mismatch.*layers.2.mlp.down_proj/data"):
        open_artifact(path)
    with open_artifact(path, verify=False) as art:  # structure alone still reads
        assert art.sha256 != good[1]
        with pytest.raises(ArtifactError, match="payload hash mismatch"):
            art.verify()


def test_padding_bytes_are_covered_by_the_file_identity(tmp_path, good):
    path = _copy(good, tmp_path)
    _flip(path, ALIGN - 1)  # header padding: no part hash covers it, the file sha256 does
    open_artifact(path)
    with pytest.raises(ArtifactError, match="not the expected"):
        open_artifact(path, expected_sha256=good[1])


def test_expected_sha256(good):
    with pytest.raises(ArtifactError, match="not the expected"):
        open_artifact(good[0], expected_sha256="0" * 64, verify=False)
    open_artifact(good[0], expected_sha256=good[1].upper(), verify=False).close()


def _set(name, *path_and_value):
    *keys, value = path_and_value

    def mutate(d):
        e = d["tensors"][name]
        for k in keys[:-1]:
            e = e[k]
        e[keys[-1]] = value
    return mutate


def _relabel_bf16_as_fp32(d):
    e = d["tensors"]["embed_tokens"]
    e["dtype"] = e["parts"]["data"]["dtype"] = "float32"


def _del_tensor(d):
    del d["tensors"]["layers.0.linear_attn.A_log"]


def _add_tensor(d):
    d["tensors"]["layers.9.mlp.gate_proj"] = d["tensors"]["layers.0.mlp.gate_proj"]


def _bad_config(d):
    d["model"]["config"]["num_layers"] = 3


def _overlap(d):
    d["tensors"]["norm"]["parts"]["data"]["offset"] = \
        d["tensors"]["embed_tokens"]["parts"]["data"]["offset"]


@pytest.mark.parametrize("mutate, msg", [
    (_del_tensor, r"missing.*layers.0.linear_attn.A_log"),
    (_add_tensor, r"unexpected tensor.*layers.9.mlp.gate_proj"),
    (_set("embed_tokens", "shape", [512, 65]), "shape mismatch"),
    (_set("embed_tokens", "parts", "data", "dtype", "float32"), "mislabelled dtype"),
    (_set("embed_tokens", "dtype", "float32"), "mislabelled dtype"),
    (_relabel_bf16_as_fp32, r"holds 65536 bytes .* \(mislabelled dtype or shape\)"),
    (_set("norm", "parts", "data", "dtype", "int8"), "mislabelled dtype"),
    (_set("embed_tokens", "format", "int2"), "unknown format"),
    (_set("lm_head", "parts", "data", "offset", 4097), "not a multiple of 4096"),
    (_bad_config, "bad model config"),
    (_overlap, "overlap"),
])
def test_semantic_errors_in_a_resealed_directory(tmp_path, good, mutate, msg):
    path = _copy(good, tmp_path)
    _rewrite_directory(path, mutate)
    with pytest.raises(ArtifactError, match=msg):
        open_artifact(path, verify=False)


def test_quantized_part_mislabelled(tmp_path, good):
    path = _copy(good, tmp_path)
    with open_artifact(path, verify=False) as art:
        name = next(n for n in art.tensor_names if art.entry(n)["format"] == INT8_ROW)
    _rewrite_directory(path, _set(name, "parts", "data", "dtype", "uint8"))
    with pytest.raises(ArtifactError, match=f"{name}.*mislabelled dtype"):
        open_artifact(path, verify=False)


def test_missing_file():
    with pytest.raises(ArtifactError, match="cannot open artifact"):
        open_artifact("/nonexistent/x.ninfer")


def test_lazy_identity_without_verify(good):
    with open_artifact(good[0], verify=False) as art:
        assert art._sha256 is None
        assert art.sha256 == good[1]


def test_close_with_live_views(good):
    art = open_artifact(good[0], verify=False)
    w = art.load("lm_head")
    art.close()  # must not raise while a view is alive
    assert w.shape == (CFG.vocab_size, CFG.hidden_size)
    del w


def test_loader_style_stream_of_jax_arrays(tmp_path):
    import jax.numpy as jnp
    path = tmp_path / "j.ninfer"
    write_artifact(path, CFG, ((n, jnp.asarray(v.astype(np.float32))) for n, v in _tensors()))
    with open_artifact(path) as art:
        assert art.load("norm").dtype == np.float32
