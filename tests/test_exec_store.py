"""The compiled-executable store (engine/runtime/exec_store.py): an engine whose widths are in
the store loads them without tracing and generates the same tokens; a file that is not this
secret's is deleted unread; any change to what the lowering depends on is another key."""
from __future__ import annotations

import functools
import os
import secrets
import stat
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.runtime import exec_store
from engine.runtime.exec_store import MAGIC, ExecStore, describe
from engine.runtime.scheduler import piece_widths
from tests.engine_runs import greedy_tokens


@functools.partial(jax.jit, static_argnames=("k",), donate_argnames=("c",))
def _f(x, c, k):
    return x * k + c.sum(), c + 1


def _compiled():
    return _f.lower(jnp.arange(4.0), jnp.ones(3), k=3).compile()


def _run(compiled):
    y, c = compiled(jnp.arange(4.0), jnp.ones(3))
    return np.asarray(y), np.asarray(c)


def _key(tag: str) -> str:
    return describe({"test": tag})


def test_round_trip_modes_and_pruning(tmp_path):
    store = ExecStore(tmp_path / "ex", secrets.token_bytes(32))
    assert stat.S_IMODE(os.stat(tmp_path / "ex").st_mode) == 0o700
    k1, k2 = _key("a"), _key("b")
    assert store.load(k1) is None  # absent
    want = _run(_compiled())
    assert store.save(k1, _compiled()) and store.save(k2, _compiled())
    path = tmp_path / "ex" / f"{k1}.exe"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes().startswith(MAGIC)
    got = store.load(k1)
    assert isinstance(got, jax.stages.Compiled)
    for a, b in zip(_run(got), want):
        np.testing.assert_array_equal(a, b)
    # A new store object over the same directory and secret (a restart) loads it too.
    assert store.counts["loaded"] == 1 and store.counts["saved"] == 2
    (tmp_path / "ex" / ".tmp-left.exe").write_bytes(b"partial")  # a crash mid-save
    assert store.keep([k2]) == 1  # the leftover; k1 was used just now
    month_ago = time.time() - 30 * 86400
    os.utime(path, (month_ago, month_ago))
    assert store.keep([k1, k2]) == 0  # current: kept however old
    assert store.keep([k2]) == 1  # unused for a month and not current: gone
    assert sorted(p.name for p in (tmp_path / "ex").iterdir()) == [f"{k2}.exe"]
    with pytest.raises(ValueError):
        store.load("../../etc/passwd")


@pytest.mark.parametrize("damage", ["flip_body", "flip_tag", "truncate", "magic",
                                    "other_secret", "other_key"])
def test_a_file_not_tagged_by_this_secret_is_deleted_unread(tmp_path, damage, monkeypatch):
    secret = secrets.token_bytes(32)
    store = ExecStore(tmp_path, secret)
    key = _key("x")
    assert store.save(key, _compiled())
    path = tmp_path / f"{key}.exe"
    data = bytearray(path.read_bytes())
    if damage == "flip_body":
        data[-100] ^= 1
    elif damage == "flip_tag":
        data[len(MAGIC) + 3] ^= 1
    elif damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "magic":
        data[0] ^= 1
    elif damage == "other_secret":
        ExecStore(tmp_path / "o", secrets.token_bytes(32)).save(key, _compiled())
        data = bytearray((tmp_path / "o" / f"{key}.exe").read_bytes())
    elif damage == "other_key":  # a genuine file copied under another key
        other = _key("y")
        path = tmp_path / f"{other}.exe"
        key = other
    path.write_bytes(bytes(data))
    unpickled = []
    monkeypatch.setattr(exec_store.pickle, "loads", lambda b: unpickled.append(b))
    assert store.load(key) is None
    assert not unpickled and not path.exists()
    assert store.counts["rejected"] == 1


def test_an_authentic_file_that_does_not_load_is_compiled_anew(tmp_path):
    store = ExecStore(tmp_path, secrets.token_bytes(32))
    key = _key("junk")
    body = b"not a pickle"
    (tmp_path / f"{key}.exe").write_bytes(MAGIC + store._tag(key, body) + body)
    assert store.load(key) is None and store.counts["failed"] == 1
    assert not (tmp_path / f"{key}.exe").exists()


def test_key_follows_code_settings_and_call(monkeypatch):
    base = _key("k")
    assert _key("k") == base and _key("k2") != base
    given = os.environ.get("XLA_FLAGS")
    monkeypatch.setenv("XLA_FLAGS", f"{given or ''} --xla_cpu_enable_fast_math=false")
    assert _key("k") != base  # XLA's flags (the operator's, a plan's) are part of the key
    if given is None:
        monkeypatch.delenv("XLA_FLAGS")
    else:
        monkeypatch.setenv("XLA_FLAGS", given)
    monkeypatch.setenv("NINFER_EXEC_STORE", "on")  # the store's own switch is not part of it
    assert _key("k") == base
    exec_store._source_digest[:] = ["0" * 64]  # another engine source tree
    try:
        assert _key("k") != base
    finally:
        exec_store._source_digest.clear()
    assert _key("k") == base
    with pytest.raises(ValueError):
        ExecStore("/tmp/unused-exec-store", b"short")


def test_engine_loads_every_width_without_tracing_and_generates_the_same(tiny_model,
                                                                          tmp_path):
    """First engine: compiles every width and saves them; second (a restart): loads them all,
    its lowering never called, and greedy generation gives the same tokens as the first and as
    an engine without a store."""
    store = ExecStore(tmp_path, secrets.token_bytes(32))
    widths = piece_widths(16) + [1]
    ids = list(range(5, 45))  # 40 tokens: pieces of 16, 16, 8 (padded) then decode
    counts = []

    def compile_with(eng, forbid_lowering=False):
        if forbid_lowering:
            def no_lowering(*a, **k):
                raise AssertionError("traced a width the store holds")
            eng.runner._lower = no_lowering
        eng.compile(store=store)
        if eng.exec_saving is not None:  # the saves run on a background thread
            eng.exec_saving.join()
        counts.append(dict(eng.exec_counts))

    first, d1 = greedy_tokens(tiny_model, ids, 8, before_start=compile_with)
    second, d2 = greedy_tokens(tiny_model, ids, 8,
                               before_start=lambda e: compile_with(e, forbid_lowering=True))
    plain, d3 = greedy_tokens(tiny_model, ids, 8)
    for d in (d1, d2, d3):  # an engine error says which (the engine logs its traceback)
        assert d.finish_reason == "length" and d.error is None, (d.finish_reason, d.error)
    assert counts == [{"loaded": 0, "compiled": len(widths)},
                      {"loaded": len(widths), "compiled": 0}]
    assert first == second == plain and len(first) == 8
    assert len(list(tmp_path.glob("*.exe"))) == len(widths)
    # Another engine shape (batch 2) is other keys: compiled; the first shape's files stay
    # (in use within KEEP_UNUSED_S).
    greedy_tokens(tiny_model, ids, 2, before_start=compile_with, max_concurrency=2)
    assert counts[-1] == {"loaded": 0, "compiled": len(widths)}
    assert len(list(tmp_path.glob("*.exe"))) == 2 * len(widths)


def test_cache_hits_are_told_and_fresh_options_compile_past_the_cache():
    """compile_noting_cache says when JAX's persistent cache (on in every test run, see
    conftest) supplied the executable; fresh_options() then compile it afresh, which is what
    the store keeps (a cache-loaded executable does not load in another process), and again
    afresh the next time (a store that lost its file, or another state dir sharing the cache:
    CI ran into a fixed option's entry)."""
    def f(x):
        return jnp.cumsum(x * 3.5) - 1.25

    x = jax.ShapeDtypeStruct((1237,), jnp.float32)  # a shape no other test compiles
    _, cached = exec_store.compile_noting_cache(jax.jit(f).lower(x))
    assert not cached
    jax.clear_caches()  # forget the in-memory executable: the next compile asks the disk
    _, cached = exec_store.compile_noting_cache(jax.jit(f).lower(x))
    assert cached
    for _ in range(2):
        jax.clear_caches()
        fresh, cached = exec_store.compile_noting_cache(
            jax.jit(f).lower(x), compiler_options=exec_store.fresh_options())
        assert not cached
    np.testing.assert_allclose(np.asarray(fresh(jnp.ones(1237))),
                               np.cumsum(np.full(1237, 3.5, np.float32)) - 1.25, rtol=1e-6)
