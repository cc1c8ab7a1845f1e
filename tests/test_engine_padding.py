"""Right-padded prefill pieces: the claim StepLoop.run_step relies on, and the engine around it.

A piece of L tokens padded to width W (lengths = L) must leave the same KV pool, GDN state and
position, and give the same last-token logits, as the unpadded piece of L tokens; and a prompt
whose remainder runs padded must generate the same greedy tokens as one that needs no padding.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine.model.model as M
from engine.ops import paged_kv as pk
from engine.plan import PALLAS, REFERENCE
from engine.runtime.scheduler import MIN_PIECE, piece, piece_widths
from tests.engine_runs import greedy_tokens
from tests.kernel_checks import assert_close


def test_piece_sequence_8192_plus_37():
    """8192 + 37 tokens with chunk 8192: one full piece, then ONE padded piece of 37 in 64."""
    remaining, pieces = 8192 + 37, []
    while remaining:
        size, width = piece(remaining, 8192)
        pieces.append((size, width))
        remaining -= size
    assert pieces == [(8192, 8192), (37, MIN_PIECE)]
    assert piece(100, 8192) == (64, 64) and piece(36, 8192) == (36, 64)
    assert piece(5, 16) == (5, 16)  # a chunk below MIN_PIECE pads to the chunk
    assert piece_widths(8192) == [8192, 4096, 2048, 1024, 512, 256, 128, 64]
    assert piece_widths(16) == [16]


def _paged_cache(cfg, b: int, pages_per_row: int, dtype=jnp.float32):
    pool = pk.init_kv_pool(cfg, b * pages_per_row, pk.PAGE_SIZE, dtype)
    table = np.arange(b * pages_per_row, dtype=np.int32).reshape(b, pages_per_row)
    return M.init_paged_cache(cfg, pool, table, dtype)


@pytest.mark.parametrize("plan", [REFERENCE, PALLAS], ids=["reference", "pallas"])
def test_padded_piece_equals_unpadded(tiny_model, plan):
    """History of 64 tokens in row 0, then 37 more: unpadded [B, 37] vs padded [B, 64] with
    lengths 37 give the same cache (KV pool, conv, rec, pos) and last-token logits; row 1
    (length 0 throughout) is untouched either way."""
    cfg, params = tiny_model.cfg, tiny_model.params
    b, hist, n = 2, 64, 37
    rng = np.random.default_rng(11)
    ids = rng.integers(0, tiny_model.tokenizer.vocab_size, hist + n).astype(np.int32)
    fwd = M.jit_forward()

    def run(width: int):
        cache = _paged_cache(cfg, b, 4)
        tok = np.zeros((b, hist), np.int32)
        tok[0] = ids[:hist]
        _, _, cache = fwd(params, cfg, jnp.asarray(tok), cache,
                          lengths=jnp.asarray([hist, 0], jnp.int32), last_only=True,
                          plan=plan)
        tok = np.zeros((b, width), np.int32)
        tok[0, :n] = ids[hist:]
        logits, _, cache = fwd(params, cfg, jnp.asarray(tok), cache,
                               lengths=jnp.asarray([n, 0], jnp.int32), last_only=True,
                               plan=plan)
        return jax.device_get(logits[0, 0]), jax.device_get(cache)

    want_logits, want = run(n)
    got_logits, got = run(MIN_PIECE)
    # Different widths block the matmuls differently: fp32 rounding, not a state difference.
    assert_close(got_logits, want_logits, jnp.float32)
    assert list(got.pos) == [hist + n, 0]
    for name in ("conv", "rec"):
        assert_close(getattr(got, name)[:, :, 0], getattr(want, name)[:, :, 0], jnp.float32)
        assert not np.any(getattr(got, name)[:, :, 1]), f"row 1's {name} state was written"
    for a, w in zip(jax.tree.leaves(got.pool), jax.tree.leaves(want.pool)):
        assert_close(a, w, jnp.float32)
        # Pool pages are [L, pages, 64 slots, ...]: row 0 owns pages 0-3, row 1 pages 4-7.
        slots = np.asarray(a).reshape(a.shape[0], -1, *a.shape[3:])
        assert not np.any(slots[:, hist + n:]), "a padded step wrote KV"


@pytest.mark.parametrize("plan", [REFERENCE, PALLAS], ids=["reference", "pallas"])
def test_forward_rows_equals_the_padded_batch(tiny_model, plan):
    """forward_rows over cache rows [2] (and [2, 0]) of three gives what `forward` over all
    three gives with the others at length 0: the run rows' logits, GDN states, positions and
    KV; the rows not run keep their states, positions and pages bit for bit, and their logits
    rows are zeros."""
    cfg, params = tiny_model.cfg, tiny_model.params
    b, hist, n = 3, 40, 29
    rng = np.random.default_rng(12)
    ids = rng.integers(0, tiny_model.tokenizer.vocab_size, (b, hist + n)).astype(np.int32)
    fwd, fwd_rows = M.jit_forward(), M.jit_forward_rows()

    def history():  # every row holds `hist` tokens of its own
        cache = _paged_cache(cfg, b, 2)
        _, _, cache = fwd(params, cfg, jnp.asarray(ids[:, :hist]), cache,
                          lengths=jnp.full((b,), hist, jnp.int32), last_only=True,
                          plan=plan)
        return cache

    for rows in ([2], [2, 0]):
        lengths = np.zeros((b,), np.int32)
        lengths[rows] = n
        tok = np.zeros((b, 32), np.int32)
        tok[rows, :n] = ids[rows, hist:]
        want_logits, _, want = fwd(params, cfg, jnp.asarray(tok), history(),
                                   lengths=jnp.asarray(lengths), last_only=True,
                                   plan=plan)
        before = jax.device_get(history())
        got_logits, got = fwd_rows(params, cfg, jnp.asarray(tok[rows]), history(),
                                   jnp.asarray(rows, jnp.int32),
                                   lengths=jnp.asarray(lengths[rows]), plan=plan)
        got, want = jax.device_get(got), jax.device_get(want)
        others = [r for r in range(b) if r not in rows]
        assert got_logits.shape == want_logits.shape
        assert_close(np.asarray(got_logits)[rows], np.asarray(want_logits)[rows], jnp.float32)
        assert not np.any(np.asarray(got_logits)[others])
        assert list(got.pos) == list(want.pos) and list(got.mtp_pos) == list(before.mtp_pos)
        assert (np.asarray(got.block_table) == np.asarray(before.block_table)).all()
        for name in ("conv", "rec"):
            g, w, o = (np.asarray(getattr(c, name)) for c in (got, want, before))
            assert_close(g[:, :, rows], w[:, :, rows], jnp.float32)
            assert (g[:, :, others] == o[:, :, others]).all(), f"{name} of a row not run"
        for a, w, o in zip(jax.tree.leaves(got.pool), jax.tree.leaves(want.pool),
                           jax.tree.leaves(before.pool)):
            assert_close(a, w, jnp.float32)
            pages = np.asarray(a).reshape(a.shape[0], b, -1, *a.shape[3:])  # 2 pages a row
            old = np.asarray(o).reshape(o.shape[0], b, -1, *o.shape[3:])
            assert (pages[:, others] == old[:, others]).all(), "a row not run: KV written"


def test_padded_remainder_generates_the_same_tokens(tiny_model):
    """A 45-token prompt with chunk 64: prefilled as one piece of 45 padded to 64. The same
    prompt with chunk 16 runs as 32 + 13 (padded to 16); with chunk 1 token by token (no
    padding at all). All three give the same greedy tokens."""
    ids = tiny_model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5)[:45]
    assert len(ids) == 45
    ref, _ = greedy_tokens(tiny_model, ids, 8, prefill_chunk=1)
    for chunk in (64, 16):
        got, done = greedy_tokens(tiny_model, ids, 8, prefill_chunk=chunk)
        assert done.finish_reason == "length"
        assert got == ref, f"chunk {chunk}"


def test_short_piece_generates_the_same_tokens(tiny_model):
    """A plan's short_piece: a 77-token prompt with chunk 64 runs as 64, then its 13 left in
    two pieces 8 wide (not one padded to 64), and gives the greedy tokens of the token-by-token
    prefill; the engine's compiled widths include the short one."""
    ids = tiny_model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)[:77]
    assert len(ids) == 77
    plan = dataclasses.replace(REFERENCE, short_piece=8)
    assert piece(13, 64, plan.short_piece) == (8, 8) and piece(5, 64, 8) == (5, 8)
    assert piece(17, 64, 8) == (17, 64)
    ref, _ = greedy_tokens(tiny_model, ids, 8, prefill_chunk=1)
    shapes, widths = [], []

    def watch(eng):
        shapes.extend(eng.runner.shapes())
        forward = eng.runner.forward

        def recorded(tokens, *a, **kw):
            widths.append(tokens.shape[1])
            return forward(tokens, *a, **kw)
        eng.runner.forward = recorded

    got, done = greedy_tokens(tiny_model, ids, 8, prefill_chunk=64, plan=plan,
                              before_start=watch)
    assert done.finish_reason == "length" and got == ref
    assert (1, 8) in shapes and (1, 64) in shapes
    assert widths[:3] == [64, 8, 8] and set(widths[3:]) == {1}


@pytest.mark.parametrize("rows,narrow", [(1, False), (2, False), (2, True)],
                         ids=["1", "2", "2-narrow"])
def test_compile_during_load_then_serving_compiles_nothing(embedded_models_dir, tiny_model,
                                                           rows, narrow):
    """The restart path (server/cli.py): an engine built on ModelLoad.abstract (params as
    shapes only) compiles every width ahead of time, on a thread pool, while the weights are
    still being copied; attach() gives it the loaded model and warm_run() runs the decode step.
    A request served afterwards (pieces of 32 and 13 padded to 16, then decode steps, its state
    stored) and its continuation (the state restored) compile nothing at all, and the first
    gives the tokens of an engine that compiled as it went.
    With two rows the pieces run over one row (`forward_rows`), the decode step over both, or
    (narrow decode) over the one decoding row."""
    import logging
    import queue

    import jax

    from engine.engine import DoneEvent, Engine, GenerationRequest, TokenEvent
    from engine.io.loader import start_load
    from engine.runtime.sampling import SamplingParams

    class Compiles(logging.Handler):
        def __init__(self):
            super().__init__()
            self.names = []

        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("Compiling "):
                self.names.append(msg.split()[1])

    ids = tiny_model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5)[:45]
    timings: dict = {}
    loading = start_load(embedded_models_dir / "tiny.ninfer", timings=timings)
    assert all(isinstance(x, jax.ShapeDtypeStruct)
               for x in jax.tree.leaves(loading.abstract.params))
    # 200 context tokens: cache shapes no other test uses, so no executable of an earlier test
    # can stand in for the warmup's
    eng = Engine(loading.abstract, context_tokens=200, prefill_chunk=32, max_concurrency=rows,
                 max_queue=2,
                 plan=dataclasses.replace(REFERENCE, narrow_decode=narrow))
    assert eng.compile(threads=3) > 0
    model = loading.result()
    assert model.sha256 == tiny_model.sha256 and timings["verify"] == "full"
    eng.attach(model)
    eng.warm_run()
    probe = jax.numpy.ones((3, 5, 7))  # built before the log: its own compile is not seen
    seen, log = Compiles(), logging.getLogger("jax")
    log.addHandler(seen)
    jax.config.update("jax_log_compiles", True)
    eng.start()

    def generate(prompt, n):
        q: queue.Queue = queue.Queue()
        eng.submit(GenerationRequest(prompt_ids=list(prompt),
                                     sampling=SamplingParams(temperature=0.0), max_tokens=n,
                                     stop_ids=frozenset(), emit=q.put, principal="p",
                                     session="s"))
        out = []
        while not isinstance(ev := q.get(timeout=300), DoneEvent):
            if isinstance(ev, TokenEvent):
                out.append(ev.token_id)
        return out, ev
    try:
        toks, _ = generate(ids, 6)  # a root prefill, decode steps, its state stored
        # a continuation: the stored state restored into the row, its last page copied
        more, done = generate(list(ids) + toks + [11, 12, 13], 3)
        jax.jit(lambda x: x * 3)(probe)  # the probe's own compile
    finally:
        eng.stop()
        jax.config.update("jax_log_compiles", False)
        log.removeHandler(seen)
    assert done.path == "continuation" and len(more) == 3
    assert "jit(<lambda>)" in seen.names, "the probe saw no compile: it is broken"
    # nothing at all compiled while serving: no forward, no sampler, and none of the state
    # and page operations of admission, reuse and storing (`Memory.warm`)
    assert seen.names == ["jit(<lambda>)"], seen.names
    ref, _ = greedy_tokens(tiny_model, ids, 6, prefill_chunk=1)
    assert toks == ref


def test_attach_refuses_another_model(tiny_model):
    """attach() takes only the model the engine was compiled for (config and params tree)."""
    import dataclasses

    from engine.engine import Engine

    eng = Engine(tiny_model, context_tokens=64, prefill_chunk=16, max_concurrency=1)
    other = dataclasses.replace(tiny_model, cfg=dataclasses.replace(tiny_model.cfg,
                                                                    name="another"))
    with pytest.raises(ValueError, match="not the one"):
        eng.attach(other)
    pruned = dataclasses.replace(tiny_model, params={k: v for k, v in tiny_model.params.items()
                                                     if k != "norm"})
    with pytest.raises(ValueError, match="not the one"):
        eng.attach(pruned)
