"""Shared test setup: one persistent JAX compilation cache per test run, CPU only, fp32."""
from __future__ import annotations

import os
import tempfile

# Must be set before JAX initialises a backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False, help="also run slow tests")
    parser.addoption("--release", action="store_true", default=False,
                     help="run the release tier (only the tests marked release)")


def pytest_configure(config):
    import jax

    cache_dir = os.environ.get("NINFER_JAX_CACHE") or tempfile.mkdtemp(prefix="ninfer-jaxcache-")
    os.environ["NINFER_JAX_CACHE"] = cache_dir  # inherited by servers the tests start
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # A size limit turns on JAX's file lock around each read and write of the cache. Without
    # it an entry is written in place, and another process on the same cache (the other xdist
    # worker, a server a test started) can read it half-written and crash in XLA.
    jax.config.update("jax_compilation_cache_max_size", 8 << 30)


def pytest_collection_modifyitems(config, items):
    # The release tier is a tier of its own: --release runs its tests and nothing else, and
    # the other tiers never run them.
    release = config.getoption("--release")
    keep = [item for item in items if ("release" in item.keywords) == release]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    if config.getoption("--slow"):
        return
    skip_slow = pytest.mark.skip(reason="slow tier: run with ./ninfer test --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
    # GPU tests are never part of the CPU tiers; they run with `pytest -m gpu` on the GPU machine.
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device: run with -m gpu on the GPU machine")
    if config.getoption("-m") != "gpu":
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def shared_state_dir(tmp_path_factory):
    """One state directory per test run: the embedded model is generated into it once."""
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="session")
def embedded_models_dir(shared_state_dir):
    """The `models/` folder of the shared state dir, with the random embedded `tiny` generated
    (once)."""
    from engine.io.loader import embedded_pin, ensure_embedded

    ensure_embedded(shared_state_dir, "tiny", embedded_pin("tiny"))
    return shared_state_dir / "models"


@pytest.fixture(scope="session")
def tiny_model(embedded_models_dir):
    """The embedded model loaded once per test run (engine tests share it)."""
    from engine.io.loader import load_model

    return load_model(embedded_models_dir / "tiny.ninfer")
