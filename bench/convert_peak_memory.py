"""Peak memory of `engine.io.convert` on a large synthetic checkpoint (run by hand, not in CI).

    .venv/bin/python bench/convert_peak_memory.py [--dir /tmp/ninfer-bench] [--layers 4]
        [--recipes bf16,int8,int4,fp32] [--keep]

Writes a Qwen3_5ForCausalLM checkpoint with the real 27B widths (hidden 5120, MLP 17408, vocab
248320, 27B head layout) but only `--layers` layers, in bf16, as two safetensors shards written
piece by piece (this script never holds a whole tensor). Its largest tensors, embed_tokens and
lm_head (2.54 GB each in bf16), are exactly the 27B's, so the converter's peak memory here is its
peak on the real model.

Measured on the 2-core CPU machine (2026-11-30, 4 layers, 8.13 GB): import-only baseline 0.44 GB;
peak RSS bf16 2.70 GB, int8 4.23 GB, int4 3.62 GB, fp32 7.79 GB (L = 2.54 GB): within
0.5 GB + L x {bf16 1, int8 1.5, int4 1.3, fp32 3}, independent of the number of layers.

Each recipe runs in a child process; we report its peak RSS (wait4's
ru_maxrss), the import-only baseline, and the time, then check the output opens and verifies.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.io.hf_config import hf_text_config_dict  # noqa: E402
from engine.model.config import QWEN38_27B  # noqa: E402

CHUNK = 64 << 20  # bytes of random data generated at a time


def hf_names(cfg) -> dict[str, tuple[int, ...]]:
    out = {}
    for name, shape in cfg.tensor_specs().items():
        if name == "lm_head":
            out["lm_head.weight"] = shape
        elif name.endswith(("A_log", "dt_bias")):
            out["model." + name] = shape
        elif name.endswith("conv1d"):
            out["model." + name + ".weight"] = (shape[0], 1, shape[1])
        else:
            out["model." + name + ".weight"] = shape
    return out


def write_shard(path: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
    header, pos = {}, 0
    for name in sorted(shapes):
        n = math.prod(shapes[name]) * 2
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]),
                        "data_offsets": [pos, pos + n]}
        pos += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name in sorted(shapes):
            left = math.prod(shapes[name])
            std = 0.02 if len(shapes[name]) > 1 else 0.1
            while left:
                k = min(left, CHUNK // 2)
                x = (rng.standard_normal(k, dtype=np.float32) * std).view(np.uint32)
                f.write(((x + 0x8000) >> 16).astype(np.uint16).tobytes())  # fp32 -> bf16 bits
                left -= k


def make_checkpoint(d: Path, layers: int) -> int:
    import dataclasses
    cfg = dataclasses.replace(QWEN38_27B, num_layers=layers, mtp_layers=0)
    d.mkdir(parents=True, exist_ok=True)
    hf = hf_text_config_dict(cfg) | {"architectures": ["Qwen3_5ForCausalLM"],
                                     "model_type": "qwen3_5_text"}
    (d / "config.json").write_text(json.dumps(hf, indent=1))
    names = hf_names(cfg)
    first = {k: v for k, v in names.items() if k in ("model.embed_tokens.weight",)
             or ".layers.0." in k or ".layers.1." in k}
    shards = {"model-00001-of-00002.safetensors": first,
              "model-00002-of-00002.safetensors": {k: v for k, v in names.items()
                                                   if k not in first}}
    weight_map = {}
    for i, (fname, shapes) in enumerate(shards.items()):
        if not (d / fname).exists():
            write_shard(d / fname, shapes, seed=i)
        weight_map.update({k: fname for k in shapes})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sum(math.prod(s) * 2 for s in names.values())


def run_child(args: list[str]) -> tuple[int, float, int]:
    """(exit status, seconds, peak RSS bytes) of `python args...`."""
    t = time.time()
    proc = subprocess.Popen([sys.executable] + args, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        print(err.decode()[-2000:], file=sys.stderr)
    return proc.returncode, time.time() - t, usage.ru_maxrss * 1024


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/ninfer-bench")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--recipes", default="bf16,int8,int4,fp32")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    a = p.parse_args()
    d = Path(a.dir)
    t = time.time()
    total = make_checkpoint(d / "hf", a.layers)
    largest = 248320 * 5120 * 2
    print(f"checkpoint: {total / 1e9:.2f} GB bf16 in {time.time() - t:.0f} s; largest tensor "
          f"{largest / 1e9:.2f} GB", flush=True)
    _, _, base = run_child(["-c", "import engine.io.convert"])
    print(f"baseline (python + imports): peak RSS {base / 1e9:.2f} GB", flush=True)
    for recipe in a.recipes.split(","):
        out = d / f"out-{recipe}.ninfer"
        rc, secs, rss = run_child(["-m", "engine.io.convert", "--from", str(d / "hf"), "--out",
                                   str(out), "--recipe", recipe])
        if rc:
            print(f"{recipe}: converter failed ({rc})")
            return 1
        _, vsecs, vrss = run_child(["-c", "import sys; from engine.io.artifact import "
                                    "open_artifact; a = open_artifact(sys.argv[1]); "
                                    "[a.load(n) for n in a.tensor_names]", str(out)])
        print(f"{recipe}: convert {secs:.0f} s, peak RSS {rss / 1e9:.2f} GB "
              f"(= {rss / largest:.2f} x the largest tensor); "
              f"artifact {out.stat().st_size / 1e9:.2f} GB; open+verify {vsecs:.0f} s, "
              f"peak RSS {vrss / 1e9:.2f} GB", flush=True)
        out.unlink()
    if not a.keep:
        shutil.rmtree(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
