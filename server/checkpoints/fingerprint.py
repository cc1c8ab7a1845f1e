"""The runtime fingerprint: everything that must be equal for a saved state to be reused.

A restored state must be bit-identical to what this runtime would have computed, so the
fingerprint binds the weights (artifact sha256), the code that computes (a digest of the engine
sources and the JAX/XLA versions and platform), the kernel plan that computes it (every field,
engine/plan.py), the serving profile (its canonical hash, plus the fields that shape the state
spelled out for the log), and the speculative settings. Any difference makes a checkpoint
`incompatible`: it is kept (a rollback can still use it) but not restored, and the load names
the fields that differ (`differing_fields`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

SCHEMA = 1
_ENGINE_DIR = Path(__file__).resolve().parents[2] / "engine"


_SOURCES = ("*.py", "*.cu", "*.cuh", "*.h")


def engine_build_id(root: Path = _ENGINE_DIR) -> str:
    """sha256 over the engine's sources, the CUDA ops' included (relative path, NUL, bytes, in
    path order)."""
    h = hashlib.sha256(b"ninfer/engine-build/v1\0")
    for p in sorted(q for pattern in _SOURCES for q in root.rglob(pattern)):
        if "__pycache__" in p.parts:
            continue
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def runtime_fingerprint(model, profile, engine) -> dict:
    import jax
    import jaxlib

    return {
        "checkpoint_schema": SCHEMA,
        "artifact_sha256": model.sha256,
        "model_config": model.cfg.canonical_hash(),
        "engine_build": engine_build_id(),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "platform": jax.default_backend(),
        "profile_sha256": profile.canonical_hash(),
        "compute_dtype": profile.compute_dtype,
        "kv_dtype": profile.kv_dtype,
        "kv_capacity_tokens": profile.kv_capacity_tokens,
        "context_tokens": profile.context_tokens,
        "max_concurrency": profile.max_concurrency,
        "prefill_chunk": profile.prefill_chunk,
        "page_size": engine.checkpoint.page_size,
        "plan": engine.plan.to_dict(),
        # the CUDA ops' library (digest of source, FFI headers, nvcc version, arch, flags)
        "cuda_ops": cuda_ops_id(engine.plan),
        # the drafter and K ({method, draft_tokens}); None: speculation off
        "speculative": None if getattr(engine, "speculative", None) is None
        else engine.speculative.describe(),
    }


def cuda_ops_id(plan) -> str | None:
    """The name of the CUDA ops' library a plan runs (None: the plan runs none)."""
    if not plan.uses_cuda:
        return None
    from engine.kernels.cuda_build import library_digest

    return library_digest(plan)


def differing_fields(saved: dict, current: dict) -> list[str]:
    """The top-level fingerprint fields whose values differ (present in one only included)."""
    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))


def fingerprint_digest(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()
