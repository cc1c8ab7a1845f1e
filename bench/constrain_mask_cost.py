"""Constrained-decoding libraries on the real 248K vocabulary: setup, compile, mask cost, validity.

    python -m bench.constrain_mask_cost               # every library importable here
    python -m bench.constrain_mask_cost --engine      # + the mask's share of a tiny-model step

Each library gets the same two grammars (a bounded JSON schema; a required call of one of two
function tools in the Qwen XML form) and the same adversary: random logits (a random model)
sampled through the mask for WALKS walks. Per-token cost = fill the next-token bitmask + accept
the sampled token, measured over those walks. Valid = the JSON parses and validates with
jsonschema; the tool text parses with engine/text/toolcall.py into calls whose arguments validate.
The walks often prefer structural tokens so that most of them end within the cap; a walk that
hits the cap is reported as unfinished (no budget steering here: that is ours, engine/constrain/,
tested in tests/test_constrain*.py).

Only llguidance is a project dependency; the others are measured in a scratch venv that has
them (xgrammar needs torch, transformers and triton at run time; outlines-core needs nothing).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from engine.text.tokenizer import SPECIAL_START_ID, Tokenizer
from engine.text.toolcall import parse_tool_calls

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer"},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 8}}}}
TOOLS = [{"type": "function", "name": "read", "strict": True,
          "parameters": {"type": "object", "required": ["path"], "additionalProperties": False,
                         "properties": {"path": {"type": "string"},
                                        "limit": {"type": "integer"}}}},
         {"type": "function", "name": "bash", "strict": True,
          "parameters": {"type": "object", "required": ["cmd", "timeout"],
                         "additionalProperties": False,
                         "properties": {"cmd": {"type": "string"},
                                        "timeout": {"type": "number"}}}}]
WALKS, CAP = 20, 240


def _valid(kind: str, text: str) -> bool:
    import jsonschema

    try:
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
            return True
        calls = parse_tool_calls(text, TOOLS).calls
        schemas = {t["name"]: t["parameters"] for t in TOOLS}
        for c in calls:
            jsonschema.validate(c.arguments, schemas[c.name])
        return bool(calls)
    except Exception:
        return False


def _walks(tok, new_matcher, fill, accept, done, words: int, kind: str):
    """Random-logit walks; returns (per-token seconds list, valid count)."""
    times, done_n, valid = [], 0, 0
    mask = np.zeros(words, np.int32)
    closers = sorted({t for s in ('"', "}", "]", "\n", "</", ">", "0", ",", ":", "<",
                                  "parameter", "function", "</tool_call>")
                      for t in tok.encode(s)} | {tok.eos_ids[0]})
    for seed in range(WALKS):
        rng = np.random.default_rng(seed)
        m, out, finished = new_matcher(), [], False
        for _ in range(CAP):
            logits = rng.random(tok.vocab_size, dtype=np.float32)
            if rng.random() < 0.5:  # often prefer structure, so that walks end
                logits[closers] += 1.0
            t0 = time.perf_counter()
            fill(m, mask)
            t1 = time.perf_counter()
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:tok.vocab_size]
            t = int(np.argmax(np.where(bits == 1, logits, -1.0)))
            t2 = time.perf_counter()
            accept(m, t)
            times.append(t1 - t0 + time.perf_counter() - t2)
            if t in tok.eos_ids:
                finished = True
                break
            out.append(t)
            if done(m):
                finished = True
                break
        if finished or done(m):
            done_n += 1
            valid += _valid(kind, tok.decode(out))
    return times, (done_n, valid)


def bench_llguidance(tok):
    from engine.constrain.compiler import ConstraintCompiler

    t0 = time.perf_counter()
    cc = ConstraintCompiler(tok)
    setup = time.perf_counter() - t0
    out = {"setup_s": setup}
    for kind, kw in (("json", {"text_format": {"type": "json_schema", "schema": SCHEMA,
                                               "strict": True}}),
                     ("tool", {"tools": TOOLS, "tool_choice": "required"})):
        lark = cc.body_grammar(kw.get("tools"), kw.get("tool_choice", "auto"),
                               kw.get("text_format"))
        t0 = time.perf_counter()
        cc._matcher(lark)
        compile_s = time.perf_counter() - t0

        def fill(m, mask):
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

        times, valid = _walks(tok, lambda: cc._matcher(lark), fill,
                              lambda m, t: m.consume_token(t), lambda m: m.is_stopped(),
                              cc.mask_words, kind)
        out[kind] = (compile_s, times, valid)
    return out


def bench_xgrammar(tok):
    import xgrammar as xgr  # imports torch

    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                             stop_token_ids=list(tok.eos_ids))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    out = {"setup_s": setup}
    tools = [{"type": "function", "function": {"name": t["name"], "strict": True,
                                               "parameters": t["parameters"]}} for t in TOOLS]
    for kind in ("json", "tool"):
        t0 = time.perf_counter()
        if kind == "json":
            cg = compiler.compile_json_schema(json.dumps(SCHEMA))
        else:
            tag = xgr.get_model_structural_tag("qwen_3_5", tools=tools, tool_choice="required",
                                               reasoning=False)
            cg = compiler.compile_structural_tag(tag)
        compile_s = time.perf_counter() - t0
        bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
        words = bitmask.shape[1]

        def fill(m, mask):
            m.fill_next_token_bitmask(bitmask, 0)
            mask[:] = bitmask[0].numpy()

        times, valid = _walks(tok, lambda: xgr.GrammarMatcher(cg), fill,
                              lambda m, t: m.accept_token(t), lambda m: m.is_terminated(),
                              words, kind)
        out[kind] = (compile_s, times, valid)
    return out


def bench_outlines(tok):
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    eos = tok.eos_ids[0]
    t0 = time.perf_counter()
    table: dict[bytes, list[int]] = {}
    for i in range(SPECIAL_START_ID):
        table.setdefault(tok.token_bytes(i), []).append(i)
    table[b"<tool_call>"] = [248058]  # as literal text: outlines-core has no special tokens
    table[b"</tool_call>"] = [248059]
    vocab = oc.Vocabulary(eos, table)
    setup = time.perf_counter() - t0
    out = {"setup_s": setup}
    raw = r"(?:[^<]|<[^/p])*"  # raw text without a tag opening (approximation)

    def param(k, s):
        v = raw if s.get("type") == "string" else build_regex_from_schema(json.dumps(s))
        return f"<parameter={k}>\\n{v}\\n</parameter>\\n"

    calls = []
    for t in TOOLS:
        p = t["parameters"]
        body = "".join(param(k, s) if k in p["required"] else f"(?:{param(k, s)})?"
                       for k, s in p["properties"].items())
        calls.append(f"<tool_call>\\n<function={t['name']}>\\n{body}</function>\\n</tool_call>")
    regexes = {"json": build_regex_from_schema(json.dumps(SCHEMA)),
               "tool": "(?:" + "|".join(calls) + ")"}
    for kind, rx in regexes.items():
        t0 = time.perf_counter()
        index = oc.Index(rx, vocab)
        compile_s = time.perf_counter() - t0
        words = (tok.vocab_size + 31) // 32

        def fill(g, mask):
            g.write_mask_into(mask.ctypes.data, mask.size, 4)

        times, valid = _walks(tok, lambda: oc.Guide(index), fill,
                              lambda g, t: g.advance(t), lambda g: g.is_finished(), words, kind)
        out[kind] = (compile_s, times, valid)
    return out


class _Timed:
    """A constraint that records the host time of its fill_mask and accept calls."""

    def __init__(self, con, spent: list):
        self._c, self._spent = con, spent
        self.terminated = False

    def fill_mask(self, row, remaining):
        t0 = time.perf_counter()
        try:
            return self._c.fill_mask(row, remaining)
        finally:
            self._spent.append(time.perf_counter() - t0)

    def accept(self, token):
        t0 = time.perf_counter()
        self._c.accept(token)
        self.terminated = self._c.terminated
        self._spent[-1] += time.perf_counter() - t0


def engine_share() -> None:
    """On the tiny model, B=2: the decode step, the sampler with and without a mask, and the
    host time of a JSON constraint per token (best of rounds: the machine may be shared)."""
    import queue
    import tempfile
    from pathlib import Path

    import jax

    from engine.constrain.compiler import ConstraintCompiler
    from engine.engine import DoneEvent, Engine, GenerationRequest
    from engine.io.loader import build_embedded, load_model
    from engine.runtime.sampling import SamplingParams

    path = Path(tempfile.mkdtemp()) / "tiny.ninfer"
    build_embedded("tiny", path)
    model = load_model(path)
    eng = Engine(model, context_tokens=2048, prefill_chunk=64, max_concurrency=2)
    eng.warmup()
    cc = ConstraintCompiler(model.tokenizer)
    fmt = {"type": "json_schema", "strict": True, "schema": {
        "type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}},
                                         "n": {"type": "integer"}}}}
    logits = jax.numpy.asarray(np.random.default_rng(0).standard_normal((2, 248320), np.float32))
    args = (np.ones(2, np.float32), np.zeros(2, np.int32), np.ones(2, np.float32),
            np.zeros((2, 2), np.uint32), np.zeros(2, np.int32))
    mask = np.full((2, cc.mask_words), -1, np.int32)
    for label, m in (("sampler, no mask", None), ("sampler, masked", mask)):
        best = min(_time(lambda: jax.block_until_ready(eng.sampler._sample(logits, *args, m)))
                   for _ in range(5))
        print(f"engine B=2 {label:26s} {best * 1e3:6.2f} ms")
    eng.start()
    for label, constrained in (("step, unconstrained", False), ("step, 1 of 2 rows JSON", True)):
        best, spent = None, []
        for r in range(3):
            qs = []
            for i in range(2):
                q = queue.Queue()
                con = cc.compile(text_format=fmt) if constrained and i == 0 else None
                eng.submit(GenerationRequest(
                    prompt_ids=model.tokenizer.encode(f"Write JSON {i}"),
                    sampling=SamplingParams(temperature=1.0, seed=r), max_tokens=64,
                    stop_ids=frozenset(), emit=q.put,
                    constraint=_Timed(con, spent) if con else None))
                qs.append(q)
            t0, steps = time.perf_counter(), 0
            for q in qs:
                while not isinstance(q.get(), DoneEvent):
                    steps += 1
            dt = (time.perf_counter() - t0) / (steps / 2)
            best = dt if best is None else min(best, dt)
        print(f"engine B=2 {label:26s} {best * 1e3:6.2f} ms/step")
        if spent:
            t = np.array(spent) * 1e3
            print(f"engine JSON constraint host time per token: mean {t.mean():.3f} ms, "
                  f"p50 {np.median(t):.3f}, max {t.max():.2f} ({len(t)} tokens)")
    eng.stop()


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", action="store_true", help="also time the tiny-model step")
    ap.add_argument("--libs", default="llguidance,xgrammar,outlines-core")
    args = ap.parse_args()
    tok = Tokenizer.qwen35()
    print(f"vocabulary {tok.vocab_size} tokens; {WALKS} random walks per grammar, cap {CAP}")
    runners = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar,
               "outlines-core": bench_outlines}
    for name in args.libs.split(","):
        try:
            res = runners[name](tok)
        except ImportError as e:
            print(f"{name}: not importable here ({e})")
            continue
        print(f"{name}: vocabulary setup {res['setup_s']:.2f} s")
        for kind in ("json", "tool"):
            compile_s, times, (finished, valid) = res[kind]
            t = np.array(times) * 1e3
            print(f"  {kind:4s} compile {compile_s * 1e3:9.1f} ms   mask+accept mean "
                  f"{t.mean():.3f} ms p50 {np.median(t):.3f} p99 {np.percentile(t, 99):.3f} "
                  f"max {t.max():.2f} ms   finished {finished}/{WALKS}, valid {valid}")
    if args.engine:
        engine_share()


if __name__ == "__main__":
    main()
