"""HF -> .ninfer conversion: tiny random transformers models, every recipe, loud refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.io import convert as C  # noqa: E402
from engine.io.artifact import open_artifact  # noqa: E402
from engine.io.hf_checkpoint import SafetensorsFile  # noqa: E402
from engine.ops.quant import ERROR_BOUNDS, QTensor, dequantize_np  # noqa: E402

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             full_attention_interval=2, rms_norm_eps=1e-6)
TOKENIZER = '{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}'
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"


def _randomize(model, seed):
    """Norm weights, A_log and dt_bias default to constants that hide mapping bugs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def _save(model, path, *, chat_template_file=True, generation_eos=(5, 6)):
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(TOKENIZER)
    cfg = {"eos_token": "<|im_end|>"}
    if chat_template_file:
        (path / "chat_template.jinja").write_text(TEMPLATE)
    else:
        cfg["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(generation_eos)}))
    return path


def _add_mtp_shard(path, cfg_hidden=64):
    """Append an `mtp.*` shard (HF has no MTP module) and an index, as real checkpoints do."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(9)
    H, qd, kvd, I = cfg_hidden, 4 * 32, 2 * 32, 128
    shapes = {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)}
    p = "mtp.layers.0."
    shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                   p + "mlp.down_proj.weight": (H, I), p + "self_attn.q_proj.weight": (2 * qd, H),
                   p + "self_attn.k_proj.weight": (kvd, H), p + "self_attn.v_proj.weight": (kvd, H),
                   p + "self_attn.o_proj.weight": (H, qd), p + "self_attn.q_norm.weight": (32,),
                   p + "self_attn.k_norm.weight": (32,)})
    mtp = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    save_file(mtp, str(path / "model-mtp.safetensors"))
    main = SafetensorsFile(path / "model.safetensors")
    (path / "model.safetensors").rename(path / "model-main.safetensors")
    weight_map = {k: "model-main.safetensors" for k in main.tensors}
    weight_map.update({k: "model-mtp.safetensors" for k in mtp})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return mtp


@pytest.fixture(scope="module")
def q35(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SIZES)).eval()
    _randomize(model, 1)
    path = _save(model, tmp_path_factory.mktemp("hf") / "q35")
    mtp = _add_mtp_shard(path)
    sd = {k: v.numpy() for k, v in model.state_dict().items()} | mtp
    return path, model, sd


@pytest.fixture(scope="module")
def qnext(tmp_path_factory):
    torch.manual_seed(2)
    hf_cfg = transformers.Qwen3NextConfig(**SIZES, num_experts=4, num_experts_per_tok=2,
                                          mlp_only_layers=list(range(SIZES["num_hidden_layers"])))
    model = transformers.Qwen3NextForCausalLM(hf_cfg).eval()
    _randomize(model, 3)
    path = _save(model, tmp_path_factory.mktemp("hf") / "qnext", chat_template_file=False)
    return path, model, {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def converted(q35, qnext, tmp_path_factory):
    """{(model, recipe): path} for both models and every recipe."""
    out = tmp_path_factory.mktemp("out")
    paths = {}
    for label, (src, _, _) in (("q35", q35), ("qnext", qnext)):
        for recipe in C.RECIPES:
            paths[label, recipe] = out / f"{label}-{recipe}.ninfer"
            C.convert(src, paths[label, recipe], recipe, name=f"{label}-test")
    return paths


def _hf_name(name: str) -> str:
    if name.startswith("mtp.") or name == "lm_head":
        return name + ".weight"
    return "model." + name + ("" if name.endswith(("A_log", "dt_bias")) else ".weight")


def _as_f32(v):
    return dequantize_np(v) if isinstance(v, QTensor) else np.asarray(v, np.float32)


def test_fp32_conversion_is_exact_qwen3_5(q35, converted):
    _, _, sd = q35
    with open_artifact(converted["q35", "fp32"]) as art:
        cfg = art.config
        assert cfg.mtp_layers == 1 and cfg.num_layers == 4 and cfg.full_attention_interval == 2
        assert cfg.source_layout == "qwen3_5"
        assert set(art.tensor_names) == set(cfg.tensor_specs())
        for name in art.tensor_names:
            want = sd[_hf_name(name)]
            if name.endswith("conv1d"):
                want = want[:, 0, :]
            got = art.load(name)
            assert got.dtype == np.float32 and np.array_equal(got, want), name
        assert art.tokenizer_json == TOKENIZER and art.chat_template == TEMPLATE
        assert art.special_tokens["eos_token_ids"] == [5, 6]
        assert art.special_tokens["eos_token"] == "<|im_end|>"
        src = art.source
        assert src["kind"] == "huggingface" and src["architecture"] == "Qwen3_5ForCausalLM"
        files = {f["path"] for f in src["files"]}
        assert {"config.json", "model.safetensors.index.json", "model-main.safetensors",
                "model-mtp.safetensors", "tokenizer.json", "chat_template.jinja"} <= files
        assert art.extra == {"recipe": "fp32"}


def _split_reference(sd, cfg, layer):
    """Canonical qkv/z/b/a from HF's own fix_query_key_value_ordering, run on an identity input:
    the projections of e_i are the weight columns, so this reads HF's split of the rows."""
    net = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet
    mod = object.__new__(net)
    mod.num_k_heads, mod.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    mod.head_k_dim, mod.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    p = f"model.layers.{layer}.linear_attn."
    qkvz = torch.from_numpy(sd[p + "in_proj_qkvz.weight"].T.copy())[None]  # [1, H, rows]
    ba = torch.from_numpy(sd[p + "in_proj_ba.weight"].T.copy())[None]
    q, k, v, z, b, a = mod.fix_query_key_value_ordering(qkvz, ba)
    flat = [t.reshape(1, t.shape[1], -1)[0].T.numpy() for t in (q, k, v, z, b, a)]
    return {"in_proj_qkv": np.concatenate(flat[:3]), "in_proj_z": flat[3],
            "in_proj_b": flat[4], "in_proj_a": flat[5]}


def test_qwen3_next_split_matches_hf_ordering(qnext, converted):
    _, _, sd = qnext
    with open_artifact(converted["qnext", "fp32"]) as art:
        cfg = art.config
        assert cfg.source_layout == "qwen3_next" and cfg.mtp_layers == 0
        for layer in range(cfg.num_layers):
            if cfg.is_attention_layer(layer):
                continue
            for leaf, want in _split_reference(sd, cfg, layer).items():
                got = art.load(f"layers.{layer}.linear_attn.{leaf}")
                assert np.array_equal(got, want), (layer, leaf)
        for name in art.tensor_names:
            if ".in_proj_" not in name:
                want = sd[_hf_name(name)]
                assert np.array_equal(art.load(name), want[:, 0, :] if "conv1d" in name else want)
        assert art.chat_template == TEMPLATE  # from tokenizer_config.json


def test_qwen3_next_converted_runs_as_qwen3_5_in_transformers(qnext, converted):
    """End to end: the split weights loaded into HF's Qwen3.5 (separate projections) give the
    Qwen3-Next model's logits."""
    _, model, _ = qnext
    q35 = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SIZES)).eval()
    with open_artifact(converted["qnext", "fp32"]) as art:
        sd = {}
        for name in art.tensor_names:
            w = torch.from_numpy(np.array(art.load(name)))
            sd[_hf_name(name)] = w[:, None, :] if name.endswith("conv1d") else w
    q35.load_state_dict(sd, strict=True)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, got = model(ids).logits, q35(ids).logits
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("label", ["q35", "qnext"])
@pytest.mark.parametrize("recipe", ["bf16", "int8", "fp8", "int4"])
def test_recipes_store_what_they_promise(label, recipe, converted):
    with open_artifact(converted[label, "fp32"]) as ref, \
            open_artifact(converted[label, recipe]) as art:
        assert art.config == ref.config and art.extra == {"recipe": recipe}
        fmt = C.RECIPES[recipe]
        for name in art.tensor_names:
            got, want = art.load(name), ref.load(name)
            small = want.ndim == 1 or name.endswith("conv1d")
            if small:
                assert got.dtype == np.float32 and np.array_equal(got, want), name
            elif name == "embed_tokens" or recipe == "bf16":
                assert str(got.dtype) == "bfloat16"
                np.testing.assert_allclose(_as_f32(got), want, rtol=2 ** -8, atol=0)
            else:
                assert isinstance(got, QTensor) and got.fmt == fmt, name
                err = np.linalg.norm(_as_f32(got) - want) / np.linalg.norm(want)
                assert err <= ERROR_BOUNDS[fmt], (name, err)


def test_double_conversion_is_byte_identical(q35, converted, tmp_path):
    again = tmp_path / "again.ninfer"
    C.convert(q35[0], again, "int4", name="q35-test")
    assert again.read_bytes() == converted["q35", "int4"].read_bytes()


def test_vision_language_wrapper(tmp_path):
    torch.manual_seed(5)
    text = {k: v for k, v in SIZES.items()}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, num_position_embeddings=16)
    model = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    _randomize(model, 6)
    src = _save(model, tmp_path / "vl")
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    out = tmp_path / "vl.ninfer"
    C.convert(src, out, "fp32")
    with open_artifact(out) as art:
        assert art.config.name == "vl" and art.config.mtp_layers == 0
        n_visual = sum(1 for k in sd if k.startswith("model.visual."))
        assert art.source["skipped"] == {"model.visual.": n_visual} and n_visual > 0
        for name in art.tensor_names:
            hf = _hf_name(name).replace("model.", "model.language_model.", 1)
            want = sd[hf][:, 0, :] if name.endswith("conv1d") else sd[hf]
            assert np.array_equal(art.load(name), want), name


def test_moe_checkpoint_refused(tmp_path):
    torch.manual_seed(7)
    moe = transformers.Qwen3NextConfig(**{**SIZES, "num_hidden_layers": 2}, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=32, mlp_only_layers=[0])
    src = _save(transformers.Qwen3NextForCausalLM(moe), tmp_path / "moe")
    with pytest.raises(C.ConvertError, match=r"mixture-of-experts.*sparse layers \[1\]"):
        C.convert(src, tmp_path / "moe.ninfer", "bf16")
    assert not (tmp_path / "moe.ninfer").exists()


def _edit_checkpoint(src, dst, *, config=None, drop=(), add=None):
    """Copy a single-file HF checkpoint with a config edit and tensors dropped or added."""
    from safetensors.numpy import save_file
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())
    ckpt = C.HFCheckpoint(src)
    tensors = {k: ckpt.read(k) for k in ckpt.tensor_names if k not in drop and
               not k.startswith("mtp.")}
    save_file(tensors | (add or {}), str(dst / "model.safetensors"))
    if config:
        (dst / "config.json").write_text(json.dumps({**ckpt.config, **config}))
    return dst


def test_tied_embeddings_fill_lm_head(q35, tmp_path):
    src = _edit_checkpoint(q35[0], tmp_path / "tied", config={"tie_word_embeddings": True},
                           drop={"lm_head.weight"})
    C.convert(src, tmp_path / "t.ninfer", "fp32")
    with open_artifact(tmp_path / "t.ninfer") as art:
        assert np.array_equal(art.load("lm_head"), art.load("embed_tokens"))
        assert art.config.mtp_layers == 0


@pytest.mark.parametrize("edit, msg", [
    (dict(drop={"model.layers.1.self_attn.k_norm.weight"}), "not in the checkpoint"),
    (dict(drop={"lm_head.weight"}), r"not in the checkpoint.*lm_head"),
    (dict(add={"model.layers.0.mystery.weight": np.zeros(3, np.float32)}), "map to nothing"),
    (dict(config={"architectures": ["LlamaForCausalLM"]}), "unsupported architecture"),
])
def test_bad_checkpoints_refused(q35, tmp_path, edit, msg):
    src = _edit_checkpoint(q35[0], tmp_path / "bad", **edit)
    with pytest.raises(C.ConvertError, match=msg):
        C.convert(src, tmp_path / "bad.ninfer", "bf16")
    assert not (tmp_path / "bad.ninfer").exists()


def test_cli(q35, tmp_path, capsys):
    out = tmp_path / "cli.ninfer"
    assert C.main(["--from", str(q35[0]), "--out", str(out), "--recipe", "int8"]) == 0
    cap = capsys.readouterr()
    with open_artifact(out) as art:
        assert f"sha256 {art.sha256}" in cap.out
        n = len(art.tensor_names)
    assert f"[{n}/{n}]" in cap.err and "hashed config.json" in cap.err
    assert C.main(["--from", str(tmp_path / "nope"), "--out", str(out)]) == 1
    assert "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        C.main(["--from", str(q35[0]), "--out", str(out), "--recipe", "int2"])


def test_truncated_shard_refused(q35, tmp_path):
    src = tmp_path / "cut"
    src.mkdir()
    for f in q35[0].iterdir():
        data = f.read_bytes()
        (src / f.name).write_bytes(data[:-100] if f.name == "model-main.safetensors" else data)
    with pytest.raises(C.ConvertError, match=r"model-main.safetensors: tensor .* outside the file"):
        C.convert(src, tmp_path / "cut.ninfer", "bf16")


def test_convert_plans_its_peak_memory_and_disk_and_refuses_when_short(tmp_path):
    """The real 27B's needs, from its shapes: the largest tensor (embedding / lm_head, 2.54 GB
    in bf16) sets the peak; the artifact is the stored payload."""
    from engine.io.convert import resource_problems, resources_needed, stored_bytes
    from engine.model.config import QWEN38_27B

    largest = 248_320 * 5_120 * 2
    need = resources_needed(QWEN38_27B, "int4")
    assert need["ram"] == int(((512 << 20) + 1.3 * largest) * 1.25)
    assert need["disk"] == stored_bytes(QWEN38_27B, "int4") + (1 << 20)
    assert resources_needed(QWEN38_27B, "fp32")["ram"] > need["ram"]
    ok = resource_problems(QWEN38_27B, "int4", tmp_path / "m.ninfer",
                           ram_available=lambda: 64 << 30, disk_free=lambda p: 1 << 40)
    assert ok == []
    short = resource_problems(QWEN38_27B, "int4", tmp_path / "m.ninfer",
                              ram_available=lambda: 2 << 30, disk_free=lambda p: 10 << 30)
    assert len(short) == 2
    assert "memory at its peak" in short[0] and "2.0 GiB is available" in short[0]
    assert "artifact needs 16.0 GiB" in short[1] and "10.0 GiB is free" in short[1]
