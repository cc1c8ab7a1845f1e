"""What the HTTP layer hands the engine and what it gets back.

A `GenerationRequest` goes in through `Engine.submit` (which may raise `PromptTooLong` or
`QueueFull`); its `emit` callback receives a `TokenEvent` per output token and one
`DoneEvent`, called on the engine thread.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from engine.runtime.sampling import SamplingParams


class PromptTooLong(ValueError):
    """A prompt of at least the engine's context_tokens: it could never be admitted (the
    server answers 400 context_length_exceeded before it gets here)."""


@dataclass
class TokenEvent:
    token_id: int
    # Only for a request that asked for log-probabilities (`GenerationRequest.logprobs`): the
    # token's log-probability under the model's distribution, and the `logprobs` most likely
    # tokens as (id, log-probability) pairs, most likely first.
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None


@dataclass
class DoneEvent:
    finish_reason: str  # "stop" | "length" | "cancelled" | "queue_timeout" | "error"
    prompt_tokens: int
    output_tokens: int
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    error: str | None = None
    cached_tokens: int = 0
    path: str = "root"  # root | continuation | fork | shared-prefix | host-restored
    # speculative decoding's counts (`SpecStats.as_dict`): verify passes, and per draft
    # position the tokens drafted and accepted; None when speculation is off
    speculative: dict | None = None

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    emit: Callable[[object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    principal: str | None = None         # states are stored and reused per principal only
    session: str | None = None           # prompt_cache_key: None marks a one-off request
    prefix_boundary: int = 0             # end of the stable prefix (system turn): snapshot there
    key_data: np.ndarray | None = None   # uint32[2], the request's sampling key
    first_token_at: float | None = None
    path: str = "root"
    cached_tokens: int = 0
    # engine.constrain.Constraint (tool_choice, JSON format, thinking budget); None: no mask and
    # no per-step cost. Owned by the engine thread once submitted.
    constraint: object | None = None
    # engine.runtime.speculative.SpecStats: set by the engine when speculation is on
    speculative: object | None = None
    # None: no log-probabilities; k >= 0: each TokenEvent carries its token's log-probability
    # and the k most likely alternatives (at most MAX_TOP_LOGPROBS).
    logprobs: int | None = None
