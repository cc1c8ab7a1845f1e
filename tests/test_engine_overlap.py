"""Chained decode steps (the engine dispatches step K + 1 with step K's sampled tokens still on
the device, the plan's chain_decode, on by default) give exactly the synced path's results: the same
tokens and ends, the same step log, and stored states that a continuation resumes token for
token. Real engines on the embedded model, one with chaining and one without."""
from __future__ import annotations

import dataclasses

import pytest

from engine.engine import Engine, GenerationRequest
from engine.plan import REFERENCE
from engine.runtime.sampling import SamplingParams
from tests.test_engine_batching import Collector

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=77)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def _engine(model, overlap: bool):
    eng = Engine(model, context_tokens=1024, prefill_chunk=64, max_concurrency=2, max_queue=8,
                 capacity_tokens=8192, state_slots=16,
                 plan=dataclasses.replace(REFERENCE, chain_decode=overlap))
    eng.start()
    return eng


@pytest.fixture(scope="module")
def engines(model):
    on, off = _engine(model, True), _engine(model, False)
    yield on, off
    on.stop()
    off.stop()


def _submit(engine, ids, sampling=GREEDY, max_tokens=48, stop=(), principal=None,
            session=None):
    c = Collector()
    engine.submit(GenerationRequest(prompt_ids=list(ids), sampling=sampling,
                                    max_tokens=max_tokens, stop_ids=frozenset(stop), emit=c,
                                    principal=principal, session=session))
    return c


def _turn(model, text):
    return model.tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def _both(engines, fn):
    """fn(engine) on the chaining engine and on the synced one: (on, off) results and the
    steps each chained meanwhile."""
    out = []
    for eng in engines:
        before = eng.chained_steps
        out.append((fn(eng), eng.chained_steps - before))
    return out


def test_chaining_is_on_by_default_and_off_with_the_plan(model, engines):
    on, off = engines
    assert on.loop.chain.enabled and not off.loop.chain.enabled
    kw = dict(context_tokens=256, prefill_chunk=64)
    assert Engine(model, **kw).loop.chain.enabled  # the default plan chains
    assert not Engine(model, plan=dataclasses.replace(REFERENCE, chain_decode=False),
                      **kw).loop.chain.enabled


def test_greedy_and_seeded_tokens_and_stop_at_a_chosen_token(model, engines):
    ids = _turn(model, "Write a function that merges two sorted lists.")
    (free_on, n_on), (free_off, n_off) = _both(
        engines, lambda e: _submit(e, ids, max_tokens=48).result())
    assert free_on[0] == free_off[0] and len(free_on[0]) == 48
    assert free_on[1].finish_reason == free_off[1].finish_reason == "length"
    assert n_on >= 40 and n_off == 0  # the chained engine chained nearly every decode step
    # a stop token the greedy run produces at its 20th token: both end there, without it
    stop_tok = free_on[0][19]
    first = free_on[0].index(stop_tok)
    (s_on, _), (s_off, _) = _both(
        engines, lambda e: _submit(e, ids, max_tokens=48, stop=[stop_tok, 3, 5]).result())
    assert s_on[0] == s_off[0] == free_on[0][:first]
    assert s_on[1].finish_reason == s_off[1].finish_reason == "stop"
    # seeded sampling: the key steps of chained steps are the synced path's
    (r_on, _), (r_off, _) = _both(
        engines, lambda e: _submit(e, ids, sampling=SEEDED, max_tokens=40).result())
    assert r_on[0] == r_off[0] and len(set(r_on[0])) >= 10
    # negative control: another seed samples another continuation
    other = _submit(engines[0], ids, sampling=SamplingParams(temperature=0.9, top_p=0.95,
                                                             seed=78), max_tokens=40).result()
    assert other[0] != r_on[0]


def test_two_rows_ending_at_different_steps_and_the_step_log(model, engines):
    """Two requests decoding together, one ending by its budget and one by a stop token at
    other steps: the same tokens, ends and step log (rows that ended are not in the next
    step's entry) on both engines."""
    a = _turn(model, "List three prime numbers.")
    b = _turn(model, "Name a sorting algorithm and explain it.")
    probe = _submit(engines[1], b, max_tokens=40).result()[0]
    stop_tok = probe[25]

    def run(e):
        start = len(e.sched.step_log)
        ca = _submit(e, a, max_tokens=13)
        cb = _submit(e, b, max_tokens=40, stop=[stop_tok])
        ra, rb = ca.result(), cb.result()
        log = e.sched.step_log[start:]
        return ra, rb, log

    (on, n_on), (off, _) = _both(engines, run)
    assert on[0][0] == off[0][0] and on[0][1].finish_reason == "length" == off[0][1].finish_reason
    assert on[1][0] == off[1][0] and on[1][1].finish_reason == "stop" == off[1][1].finish_reason
    assert len(on[0][0]) == 13 and len(on[1][0]) == probe.index(stop_tok)
    # ids differ between engines: compare the logs' shapes (kind and rows per step)
    shape = lambda log: [(kind, len(ids)) for kind, ids in log]  # noqa: E731
    assert shape(on[2]) == shape(off[2])
    assert n_on > 0


def test_a_state_stored_after_a_chained_stop_resumes_token_for_token(model, engines):
    """A response that ended on a stop token in a chained run stores the state after its
    outputs (the stop token was never fed); the next turn continues from it and produces
    the tokens a cold run of the whole transcript produces."""
    on = engines[0]
    p1 = _turn(model, "Explain what a hash map is.")
    probe = _submit(on, p1, max_tokens=40).result()[0]
    stop_tok = probe[30]
    out1, d1 = _submit(on, p1, max_tokens=40, stop=[stop_tok], principal="carol",
                       session="s1").result()
    assert d1.finish_reason == "stop" and out1 == probe[:probe.index(stop_tok)]
    p2 = p1 + out1 + [stop_tok] + _turn(model, "Now give an example.")
    out2, d2 = _submit(on, p2, max_tokens=48, principal="carol", session="s1").result()
    assert d2.path == "continuation" and d2.cached_tokens == len(p1) + len(out1)
    cold, dc = _submit(on, p2, max_tokens=48, principal="cold", session="c").result()
    assert dc.path == "root" and out2 == cold and len(set(out2)) >= 12
    off_out = _submit(engines[1], p2, max_tokens=48, principal="cold", session="c").result()[0]
    assert off_out == cold
