"""Do the forwards a GPU lane's bundle holds, exported for "cuda" by the lock's jax (0.10.2, on
a machine with no GPU, as release/build.py does), run on a GPU under the device machine's jax
(0.11.2)? The GPU test (tests/test_engine_gpu.py) exports with the jax it runs under; this one
carries the older exports across.

    # here (no GPU, the lock's jax): the h200 plan's forwards of the random tiny model
    JAX_PLATFORMS=cpu .venv/bin/python bench/lab/cuda_exports_across_jax.py export DIR
    # on the GPU machine, DIR carried: load them without tracing, 36 greedy tokens vs live
    JAX_PLATFORMS=cuda python bench/lab/cuda_exports_across_jax.py check DIR [--json F]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _tiny(state: Path) -> Path:
    from engine.io.loader import embedded_pin, ensure_embedded

    ensure_embedded(state, "tiny", embedded_pin("tiny"))
    return state / "models" / "tiny.ninfer"


def export(out: Path) -> int:
    import jax

    from tests.test_engine_gpu import _EXPORT_FOR_CUDA

    out.mkdir(parents=True, exist_ok=True)
    artifact = _tiny(Path(tempfile.mkdtemp()))
    subprocess.run([sys.executable, "-c", _EXPORT_FOR_CUDA, str(artifact), str(out)],
                   cwd=REPO, check=True)
    (out / "jax_version").write_text(jax.__version__)
    print({f.name: f.stat().st_size for f in sorted(out.glob("*.jaxexport"))})
    return 0


def check(src: Path, json_out: Path | None) -> int:
    import jax

    from engine.io.loader import load_model
    from engine.kernels import cuda_ops
    from engine.plan import H200
    from tests.engine_runs import exported_and_live

    cuda_ops.require(H200)
    model = load_model(_tiny(Path(tempfile.mkdtemp())), compute_dtype="bfloat16",
                       kv_dtype="bfloat16")
    blobs = {tuple(int(n) for n in f.stem.split("x")): f.read_bytes()
             for f in src.glob("*.jaxexport")}
    kw = dict(plan=H200, context_tokens=256, prefill_chunk=32, max_concurrency=2, max_queue=2)
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:40]
    got, live, counts, done = exported_and_live(model, ids, 36, blobs, **kw)
    result = {"exported_by_jax": (src / "jax_version").read_text().strip(),
              "run_under_jax": jax.__version__, "device": jax.devices()[0].device_kind,
              "blobs": sorted(f"{r}x{w}" for r, w in blobs), "exec_counts": counts,
              "finish_reason": done.finish_reason, "tokens_equal": got == live,
              "tokens": len(got)}
    print(json.dumps(result))
    if json_out:
        json_out.write_text(json.dumps(result, indent=1))
    return 0 if got == live and counts.get("compiled") == 0 else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("export", "check"))
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    return export(a.dir) if a.what == "export" else check(a.dir, a.json)


if __name__ == "__main__":
    sys.exit(main())
