"""Continuation, forks, shared prefix and eviction on the real embedded model.

Every token-identity check compares a reused-state run with a cold run of the same prompt by a
principal that has no stored states (states are never shared across principals), over 64 tokens
with at least 16 distinct ones, and has a negative control.
"""
from __future__ import annotations

import pytest

from engine.engine import Engine, EngineHooks, GenerationRequest
from engine.runtime.sampling import SamplingParams
from tests.test_engine_batching import Collector

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def make_engine(model, **kw):
    args = dict(context_tokens=1024, prefill_chunk=64, max_concurrency=2, max_queue=8,
                capacity_tokens=8192, state_slots=16)
    args.update(kw)
    eng = Engine(model, **args)
    eng.start()
    return eng


@pytest.fixture(scope="module")
def engine(model):
    eng = make_engine(model)
    yield eng
    eng.stop()


def run(engine, ids, principal, max_tokens=64, boundary=0, stop=False):
    c = Collector()
    engine.submit(GenerationRequest(prompt_ids=list(ids), sampling=GREEDY,
                                    max_tokens=max_tokens, stop_ids=frozenset(), emit=c,
                                    principal=principal, session=f"session-of-{principal}",
                                    prefix_boundary=boundary))
    return c.result()


def meaningful(tokens) -> bool:
    """A continuation long and varied enough that equality is evidence, not luck."""
    return len(tokens) == 64 and len(set(tokens)) >= 16


def perturbed(ids, at):
    out = list(ids)
    out[at] = (out[at] + 1) % 1000 + 10
    return out


def turn(model, text):
    return model.tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def test_continuation_computes_only_new_tokens_and_matches_cold(model, engine):
    p1 = turn(model, "Write a sorting function in Python.")
    out1, d1 = run(engine, p1, "alice")
    assert d1.path == "root" and d1.cached_tokens == 0
    # The next turn: the transcript so far (prompt + every output token the state has seen) plus
    # a new user turn. Output ended by the budget: its last token was never fed to the model.
    p2 = p1 + out1 + turn(model, "Now make it stable.")
    out2, d2 = run(engine, p2, "alice")
    assert d2.path == "continuation"
    assert d2.cached_tokens == len(p1) + len(out1) - 1
    assert d2.computed_tokens == len(p2) - d2.cached_tokens
    cold, dc = run(engine, p2, "cold-1")
    assert dc.path == "root" and dc.computed_tokens == len(p2)
    assert out2 == cold and meaningful(out2)
    # negative control: a perturbed earlier token changes the output
    assert run(engine, perturbed(p2, len(p1) + 3), "cold-2")[0] != out2


def test_forks_do_not_disturb_each_other_or_the_parent(model, engine):
    p1 = turn(model, "Describe a binary tree.")
    out1, _ = run(engine, p1, "bob")
    base = p1 + out1
    branch_a = base + turn(model, "Give an example in C.")
    branch_b = base + turn(model, "Give an example in Rust.")
    a1, da = run(engine, branch_a, "bob")
    b1, db = run(engine, branch_b, "bob")
    assert da.path == "continuation" and db.path == "fork"
    assert db.cached_tokens == da.cached_tokens == len(base) - 1
    assert a1 == run(engine, branch_a, "cold-3")[0]
    assert b1 == run(engine, branch_b, "cold-4")[0]
    assert a1 != b1 and meaningful(a1) and meaningful(b1)
    assert run(engine, perturbed(branch_a, len(branch_a) - 6), "cold-3x")[0] != a1
    # continuing the first branch after the fork is unchanged by it
    a2_prompt = branch_a + a1 + turn(model, "And in Go?")
    a2, d2 = run(engine, a2_prompt, "bob")
    assert d2.path == "continuation" and d2.cached_tokens == len(branch_a) + len(a1) - 1
    assert a2 == run(engine, a2_prompt, "cold-5")[0] and meaningful(a2)


def test_shared_prefix_across_sessions_of_one_principal_only(model, engine):
    system = model.tokenizer.encode("<|im_start|>system\n" + "You are a careful coding agent. "
                                    * 40 + "<|im_end|>\n")
    s1 = system + turn(model, "List files.")
    s2 = system + turn(model, "Read the README.")
    run(engine, s1, "carol", max_tokens=4, boundary=len(system))
    out, d = run(engine, s2, "carol", boundary=len(system))
    assert d.path == "shared-prefix" and d.cached_tokens == len(system)
    assert d.computed_tokens == len(s2) - len(system)
    # the cold run splits its prefill at the same boundary: the same computation, bit for bit
    assert out == run(engine, s2, "cold-6", boundary=len(system))[0] and meaningful(out)
    assert run(engine, perturbed(s2, len(s2) - 6), "cold-6x")[0] != out
    # another principal with the same system prompt starts from the root
    _, dd = run(engine, s2, "dave", max_tokens=4, boundary=len(system))
    assert dd.path == "root" and dd.cached_tokens == 0


def test_after_eviction_recomputes_the_same_tokens(model):
    saved = []
    eng = make_engine(model, capacity_tokens=1024, state_slots=1, host_state_bytes=0,
                      hooks=EngineHooks(before_evict=saved.append))
    try:
        p1 = turn(model, "Explain recursion.")
        out1, _ = run(eng, p1, "erin")
        p2 = p1 + out1 + turn(model, "Shorter please.")
        # another session's response takes the only state slot: erin's state is evicted
        run(eng, turn(model, "Unrelated question."), "frank")
        assert saved and saved[0].principal == "erin"
        out2, d2 = run(eng, p2, "erin")
        assert d2.path == "root" and d2.cached_tokens == 0
        assert out2 == run(eng, p2, "cold-7")[0] and meaningful(out2)
        assert run(eng, perturbed(p2, len(p2) - 6), "cold-7x")[0] != out2
        st = eng.mem.stats()
        assert st["evictions"] >= 1 and st["states"]["device_images"] <= 1
    finally:
        eng.stop()


def test_host_tier_restore(model):
    # One device slot: the second session's state pushes the first one to the host tier; the
    # first session then continues from the host copy, with the same tokens as a cold run.
    eng = make_engine(model, state_slots=1, host_state_bytes=8 << 20)
    try:
        p1 = turn(model, "What is a closure?")
        out1, _ = run(eng, p1, "gina")
        run(eng, turn(model, "Unrelated."), "hank", max_tokens=8)
        assert eng.mem.stats()["states"]["host_images"] >= 1
        p2 = p1 + out1 + turn(model, "An example?")
        out2, d2 = run(eng, p2, "gina")
        assert d2.path == "host-restored" and d2.cached_tokens == len(p1) + len(out1) - 1
        assert out2 == run(eng, p2, "cold-8")[0] and meaningful(out2)
        assert run(eng, perturbed(p2, len(p2) - 6), "cold-8x")[0] != out2
    finally:
        eng.stop()


def test_int8_kv_pool_serves(model):
    import dataclasses

    m8 = dataclasses.replace(model, kv_dtype=__import__("jax.numpy").numpy.int8)
    eng = make_engine(m8)
    try:
        assert eng.mem.cache.pool.k.dtype.name == "int8"
        p1 = turn(model, "Write a haiku.")
        out8, _ = run(eng, p1, "ivy")
        out8b, d = run(eng, p1 + out8 + turn(model, "Another."), "ivy")
        assert d.path == "continuation" and len(set(out8)) >= 16 and len(out8b) == 64
        kv = eng.mem.stats()["kv"]
        assert kv["page_bytes"] < 0.3 * 64 * 2048  # int8 codes + scales vs 2 KiB/token in fp32
    finally:
        eng.stop()
