"""The log-probabilities of a response's output_text tokens (`include:
["message.output_text.logprobs"]`, `top_logprobs`), in the Responses API's shape.

The engine gives each sampled token its log-probability under the model's distribution (the raw
logits at temperature 1) and its most likely alternatives (engine/runtime/runner.py). Here
each token becomes `{token, bytes, logprob, top_logprobs: [{token, bytes, logprob}]}` and is
given to the message text it produced: the tokens decoded since the last text delta go with the
next `text_delta` operation (streamed as that `response.output_text.delta`'s `logprobs`) and
into the message's `output_text` part. Tokens of the reasoning and of tool calls belong to no
output_text and are left out.
"""
from __future__ import annotations


class TokenLogprobs:
    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._pending: list[dict] = []

    def _entry(self, token_id: int, logprob: float) -> dict:
        raw = self._tok.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw),
                "logprob": logprob}

    def record(self, ev) -> None:
        """A TokenEvent that carries its log-probabilities."""
        if ev.logprob is None:
            return
        e = self._entry(ev.token_id, ev.logprob)
        e["top_logprobs"] = [self._entry(i, lp) for i, lp in ev.top or ()]
        self._pending.append(e)

    def assign(self, ops, items: list[dict], was_reasoning: bool) -> None:
        """Give the tokens recorded so far to the text the assembler's `ops` (from one push)
        added: the last text delta's message takes them; reasoning and a tool call drop them;
        text still held back (a possible tool call's start) keeps them for later."""
        texts = [op for op in ops if op.kind == "text_delta" and op.text]
        if was_reasoning and not texts:
            self._pending = []
            return
        if texts:
            op = texts[-1]
            op.logprobs = self._pending
            items[op.index]["content"][0]["logprobs"].extend(self._pending)
            self._pending = []
        elif any(op.kind == "added" and items[op.index]["type"] == "function_call"
                 for op in ops):
            self._pending = []
