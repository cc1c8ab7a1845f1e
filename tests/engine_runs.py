"""Run a real Engine to completion in a test: one greedy request, its tokens and its end."""
from __future__ import annotations

import queue


def greedy_tokens(model, ids, n: int, before_start=None, **engine_kw):
    """Start an Engine on `model` (engine_kw: its options; before_start(engine), if given, runs
    first, e.g. its compile), generate n greedy tokens after the prompt `ids`, stop it.
    Returns (tokens, the DoneEvent)."""
    from engine.engine import DoneEvent, Engine, GenerationRequest, TokenEvent
    from engine.runtime.sampling import SamplingParams

    kw = dict(context_tokens=256, prefill_chunk=16, max_concurrency=1, max_queue=2)
    kw.update(engine_kw)
    eng = Engine(model, **kw)
    if before_start is not None:
        before_start(eng)
    eng.start()
    try:
        q: queue.Queue = queue.Queue()
        eng.submit(GenerationRequest(prompt_ids=list(ids),
                                     sampling=SamplingParams(temperature=0.0), max_tokens=n,
                                     stop_ids=frozenset(), emit=q.put))
        toks = []
        while True:
            ev = q.get(timeout=300)
            if isinstance(ev, TokenEvent):
                toks.append(ev.token_id)
            elif isinstance(ev, DoneEvent):
                return toks, ev
    finally:
        eng.stop()


def no_tracing(engine):
    """Make any fall-back to the jitted (tracing) forward fail."""
    def refuse(*a, **k):
        raise AssertionError("the model was traced: a forward did not come from the exports")
    engine.runner._jit_fwd = engine.runner._jit_rows = refuse


def exported_and_live(model, ids, n: int, blobs: dict, **engine_kw):
    """n greedy tokens of an engine that runs `blobs` (export_forwards' files, loaded without
    tracing), and of one that jits live. Returns (exported tokens, live tokens, the exported
    engine's exec_counts, its DoneEvent)."""
    live, _ = greedy_tokens(model, ids, n, **engine_kw)
    counts = {}

    def load(engine):
        engine.load_exported(blobs)
        no_tracing(engine)
        counts.update(engine.exec_counts)
    got, done = greedy_tokens(model, ids, n, before_start=load, **engine_kw)
    return got, live, counts, done
