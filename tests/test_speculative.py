"""Speculative decoding on the embedded tiny model (fp32, CPU): the verify pass and its rollback.

Two test drafters pin both paths: `Oracle` proposes the target's own greedy continuation (every
draft accepted), `Oracle(wrong=True)` a token the target never picks there (every draft
rejected). With either, and with prompt lookup, the engine must give the tokens of the engine
without speculation and store the same state bit for bit (its checkpoint export: tokens, KV
page bytes, conv and rec), at one and two concurrent rows, with and without a grammar mask.
"""
from __future__ import annotations

import queue
import re
from pathlib import Path

import numpy as np
import pytest

from engine.constrain.compiler import ConstraintCompiler
from engine.engine import DoneEvent, Engine, GenerationRequest
from engine.runtime.drafters import MTP, LookupThenMTP, PromptLookup, lookup
from engine.runtime.memory import token_key
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative import SpecConfig, check_speculative
from lanes.profile import ProfileError, load_profile
from server.checkpoints.fingerprint import runtime_fingerprint
from server.observability import Metrics, Observability, RequestLog

MAX_TOKENS = 72  # a grammar's close-out steering may end it a few tokens early
TEXTS = ["def fibonacci(n):\n    ", "class Stack:\n    def push(self, item):\n"]
NOTES = {"type": "object", "additionalProperties": False, "required": ["notes"],
         "properties": {"notes": {"type": "string", "minLength": 150}}}


class Oracle:
    """Proposes the continuation the engine without speculation produced for the same prompt
    (`refs`: prompt tuple -> tokens), its first `right` tokens as they are (None: all) and the
    rest + 1 (never what the verifier picks there, so those drafts are rejected)."""
    name = "oracle"

    def __init__(self, refs: dict, right: int | None = None):
        self.refs, self.right = refs, right

    def propose(self, seq, k):
        ref = self.refs[tuple(seq.prompt_ids)]
        done = len(seq.output_ids)
        right = k if self.right is None else self.right
        return [t if i < right else t + 1 for i, t in enumerate(ref[done:done + k])]


def _run(model, prompts, constraints, spec, concurrency, sampled=()):
    """Run the prompts together (greedy, MAX_TOKENS each; the indices in `sampled` seeded at
    temperature 0.8 instead) on a fresh engine; returns
    ([(tokens, DoneEvent, checkpoint export of the stored response state)], KV pages in use
    at the end)."""
    eng = Engine(model, context_tokens=256, prefill_chunk=16, max_concurrency=concurrency,
                 max_queue=4, speculative=spec)
    eng.start()
    try:
        queues = []
        for i, (ids, con) in enumerate(zip(prompts, constraints)):
            q: queue.Queue = queue.Queue()
            sp = SamplingParams(temperature=0.8, seed=7) if i in sampled else SamplingParams(
                temperature=0.0)
            eng.submit(GenerationRequest(prompt_ids=list(ids), sampling=sp, max_tokens=MAX_TOKENS, stop_ids=frozenset(), emit=q.put,
                principal="t", constraint=con() if con else None))
            queues.append(q)
        out = []
        for ids, q in zip(prompts, queues):
            toks = []
            while not isinstance(ev := q.get(timeout=300), DoneEvent):
                toks.append(ev.token_id)
            # no stop ids: the last token (at the budget, or where the grammar completes) is
            # sampled, never fed
            fed = list(ids) + toks[:-1]
            export = eng.checkpoint.export_stored("t", token_key("t", fed)).result(60)
            out.append((toks, ev, export))
        # the KV pages held once every request ended (their stored states'): a rejected
        # position's page that was not given back would show here
        used = eng.call(lambda e: e.memory_stats()["kv"]["pages_used"]).result(60)
        return out, used
    finally:
        eng.stop()


def _same_state(a, b, main_layers: int | None = None):
    """a's stored state is b's. `main_layers`: a's pages also hold the MTP layer's KV (an MTP
    drafter's engine), so only the main model's `main_layers` layers of each page are compared
    (fp32 K then V, each [layers, page_size, heads, head_dim])."""
    assert a is not None and b is not None
    assert np.array_equal(a.tokens, b.tokens)
    assert a.conv.tobytes() == b.conv.tobytes() and a.rec.tobytes() == b.rec.tobytes()
    if main_layers is None:
        assert [bytes(p) for p in a.pages] == [bytes(p) for p in b.pages]
        return
    assert len(a.pages) == len(b.pages)
    for pa, pb in zip(a.pages, b.pages):
        ka = np.frombuffer(bytes(pa), np.float32).reshape(2, main_layers + 1, -1)
        kb = np.frombuffer(bytes(pb), np.float32).reshape(2, main_layers, -1)
        assert np.array_equal(ka[:, :main_layers], kb)


@pytest.fixture(scope="module")
def compiler(tiny_model):
    return ConstraintCompiler(tiny_model.tokenizer)


@pytest.mark.parametrize("concurrency", [1, 2], ids=["C1", "C2"])
@pytest.mark.parametrize("masked", [False, True], ids=["free", "grammar"])
def test_speculation_keeps_tokens_and_state(tiny_model, compiler, concurrency, masked,
                                            tmp_path):
    tok = tiny_model.tokenizer
    prompts = [tuple(tok.encode(t)) for t in TEXTS[:concurrency]]
    fmt = {"type": "json_schema", "name": "notes", "schema": NOTES, "strict": True}
    cons = [(lambda: compiler.compile(text_format=fmt)) if masked else None] * concurrency
    # C2 under the grammar: the second row samples (seeded), so the verifier's sampled tokens
    # are checked too
    sampled = (1,) if masked and concurrency == 2 else ()
    base, base_pages = _run(tiny_model, prompts, cons, None, concurrency, sampled)
    refs = {p: toks for p, (toks, _, _) in zip(prompts, base)}
    for toks, done, _ in base:
        assert done.finish_reason == ("stop" if masked else "length") and len(toks) >= 64
        assert len(set(toks)) >= 16, "the continuation must not be a short loop"
        assert done.speculative is None
    # (drafter, K): the always-wrong one at K = 1 keeps the test short (a pass a token)
    drafters = {"all accepted": (Oracle(refs), 4), "all rejected": (Oracle(refs, 0), 1),
                "prompt lookup": (PromptLookup(), 4), "mtp": (MTP(), 3)}
    if concurrency == 2 and not masked:  # partly accepted passes (kept short: one case)
        drafters["two of three"] = (Oracle(refs, 2), 3)
    if concurrency == 1 and not masked:  # lookup where it matches, MTP elsewhere (one case)
        drafters["prompt_lookup+mtp"] = (LookupThenMTP(), 3)
    for name, (drafter, k) in drafters.items():
        got, pages = _run(tiny_model, prompts, cons, SpecConfig(drafter, k), concurrency,
                          sampled)
        assert pages == base_pages, name
        for (want_toks, _, want_state), (toks, done, state) in zip(base, got):
            assert toks == want_toks, name
            _same_state(state, want_state,
                        tiny_model.cfg.num_blocks if "mtp" in name else None)
            spec = done.speculative
            passes, drafted, accepted = (spec["verify_passes"], spec["drafted"],
                                         spec["accepted"])
            assert passes + sum(accepted) == len(toks) - 1  # the first token: prefill's
            if name == "all accepted":  # all but a last pass cut by the grammar's end
                assert sum(drafted) - sum(accepted) < 4 and accepted[0] == drafted[0]
                assert passes <= (len(toks) - 1) // 5 + 1
            elif name == "all rejected":
                # a last pass with one token left has no room for a draft; under the grammar
                # a draft token it disallows is cut before the pass (draft_prefix)
                assert accepted == [0] and drafted[0] >= (1 if masked else passes - 1)
            elif name == "two of three":
                assert accepted[2] == 0 and accepted[:2] == drafted[:2]
        if name == "two of three":
            _logged_and_counted(tmp_path, [done for _, done, _ in got])


def _logged_and_counted(tmp_path, dones):
    """The requests' speculative counts reach the request log and the Prometheus counters."""
    from tests.test_observability import read_lines, scrape, value

    metrics = Metrics()
    with RequestLog(tmp_path / "requests.jsonl") as log:
        obs = Observability(metrics, log, model="tiny")
        for done in dones:
            obs.on_request_done(obs.new_request("t"), done)
    recs = read_lines(tmp_path / "requests.jsonl")
    assert [r["speculative"] for r in recs] == [d.speculative for d in dones]
    got = scrape(metrics)
    assert value(got, "ninfer_speculative_verify_passes_total") == sum(
        d.speculative["verify_passes"] for d in dones)
    for i in range(3):
        for kind in ("drafted", "accepted"):
            assert value(got, f"ninfer_speculative_{kind}_tokens_total", position=str(i)) == sum(
                d.speculative[kind][i] for d in dones)


def test_prompt_lookup_finds_the_longest_recent_match():
    toks = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 0, 2, 3])
    # the tail [2, 3]: the newest earlier match is at 6 -> 7, 8, 0
    assert lookup(toks, 3, 4, 2) == [7, 8, 0]
    # the tail [0, 2, 3] has no earlier match; n = 2 finds it as above
    assert lookup(np.array([1, 2, 3, 4, 1, 2, 3]), 2, 4, 2) == [4, 1]
    assert lookup(np.array([1, 2, 3]), 4, 4, 2) == []
    assert lookup(toks, 0, 4, 2) == []


@pytest.mark.parametrize("method,k,needle", [
    ("medusa", 3, "speculative.method must be one of "
                  "['off', 'prompt_lookup', 'mtp', 'prompt_lookup+mtp']"),
    ("prompt_lookup", 0, "speculative.draft_tokens must be an integer in 1..8"),
    ("prompt_lookup", 9, "speculative.draft_tokens must be an integer in 1..8"),
    ("prompt_lookup", True, "speculative.draft_tokens must be an integer in 1..8")])
def test_bad_speculative_settings_refused(method, k, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        check_speculative(method, k)


PROFILE_DIR = Path(__file__).resolve().parents[1] / "lanes" / "profiles"


@pytest.mark.parametrize("method,k,match", [
    ("medusa", 3, r"\[speculative\] method must be one of "
                  r"\['off', 'prompt_lookup', 'mtp', 'prompt_lookup\+mtp'\]"),
    ("prompt_lookup", 0, r"\[speculative\] draft_tokens must be an integer in 1\.\.8, got 0"),
    ("prompt_lookup", 9, r"\[speculative\] draft_tokens must be an integer in 1\.\.8, got 9")])
def test_profile_with_bad_speculative_table_is_refused(tmp_path, method, k, match):
    text = (PROFILE_DIR / "rtx4090.toml").read_text()
    text = text.replace('method = "off"', f'method = "{method}"').replace(
        "draft_tokens = 0", f"draft_tokens = {k}")
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ProfileError, match=match):
        load_profile(str(tmp_path / "bad.toml"))


def test_mtp_profile_needs_a_model_with_an_mtp_layer(tmp_path):
    text = (PROFILE_DIR / "rtx4090.toml").read_text().replace(
        'method = "off"', 'method = "mtp"').replace("draft_tokens = 0", "draft_tokens = 3")
    (tmp_path / "mtp.toml").write_text(text)
    assert load_profile(str(tmp_path / "mtp.toml")).speculative_config().mtp  # the 27B has one
    (tmp_path / "bare.toml").write_text(text.replace('model_preset = "qwen3.8-27b"',
                                                     'model_preset = "test-small"'))
    with pytest.raises(ProfileError, match=r"\[speculative\] method 'mtp' needs a model with an "
                       r"MTP layer; 'test-small' has none"):
        load_profile(str(tmp_path / "bare.toml"))


def test_profile_selects_the_drafter_and_the_fingerprint_names_it(tmp_path, tiny_model):
    text = (PROFILE_DIR / "cpu.toml").read_text()
    (tmp_path / "spec.toml").write_text(
        text + '\n[speculative]\nmethod = "prompt_lookup"\ndraft_tokens = 4\n')
    profile = load_profile(str(tmp_path / "spec.toml"))
    spec = profile.speculative_config()
    assert isinstance(spec.drafter, PromptLookup) and spec.k == 4
    assert load_profile("cpu").speculative_config() is None
    eng = Engine(tiny_model, context_tokens=256, prefill_chunk=16, speculative=spec)
    fp = runtime_fingerprint(tiny_model, profile, eng)
    assert fp["speculative"] == {"method": "prompt_lookup", "draft_tokens": 4}
    off = Engine(tiny_model, context_tokens=256, prefill_chunk=16)
    assert runtime_fingerprint(tiny_model, load_profile("cpu"), off)["speculative"] is None


def test_drafts_are_cut_where_the_grammar_disallows_them(tiny_model, compiler):
    tok = tiny_model.tokenizer
    fmt = {"type": "json_schema", "name": "notes", "schema": NOTES, "strict": True}
    con = compiler.compile(text_format=fmt)
    before = np.zeros(con.mask_words, np.int32)
    con.fill_mask(before, 64)
    good = tok.encode('{"notes": "a file')
    assert con.draft_prefix(good) == len(good)
    bad = tok.encode('{"notes": 12}')  # the value must be a string
    cut = con.draft_prefix(bad)
    assert 0 < cut < len(bad) and bad[:cut] == tok.encode('{"notes": ')[:cut]
    assert con.draft_prefix([tok.vocab_size + 5]) == 0
    after = np.zeros(con.mask_words, np.int32)
    con.fill_mask(after, 64)  # nothing was advanced
    assert np.array_equal(before, after) and not con.terminated


def test_a_logprobs_request_takes_the_plain_step_under_speculation(tiny_model):
    """The verify pass computes no log-probabilities: a row that asks for them is decoded by
    the plain step, so every token still carries its log-probability and its alternatives, and
    the tokens are those of the engine without speculation."""
    ids = tiny_model.tokenizer.encode(TEXTS[0])

    def events(spec):
        eng = Engine(tiny_model, context_tokens=256, prefill_chunk=16, max_concurrency=1,
                     max_queue=4, speculative=spec)
        eng.start()
        try:
            q: queue.Queue = queue.Queue()
            eng.submit(GenerationRequest(prompt_ids=list(ids), sampling=SamplingParams(
                temperature=0.0), max_tokens=24, stop_ids=frozenset(), emit=q.put,
                principal="t", logprobs=3))
            out = []
            while not isinstance(ev := q.get(timeout=300), DoneEvent):
                out.append(ev)
            return out, ev
        finally:
            eng.stop()

    plain, _ = events(None)
    refs = {tuple(ids): [e.token_id for e in plain]}
    spec, done = events(SpecConfig(Oracle(refs), 4))
    assert [e.token_id for e in spec] == refs[tuple(ids)]
    assert all(e.logprob is not None and len(e.top) == 3 for e in spec)
    assert [e.logprob for e in spec] == pytest.approx([e.logprob for e in plain], abs=1e-5)
    assert done.speculative["verify_passes"] == 0  # no row of the pass was speculated
