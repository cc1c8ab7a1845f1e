"""Request fields -> a `Constraint` (or None), over one tokenizer's vocabulary.

`ConstraintCompiler(tokenizer)` is built once per loaded model (~1 s for the 248K vocabulary:
llguidance indexes every token's bytes) and is safe to share between threads; `compile(...)` is
called per request (2 ms for a JSON schema or a few tools, 16 ms for 12 tools) and returns a fresh
`Constraint` that the engine thread then owns.
"""
from __future__ import annotations

import json

import llguidance as llg
import numpy as np

from engine.constrain.constraint import Constraint, plan_close_out
import engine.constrain.grammar as G
from engine.text.tokenizer import SPECIAL_START_ID, Tokenizer

ConstraintError = G.ConstraintError


class Vocab:
    """Token tables for masks and the close-out planner (shared, read-only after init)."""

    def __init__(self, tokenizer: Tokenizer):
        n = tokenizer.vocab_size
        self.size = n
        self.words = (n + 31) // 32
        self.eos_ids = tuple(tokenizer.eos_ids)
        self.eos = self.eos_ids[0]
        self.think_end = tokenizer.id_of("</think>")
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)]
        ordinary = np.zeros(self.words * 32, bool)
        ordinary[:SPECIAL_START_ID] = True
        self._think = {}
        for allow_end in (False, True):
            ok = ordinary.copy()
            ok[self.think_end] = True
            if allow_end:
                ok[list(self.eos_ids)] = True
            self._think[allow_end] = _pack(ok)
        non_ws = ordinary.copy()
        non_ws[:n] &= np.array([not t.isspace() for t in self.tokens])
        self._non_ws = _pack(non_ws).view(np.uint8)
        self._lengths = np.array([len(t) for t in self.tokens] + [0] * (self.words * 32 - n))
        enc = tokenizer.encode
        xml_all = enc("\n</parameter>\n</function>\n</tool_call>")
        xml_param, xml_fn = enc("\n</parameter>\n"), enc("</function>\n</tool_call>")
        # Inside free text (a string, a raw value) only a terminator makes progress; at a
        # structural position, closing brackets first, then the shortest values.
        self.free_closers = [xml_all, xml_param] + [enc(s) for s in ('"}', '"]', '"')]
        self.struct_closers = [enc("}"), enc("]"), xml_all, xml_param, xml_fn,
                               [G.TOOL_CALL_ID]] + [enc(s) for s in (
                                   "0", "false", "null", '""', "{}", "[]", '"', ":", ",", "{", "[")]
        self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapper(tokenizer, self.tokens)),
                                  eos_token=list(self.eos_ids))

    def think_mask(self, allow_end: bool) -> np.ndarray:
        return self._think[allow_end]

    def single(self, row: np.ndarray, token: int) -> None:
        row[:] = 0
        row.view(np.uint32)[token >> 5] = np.uint32(1 << (token & 31))

    @staticmethod
    def allowed(mask: np.ndarray, token: int) -> bool:
        return bool((int(mask[token >> 5]) >> (token & 31)) & 1)

    def fallback_token(self, bits: np.ndarray) -> list[int] | None:
        """Among allowed tokens (bits: uint8 [V/8]) the longest that is not whitespace (fewest
        steps through forced text such as a key name), lowest id on ties; whitespace last."""
        for cand in (bits & self._non_ws[:len(bits)], bits):
            ids = np.flatnonzero(np.unpackbits(cand, bitorder="little"))
            if len(ids):
                return [int(ids[np.argmax(self._lengths[ids])])]
        return None


class _Wrapper:
    """What llguidance's TokenizerWrapper reads: token bytes, special ids, an encoder."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes]):
        self.eos_token_id = tokenizer.eos_ids[0]
        self.bos_token_id = None
        self.tokens = tokens
        self.special_token_ids = list(range(SPECIAL_START_ID, tokenizer.vocab_size))
        self._encode = tokenizer.encode_ordinary

    def __call__(self, text):
        return self._encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


def _pack(allowed: np.ndarray) -> np.ndarray:
    """bool [words*32] -> int32 [words], bit (i & 31) of word (i >> 5) = allowed[i]."""
    return np.packbits(allowed.reshape(-1, 8), axis=-1, bitorder="little").reshape(
        -1).view(np.int32).copy()


class ConstraintCompiler:
    def __init__(self, tokenizer: Tokenizer):
        self.vocab = Vocab(tokenizer)
        self._checked_tools: set[str] = set()  # tools whose grammar compiled and probed

    @property
    def mask_words(self) -> int:
        """Width of a mask row in int32 words (covers every real token id)."""
        return self.vocab.words

    def compile(self, *, tools: list[dict] | None = None, tool_choice="auto",
                text_format: dict | None = None, thinking: bool = False,
                thinking_budget: int | None = None,
                parallel_tool_calls: bool = True) -> Constraint | None:
        """The constraint of one request, or None when it needs none (no per-step cost).

        tools: OpenAI function tools ({type: "function", name, description, parameters, strict}
        or the chat-completions {type, function: {...}} shape); tool_choice: "auto" | "none" |
        "required" | {"type": "function", "name": NAME}; text_format: the Responses `text.format`
        ({type: "text"} | {type: "json_object"} | {type: "json_schema", name, schema, strict});
        thinking: the prompt ends inside `<think>\\n`; thinking_budget: thinking tokens after
        which `</think>` is forced (None: no limit). Raises ConstraintError for a request that
        cannot be constrained (unknown tool named, no tools with "required", bad schema)."""
        body = _checked(self.body_grammar, tools, tool_choice, text_format, parallel_tool_calls)
        if thinking_budget is not None and (not isinstance(thinking_budget, int)
                                            or thinking_budget < 0):
            raise ConstraintError(f"thinking budget must be an integer >= 0, "
                                  f"got {thinking_budget!r}")
        if body is None and not (thinking and thinking_budget is not None):
            return None
        matcher, body_min, may_be_empty = None, 0, True
        if body is not None:
            matcher, plan = self._matcher(body)
            body_min = len(plan) if plan is not None else 0
            may_be_empty = matcher.is_accepting()
        return Constraint(self.vocab, matcher, thinking=thinking,
                          thinking_budget=thinking_budget if thinking else None,
                          body_min=body_min, body_may_be_empty=may_be_empty)

    @staticmethod
    def body_grammar(tools, tool_choice, text_format, parallel_tool_calls=True) -> str | None:
        """The Lark grammar of the text after thinking, or None for free text."""
        fns = G.normalize_tools(tools)
        json_ref = _format_ref(text_format)
        if isinstance(tool_choice, dict):
            name = tool_choice.get("name")
            if name is None and isinstance(tool_choice.get("function"), dict):
                name = tool_choice["function"].get("name")
            chosen = [t for t in fns if t["name"] == name]
            if not chosen:
                raise ConstraintError(f"tool_choice names function {name!r}, which is not "
                                      "among the tools")
            return G.calls_grammar(chosen, parallel=parallel_tool_calls)
        if tool_choice == "required":
            return G.calls_grammar(fns, parallel=parallel_tool_calls)
        if tool_choice == "none":
            return G.json_grammar(json_ref) if json_ref else G.no_call_grammar()
        if tool_choice not in ("auto", None):
            raise ConstraintError(f"unknown tool_choice {tool_choice!r}")
        if json_ref is None:
            return None
        if fns:
            return G.calls_grammar(fns, parallel=parallel_tool_calls, json_alternative=json_ref)
        return G.json_grammar(json_ref)

    def check_tools(self, tools: list[dict]) -> None:
        """Admission: every function tool's parameters compile to a grammar that can be
        generated (the grammar a forced call would use), or ConstraintError says why."""
        if not tools:
            return
        key = json.dumps(tools, sort_keys=True, separators=(",", ":"))
        if key in self._checked_tools:
            return
        fns = _checked(G.normalize_tools, tools)
        if fns:
            self._matcher(_checked(G.calls_grammar, fns, parallel=True))
        if len(self._checked_tools) >= 64:
            self._checked_tools.clear()
        self._checked_tools.add(key)

    def _matcher(self, lark: str):
        """The compiled, probed grammar and its close-out plan (`plan_close_out`)."""
        try:
            matcher = llg.LLMatcher(self.vocab.ll, llg.LLMatcher.grammar_from_lark(lark),
                                    log_level=0, limits=llg.LLParserLimits(**LIMITS))
        except (ValueError, TypeError, RuntimeError) as e:
            raise ConstraintError(f"cannot compile the constraint: {e}") from None
        if matcher.is_error():
            raise ConstraintError(f"cannot compile the constraint: {matcher.get_error()}")
        return matcher, _probe(matcher, self.vocab)


PROBE_STEPS = 16
# llguidance's limits, its defaults but for the lexer's fuel a mask step may use: a raw string
# parameter with maxLength (a bounded regex intersected with "no </parameter>") needs more than
# the default 200,000 once the budget steering has walked it; 10M serves maxLength up to a few
# thousand, and a larger bound is refused at admission (_probe) instead of failing mid-answer.
LIMITS = {"step_lexer_fuel": 10_000_000, "verbose_errors": False}


def _probe(matcher, vocab) -> list[int] | None:
    """Admission check of a compiled grammar: some schemas compile and fail only once
    generation reaches them (a string of maxLength 1e9: the lexer gives up once the budget
    steering has walked it; a `$ref` cycle with no base case: nothing can follow). Take the
    close-out walk generation takes, then walk a copy a few steps (the lowest allowed token
    each step), and refuse a grammar that errs there. Returns the close-out plan."""
    plan = plan_close_out(matcher, vocab)
    m = matcher.deep_copy()
    row = np.zeros(vocab.words, np.int32)
    for _ in range(PROBE_STEPS):
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if m.is_error():
            break
        if m.is_stopped() or m.is_accepting():
            return plan
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits)
        if allowed.size == 0 or not m.consume_token(int(allowed[0])):
            break
    if m.is_error():
        reason = (m.get_error() or "").split("\n", 1)[0]
        raise ConstraintError(f"the schema cannot be generated ({reason})")
    return plan


def _checked(fn, *args, **kwargs):
    """fn(...), with what a malformed schema makes the grammar builders raise (a TypeError on
    `{"x-guidance": 1}`, a KeyError, ...) turned into ConstraintError."""
    try:
        return fn(*args, **kwargs)
    except ConstraintError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise ConstraintError(f"the schema cannot be compiled ({type(e).__name__}: {e})"
                              ) from None


def _format_ref(text_format: dict | None) -> str | None:
    if text_format is None:
        return None
    kind = text_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return G.json_ref(None, strict=True)
    if kind == "json_schema":
        schema = text_format.get("schema")
        if not isinstance(schema, dict):
            raise ConstraintError("text.format json_schema needs a schema object")
        return G.json_ref(schema, strict=text_format.get("strict") is True)
    raise ConstraintError(f"unknown text.format type {kind!r}")

