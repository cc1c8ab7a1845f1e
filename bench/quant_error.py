"""Quantisation error per lane: each lane's weight format, KV format and compute dtype against
the fp32 model, on a fixed corpus: top-1 agreement of the next-token prediction and the mean
KL divergence KL(fp32 || lane) over every position.

The model is the embedded tiny one (random weights: its logits are flatter than a trained
model's, so near-ties make top-1 agreement lower than a trained model would show; the KL is
the figure to compare between formats). The weights go through the converter's own storage
rules (engine/io/convert.py `store`); the corpus is fed in chunks through a paged cache, so
every chunk after the first attends to KV stored in the lane's format.

    .venv/bin/python bench/quant_error.py --out docs/benchmarks/quant_error.json
    .venv/bin/python bench/quant_error.py --tokens 128 --lanes cpu,rtx4090   # quick
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from engine.io.convert import store  # noqa: E402
from engine.io.tiny import embedded_tensors  # noqa: E402
from engine.model.cache import init_paged_cache  # noqa: E402
from engine.model.config import TINY  # noqa: E402
from engine.model.model import jit_forward  # noqa: E402
from engine.model.params import stack_params  # noqa: E402
from engine.ops import paged_kv as pk  # noqa: E402
from engine.text.tokenizer import Tokenizer  # noqa: E402

CORPUS = """def merge_pages(pool, src, dst):
    # copy-on-write: a shared page is copied before a row appends to it
    for s, d in zip(src, dst):
        pool[d] = pool[s].copy()
    return pool

class Session:
    def __init__(self, key, principal):
        self.key = key
        self.principal = principal
        self.responses = []

    def continue_from(self, response_id):
        if response_id not in self.responses:
            raise KeyError(f"unknown response {response_id}")
        return self.responses.index(response_id)

The checkpoint of a session holds the attention layers' KV pages and the recurrent state of
every Gated DeltaNet layer; restoring it makes the next turn continue exactly, token for token.
$ pytest tests/test_store.py -q
12 passed in 3.41s
"""
_DT = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}


def lane_formats(names: list[str]) -> dict:
    from lanes.profile import load_profile

    out = {}
    for n in names:
        p = load_profile(n)
        out[n] = {"weights": p.weights, "kv_dtype": p.kv_dtype, "compute_dtype": p.compute_dtype}
    return out


def params_for(flat32: dict, recipe: str, dtype):
    def cast(name, w):
        v = store(name, w, recipe)
        if isinstance(v, np.ndarray):
            return jnp.asarray(v.astype(np.float32)).astype(dtype) if v.ndim > 1 else \
                jnp.asarray(v, jnp.float32)
        return jax.tree.map(jnp.asarray, v)
    return stack_params({n: cast(n, w) for n, w in flat32.items()}, TINY)


def run(params, ids: list[int], kv, dtype, chunk: int) -> np.ndarray:
    """Log-probabilities [T, V] of every position, the prompt fed `chunk` tokens at a time."""
    pages = pk.kv_pages_needed(len(ids) + chunk)
    pool = pk.init_kv_pool(TINY, pages, pk.PAGE_SIZE, kv)
    cache = init_paged_cache(TINY, pool, np.arange(pages, dtype=np.int32)[None], dtype)
    fwd = jit_forward()
    out = []
    for i in range(0, len(ids), chunk):
        piece = ids[i:i + chunk]
        toks = jnp.asarray([piece + [0] * (chunk - len(piece))], jnp.int32)
        logits, _, cache = fwd(params, TINY, toks, cache,
                               lengths=jnp.asarray([len(piece)], jnp.int32))
        out.append(np.asarray(jax.nn.log_softmax(logits[0, :len(piece)].astype(jnp.float32))))
    return np.concatenate(out)


def measure(lanes: list[str], tokens: int, chunk: int) -> dict:
    tok = Tokenizer.qwen35()
    ids = (tok.encode(CORPUS) * 8)[:tokens]
    flat32 = dict(embedded_tensors(TINY))
    ref_params = params_for(flat32, "fp32", jnp.float32)
    ref = run(ref_params, ids, jnp.float32, jnp.float32, chunk)
    p_ref = np.exp(ref)
    rows = {}
    configs = dict(lane_formats(lanes))
    # each format alone, the others fp32: what the weights and the KV each cost
    for w in ("bf16", "int8", "fp8", "int4"):
        configs[f"weights {w}"] = {"weights": w, "kv_dtype": "float32", "compute_dtype": "float32"}
    for kv in ("bfloat16", "int8"):
        configs[f"kv {kv}"] = {"weights": "fp32", "kv_dtype": kv, "compute_dtype": "float32"}
    configs["compute bfloat16"] = {"weights": "fp32", "kv_dtype": "float32",
                                   "compute_dtype": "bfloat16"}
    for lane, f in configs.items():
        t = time.perf_counter()
        dtype = _DT[f["compute_dtype"]]
        got = run(params_for(flat32, f["weights"], dtype), ids, _DT[f["kv_dtype"]], dtype, chunk)
        kl = (p_ref * (ref - got)).sum(-1)
        rows[lane] = {**f, "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()),
                      "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
                      "seconds": round(time.perf_counter() - t, 2)}
        print(f"{lane:>16}: weights {f['weights']:>4}, KV {f['kv_dtype']:>8}, compute "
              f"{f['compute_dtype']:>8}: top-1 {rows[lane]['top1_agreement']:.4f}, mean KL "
              f"{rows[lane]['mean_kl']:.3g}", flush=True)
    return {"model": "embedded tiny (random weights)", "tokens": len(ids), "chunk": chunk,
            "configs": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", default="cpu,h200,rtx3090,rtx4090,rtx5090")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    res = measure([x for x in a.lanes.split(",") if x], a.tokens, a.chunk)
    from bench.suites import commit, machine
    from lanes.profile import load_profile

    res.update({"command": ".venv/bin/python bench/quant_error.py " +
                " ".join(argv if argv is not None else sys.argv[1:]),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": machine(), "commit": commit(),
                "jax": jax.__version__, "backend": jax.default_backend(),
                "plans": {n: load_profile(n).plan.describe()
                          for n in a.lanes.split(",") if n}})
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
