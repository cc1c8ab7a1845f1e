"""Hugging Face checkpoint -> .ninfer artifact, one tensor at a time.

    ./ninfer convert --from HF_DIR --out FILE.ninfer --recipe {fp32,bf16,int8,fp8,int4}

Supported: Qwen3_5ForCausalLM (`model.*`), Qwen3_5ForConditionalGeneration (text under
`model.language_model.*`; `model.visual.*` skipped and listed in the source identity) and
Qwen3NextForCausalLM with dense MLPs (fused `in_proj_qkvz` / `in_proj_ba` split into the
canonical Qwen3.5 projections). `mtp.*` tensors are kept (cfg.mtp_layers = 1) when present.

What each recipe stores (docs/formats/artifact.md):
    norms, A_log, dt_bias, conv1d ([C, 1, K] -> [C, K])     fp32 in every recipe (tiny; exact)
    embed_tokens                                            fp32 (fp32 recipe), else bf16
    2-D projections incl. lm_head and mtp.fc                fp32 | bf16 | int8_row | fp8_row |
                                                            int4_g64, by recipe
Peak memory is about one source tensor plus its converted form (see bench/convert_peak_memory.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Callable, Iterator

import ml_dtypes
import numpy as np

from engine.io.artifact import ArtifactError, write_artifact
from engine.io.hf_checkpoint import CheckpointError, HFCheckpoint
from engine.io.hf_config import model_config_from_hf
from engine.io.host import existing_parent, free_disk, meminfo
from engine.model.config import ConfigError, ModelConfig
from engine.ops.quant import (DTYPES, FP8_ROW, INT4_G64, INT8_ROW, QuantError, part_layout,
                              quantize)

RECIPES = {"fp32": None, "bf16": None, "int8": INT8_ROW, "fp8": FP8_ROW, "int4": INT4_G64}
# architecture -> prefix of the text model's tensors
ARCHITECTURES = {
    "Qwen3_5ForCausalLM": "model.",
    "Qwen3_5ForConditionalGeneration": "model.language_model.",
    "Qwen3NextForCausalLM": "model.",
}
_SKIPPED_PREFIXES = {"Qwen3_5ForConditionalGeneration": ("model.visual.",)}
_MOE_NAME = re.compile(r"\.mlp\.(experts|gate|shared_expert|shared_expert_gate)\.")


class ConvertError(ValueError):
    """A checkpoint this converter refuses, with the reason."""


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one canonical tensor comes from: HF tensor(s) and a numpy transform."""
    hf_names: tuple[str, ...]
    make: Callable[..., np.ndarray]


# ---- checkpoint -> model config -------------------------------------------------------------
def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ConvertError(f"unsupported architecture {archs}; supported: {sorted(ARCHITECTURES)}")
    return archs[0]


def _refuse_moe(hf: dict, ckpt: HFCheckpoint) -> dict:
    """Raise on a mixture-of-experts checkpoint; returns the config with num_experts zeroed when
    every layer is dense (Qwen3-Next configs carry num_experts=512 even then)."""
    t = hf.get("text_config", hf)
    n_exp, n = int(t.get("num_experts") or 0), int(t.get("num_hidden_layers", 0))
    step, dense = int(t.get("decoder_sparse_step") or 1), set(t.get("mlp_only_layers") or [])
    sparse = [i for i in range(n) if n_exp > 0 and i not in dense and (i + 1) % step == 0]
    moe_tensors = [k for k in ckpt.tensor_names if _MOE_NAME.search(k)]
    if sparse or moe_tensors:
        raise ConvertError(f"mixture-of-experts checkpoint (num_experts={n_exp}, sparse layers "
                           f"{sparse[:8]}{'...' if len(sparse) > 8 else ''}, expert tensors e.g. "
                           f"{moe_tensors[:2]}): this engine runs dense MLPs only")
    if "num_experts" not in t:
        return hf
    t = {**t, "num_experts": 0}
    return {**hf, "text_config": t} if "text_config" in hf else t


def model_config(ckpt: HFCheckpoint, name: str) -> tuple[ModelConfig, str]:
    """(ModelConfig, architecture). mtp_layers follows the tensors actually present."""
    arch = _architecture(ckpt.config)
    hf = _refuse_moe(ckpt.config, ckpt)
    try:
        cfg = model_config_from_hf(hf, name)
        mtp = sorted({int(m.group(1)) for k in ckpt.tensor_names
                      if (m := re.match(r"mtp\.layers\.(\d+)\.", k))})
        if mtp not in ([], [0]):
            raise ConvertError(f"checkpoint has MTP layers {mtp}; this engine supports one")
        return dataclasses.replace(cfg, mtp_layers=len(mtp)), arch
    except ConfigError as e:
        raise ConvertError(str(e)) from None


# ---- canonical name -> source ---------------------------------------------------------------
def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _conv(x: np.ndarray) -> np.ndarray:  # depthwise conv weight [C, 1, K] -> [C, K]
    if x.ndim != 3 or x.shape[1] != 1:
        raise ConvertError(f"conv1d weight has shape {list(x.shape)}, expected [C, 1, K]")
    return x[:, 0, :]


def _split_qkvz(cfg: ModelConfig, part: str) -> Callable[[np.ndarray], np.ndarray]:
    """Qwen3-Next in_proj_qkvz rows are grouped per key head g: [q_g | k_g | v_g | z_g] with
    q_g, k_g = dk rows and v_g, z_g = r*dv rows (r = value heads per key head). The canonical
    in_proj_qkv is [all q | all k | all v] and in_proj_z [all z]; value head g*r+j stays g*r+j,
    which is the grouping Qwen3.5's repeat_interleave of q/k expects."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    rdv = cfg.linear_num_value_heads // hk * dv

    def make(w: np.ndarray) -> np.ndarray:
        g = w.reshape(hk, 2 * dk + 2 * rdv, w.shape[-1])
        q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + rdv], axis=1)
        if part == "z":
            return np.ascontiguousarray(z.reshape(-1, w.shape[-1]))
        return np.concatenate([t.reshape(-1, w.shape[-1]) for t in (q, k, v)])
    return make


def _split_ba(cfg: ModelConfig, part: str) -> Callable[[np.ndarray], np.ndarray]:
    """in_proj_ba rows per key head g: [b_g (r rows) | a_g (r rows)]."""
    hk = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // hk

    def make(w: np.ndarray) -> np.ndarray:
        g = w.reshape(hk, 2 * r, w.shape[-1])
        return np.ascontiguousarray((g[:, :r] if part == "b" else g[:, r:]).reshape(-1,
                                                                                    w.shape[-1]))
    return make


def plan(cfg: ModelConfig, ckpt: HFCheckpoint, arch: str) -> tuple[dict[str, Source], list[str]]:
    """{canonical name: Source} for every tensor of cfg, and the HF tensors skipped on purpose.
    Raises ConvertError naming HF tensors that are missing or that nothing maps."""
    prefix, have = ARCHITECTURES[arch], set(ckpt.tensor_names)
    fused = cfg.source_layout == "qwen3_next"
    tied = bool(ckpt.config.get("tie_word_embeddings") or
                ckpt.config.get("text_config", {}).get("tie_word_embeddings"))
    out: dict[str, Source] = {}
    for name in cfg.tensor_specs():
        if name.startswith("mtp."):
            hf = name + (".weight" if not name.endswith(("A_log", "dt_bias")) else "")
        elif name == "lm_head":
            hf = "lm_head.weight" if "lm_head.weight" in have or not tied \
                else prefix + "embed_tokens.weight"
        else:
            hf = prefix + name + ("" if name.endswith(("A_log", "dt_bias")) else ".weight")
        leaf = name.rsplit(".", 1)[-1]
        if fused and leaf in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            base = hf.rsplit(".", 2)[0]
            if leaf in ("in_proj_qkv", "in_proj_z"):
                out[name] = Source((base + ".in_proj_qkvz.weight",),
                                   _split_qkvz(cfg, "z" if leaf == "in_proj_z" else "qkv"))
            else:
                out[name] = Source((base + ".in_proj_ba.weight",), _split_ba(cfg, leaf[-1]))
        else:
            out[name] = Source((hf,), _conv if leaf == "conv1d" else _identity)
    used = {h for s in out.values() for h in s.hf_names}
    missing = sorted(used - have)
    if missing:
        raise ConvertError(f"{len(missing)} tensor(s) the model needs are not in the checkpoint, "
                           f"e.g. {missing[:5]}")
    skip_prefixes = _SKIPPED_PREFIXES.get(arch, ())
    skipped = sorted(h for h in have - used if h.startswith(skip_prefixes))
    unmapped = sorted(have - used - set(skipped))
    if unmapped:
        raise ConvertError(f"{len(unmapped)} checkpoint tensor(s) map to nothing, e.g. "
                           f"{unmapped[:5]}")
    return out, skipped


# ---- recipes --------------------------------------------------------------------------------
def store(name: str, w: np.ndarray, recipe: str):
    """The stored form of canonical tensor `name` under `recipe` (see the module doc)."""
    if w.ndim == 1 or name.endswith("conv1d") or recipe == "fp32":
        return w.astype(np.float32, copy=False)
    if name == "embed_tokens" or recipe == "bf16":
        return w.astype(ml_dtypes.bfloat16, copy=False)
    try:
        return quantize(w, RECIPES[recipe])
    except QuantError as e:
        raise ConvertError(f"tensor {name!r}: {e}; try a different --recipe") from None


def converted_tensors(ckpt: HFCheckpoint, sources: dict[str, Source], recipe: str,
                      log=None) -> Iterator[tuple[str, object]]:
    """Yield (name, stored value) in cfg order; a fused HF tensor is read once for its parts."""
    cache: tuple[str, np.ndarray] | None = None
    total = sum(ckpt.nbytes(h) for h in {h for s in sources.values() for h in s.hf_names})
    done = 0
    for i, (name, src) in enumerate(sources.items()):
        arrays = []
        for h in src.hf_names:
            if cache is None or cache[0] != h:
                cache = None  # drop the previous tensor before reading the next
                cache = (h, ckpt.read(h))
                done += ckpt.nbytes(h)
            arrays.append(cache[1])
        value = store(name, src.make(*arrays), recipe)
        if log:
            log(f"[{i + 1}/{len(sources)}] {name} {_describe(value)}  "
                f"read {done / 1e9:.2f}/{total / 1e9:.2f} GB")
        yield name, value
        del value, arrays


def _describe(v) -> str:
    fmt = getattr(v, "fmt", None) or str(v.dtype)
    return f"{fmt}{list(v.shape)}"


# ---- what a conversion needs ------------------------------------------------------------------
# Peak resident memory over the largest source tensor L (measured with bench/convert_peak_memory.py
# on a checkpoint whose largest tensors are the 27B's: 0.44 GB after imports, then bf16 1.0 L,
# int4 1.3 L, int8 1.5 L, fp32 3.0 L over 0.5 GB), with a quarter more as margin.
_PEAK_PER_LARGEST = {"bf16": 1.0, "int4": 1.3, "int8": 1.5, "fp8": 1.5, "fp32": 3.0}
_BASE_RAM = 512 << 20
_MARGIN = 1.25


def stored_bytes(cfg: ModelConfig, recipe: str, *, mtp: bool = True) -> int:
    """Bytes of every tensor as `store` keeps it under `recipe` (the artifact's payload)."""
    if recipe not in RECIPES:
        raise ConvertError(f"unknown recipe {recipe!r}; known: {list(RECIPES)}")
    total = 0
    for name, shape in cfg.tensor_specs().items():
        if name.startswith("mtp.") and not mtp:
            continue
        n = int(np.prod(shape))
        if len(shape) == 1 or name.endswith("conv1d") or recipe == "fp32":
            total += 4 * n
        elif name == "embed_tokens" or recipe == "bf16":
            total += 2 * n
        else:
            total += sum(int(np.prod(s)) * np.dtype(DTYPES[d]).itemsize
                         for d, s in part_layout(RECIPES[recipe], shape).values())
    return total


def resources_needed(cfg: ModelConfig, recipe: str, source_itemsize: int = 2) -> dict:
    """{ram, disk} bytes a conversion of `cfg` under `recipe` needs: its peak memory (from the
    largest source tensor) and the artifact it writes (payload, plus a MiB for the directory)."""
    largest = max(int(np.prod(s)) for s in cfg.tensor_specs().values()) * source_itemsize
    ram = int((_BASE_RAM + _PEAK_PER_LARGEST[recipe] * largest) * _MARGIN)
    return {"ram": ram, "disk": stored_bytes(cfg, recipe) + (1 << 20)}


def resource_problems(cfg: ModelConfig, recipe: str, out: Path, *, ram_available=None,
                      disk_free=None) -> list[str]:
    """What keeps this machine from converting: too little available RAM or free disk."""
    need = resources_needed(cfg, recipe)
    ram = ram_available() if ram_available else meminfo("MemAvailable")
    parent = existing_parent(Path(out).resolve().parent)
    disk = (disk_free or free_disk)(parent)
    problems = []
    if ram is not None and ram < need["ram"]:
        problems.append(f"converting {cfg.name} with recipe {recipe} needs about "
                        f"{need['ram'] / 2**30:.1f} GiB of memory at its peak; "
                        f"{ram / 2**30:.1f} GiB is available: close other programs or convert "
                        f"on a larger machine")
    if disk < need["disk"]:
        problems.append(f"the artifact needs {need['disk'] / 2**30:.1f} GiB under {parent}; "
                        f"{disk / 2**30:.1f} GiB is free: free disk or choose another --out")
    return problems


# ---- entry points ---------------------------------------------------------------------------
def convert(hf_dir, out, recipe: str, *, name: str | None = None, log=None) -> str:
    """Convert the HF directory `hf_dir` to the artifact `out`; returns the artifact's sha256."""
    if recipe not in RECIPES:
        raise ConvertError(f"unknown recipe {recipe!r}; known: {list(RECIPES)}")
    try:
        ckpt = HFCheckpoint(hf_dir)
        name = name or Path(hf_dir).resolve().name
        cfg, arch = model_config(ckpt, name)
        problems = resource_problems(cfg, recipe, Path(out))
        if problems:  # refused before anything is read or written
            raise ConvertError("; ".join(problems))
        sources, skipped = plan(cfg, ckpt, arch)
        if log:
            log(f"{arch} -> {cfg.name}: {len(sources)} tensors, recipe {recipe}; hashing the "
                f"source files")
        files = ckpt.file_identities(progress=(lambda p: log(f"  hashed {p}")) if log else None)
        skipped_note = {p: sum(1 for s in skipped if s.startswith(p))
                        for p in _SKIPPED_PREFIXES.get(arch, ())}
        source = {"kind": "huggingface", "architecture": arch, "files": files,
                  "skipped": skipped_note,
                  "description": f"{arch} ({ckpt.config.get('model_type')}) converted by "
                                 f"engine.convert with recipe {recipe}"}
        return write_artifact(out, cfg, converted_tensors(ckpt, sources, recipe, log),
                              tokenizer_json=ckpt.tokenizer_json(),
                              chat_template=ckpt.chat_template(), source=source,
                              special_tokens=ckpt.special_tokens(),
                              extra={"recipe": recipe})
    except (CheckpointError, ConfigError) as e:
        raise ConvertError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ninfer convert",
                                description="Convert a Hugging Face checkpoint to .ninfer")
    p.add_argument("--from", dest="src", required=True, help="HF model directory")
    p.add_argument("--out", required=True, help="output .ninfer file")
    p.add_argument("--recipe", choices=list(RECIPES), default="bf16")
    p.add_argument("--name", help="model name (default: the HF directory's name)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        sha = convert(args.src, args.out, args.recipe, name=args.name,
                      log=None if args.quiet else log)
    except (ConvertError, ArtifactError, OSError) as e:
        print(f"ninfer convert: {e}", file=sys.stderr)
        return 1
    print(f"{args.out} sha256 {sha}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
