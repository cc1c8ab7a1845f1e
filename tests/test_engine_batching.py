"""The engine's scheduler on the real embedded model: batching is exact, prefill interleaves."""
from __future__ import annotations

import dataclasses
import queue
import threading

import pytest

from engine.engine import (DoneEvent, Engine, GenerationRequest, PromptTooLong, QueueFull,
                           TokenEvent)
from engine.plan import CPU, REFERENCE
from engine.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module", params=["padded", "narrow", "head_rows"])
def engine(model, request):
    """An engine of two rows; "narrow": a decode step of one row runs over that row alone
    (the plan's narrow_decode), so a sequence alone and two at once run different forwards;
    "head_rows": the cpu lane's plan, the logits a live row at a time."""
    plan = {"padded": REFERENCE, "narrow": dataclasses.replace(REFERENCE, narrow_decode=True),
            "head_rows": CPU}[request.param]
    eng = Engine(model, context_tokens=2048, prefill_chunk=64, max_concurrency=2, max_queue=4,
                 plan=plan)
    assert eng.runner.narrow_decode is (request.param == "narrow")
    assert eng.plan.head_rows is (request.param == "head_rows")
    eng.start()
    yield eng
    eng.stop()


class Collector:
    def __init__(self):
        self.events: queue.Queue = queue.Queue()

    def __call__(self, ev):
        self.events.put(ev)

    def result(self, timeout=300) -> tuple[list[int], DoneEvent]:
        toks = []
        while True:
            ev = self.events.get(timeout=timeout)
            if isinstance(ev, TokenEvent):
                toks.append(ev.token_id)
            else:
                return toks, ev


def _request(model, text, sampling, max_tokens=64, stop=True):
    c = Collector()
    ids = model.tokenizer.encode(text)
    req = GenerationRequest(prompt_ids=ids, sampling=sampling, max_tokens=max_tokens,
                            stop_ids=frozenset(model.tokenizer.eos_ids) if stop else frozenset(),
                            emit=c)
    return req, c


PROMPTS = ["def fibonacci(n):\n    ", "The history of the printing press begins"]


def alone_and_together(model, engine, sampling) -> tuple[list, list]:
    """PROMPTS' 64-token continuations run one after another, then all submitted at once."""
    alone = []
    for text in PROMPTS:
        req, c = _request(model, text, sampling, stop=False)
        engine.submit(req)
        alone.append(c.result()[0])
    reqs = [_request(model, text, sampling, stop=False) for text in PROMPTS]
    for req, _ in reqs:
        engine.submit(req)
    return alone, [c.result()[0] for _, c in reqs]


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8, top_p=0.9, seed=1234)],
                         ids=["greedy", "seeded"])
def test_two_sequences_together_equal_each_alone(model, engine, sampling):
    alone, together = alone_and_together(model, engine, sampling)
    assert together == alone
    for toks in alone:
        assert len(toks) == 64 and len(set(toks)) >= 16
    # negative control: a perturbed prompt changes the continuation
    req, c = _request(model, PROMPTS[0].replace("fibonacci", "factorial"), sampling, stop=False)
    engine.submit(req)
    assert c.result()[0] != alone[0]


def test_prefill_chunks_interleave_with_decode(model, engine):
    greedy = SamplingParams(temperature=0.0)
    a, ca = _request(model, "Tell me a story.", greedy, max_tokens=48, stop=False)
    engine.submit(a)
    ca.events.get(timeout=300)  # A is decoding
    long_text = " ".join(f"item{i}" for i in range(200))  # several 64-token prefill chunks
    b, cb = _request(model, long_text, greedy, max_tokens=4, stop=False)
    start = len(engine.sched.step_log)
    engine.submit(b)
    cb.result()
    ca.result()
    log = engine.sched.step_log[start:]
    b_id = next(ids[0] for kind, ids in log if kind == "prefill")
    chunks = [i for i, (kind, ids) in enumerate(log) if kind == "prefill" and ids == (b_id,)]
    assert len(chunks) >= 3
    for lo, hi in zip(chunks, chunks[1:]):
        between = log[lo + 1:hi]
        assert any(kind == "decode" and len(ids) >= 1 and b_id not in ids
                   for kind, ids in between), log


def test_queue_full_and_cancel(model):
    eng = Engine(model, context_tokens=512, prefill_chunk=64, max_concurrency=1, max_queue=1,
                 queue_timeout_s=600)
    eng.start()
    try:
        greedy = SamplingParams(temperature=0.0)
        first, c1 = _request(model, "one", greedy, max_tokens=400, stop=False)
        eng.submit(first)
        c1.events.get(timeout=300)  # running
        second, c2 = _request(model, "two", greedy, max_tokens=4, stop=False)
        eng.submit(second)  # waits: the only slot is busy
        third, _ = _request(model, "three", greedy, max_tokens=4)
        with pytest.raises(QueueFull):
            eng.submit(third)
        first.cancelled.set()  # a disconnected client frees its slot
        toks, done = c1.result()
        assert done.finish_reason == "cancelled" and len(toks) < 400
        toks2, done2 = c2.result()
        assert done2.finish_reason == "length" and len(toks2) == 4
        assert eng.sched.reserved == 0 and eng.sched.free_slots == [0]
    finally:
        eng.stop()


def test_queue_timeout(model):
    eng = Engine(model, context_tokens=512, prefill_chunk=64, max_concurrency=1, max_queue=2,
                 queue_timeout_s=0.5)
    eng.start()
    try:
        greedy = SamplingParams(temperature=0.0)
        first, c1 = _request(model, "one", greedy, max_tokens=450, stop=False)
        eng.submit(first)
        c1.events.get(timeout=300)
        second, c2 = _request(model, "two", greedy, max_tokens=4)
        eng.submit(second)
        toks, done = c2.result(timeout=60)
        assert toks == [] and done.finish_reason == "queue_timeout" and done.queue_s >= 0.5
        first.cancelled.set()
        c1.result()
    finally:
        eng.stop()


def test_a_prompt_longer_than_the_context_is_refused_at_once(model, engine):
    c = Collector()
    req = GenerationRequest(prompt_ids=[5] * engine.context_tokens, emit=c,
                            sampling=SamplingParams(temperature=0.0), max_tokens=4,
                            stop_ids=frozenset())
    with pytest.raises(PromptTooLong, match="context holds"):
        engine.submit(req)
    assert c.events.empty()
    # nothing was queued: the next request runs as usual
    ok, c2 = _request(model, "still here", SamplingParams(temperature=0.0), max_tokens=3,
                      stop=False)
    engine.submit(ok)
    toks, done = c2.result(timeout=300)
    assert done.finish_reason == "length" and len(toks) == 3


def test_submit_is_thread_safe(model, engine):
    greedy = SamplingParams(temperature=0.0)
    results, errors = [], []

    def one(i):
        req, c = _request(model, f"request {i}", greedy, max_tokens=3, stop=False)
        try:
            engine.submit(req)
            results.append(c.result()[1].finish_reason)
        except QueueFull:
            errors.append(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) + len(errors) == 6 and all(r == "length" for r in results)
    assert len(results) >= 4  # 2 running + 4 queued fit; only the excess may be refused
