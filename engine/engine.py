"""The serving engine: one thread owns the device and runs the scheduler's steps.

The HTTP layer submits a `GenerationRequest` (which may raise `QueueFull`) and receives
`TokenEvent`s and one `DoneEvent` through the request's `emit` callback, called on the engine
thread. Up to `max_concurrency` sequences run at once, each in its own row of a batched paged
cache: decode steps are batched over all decoding rows, prefill runs in chunks interleaved with
them. A prompt that extends a stored state (an earlier response of the same principal, or the
shared system prefix) continues from it and computes only its new tokens.

`Engine` glues the stages together: the scheduler (engine/runtime/scheduler.py), the device
memory (runtime/memory.py), the model runner (runtime/runner.py: the forward, compiled ahead of
time, and the batch sampler) and the engine thread's loop (runtime/loop.py, with its chained
decode steps). A checkpointer sees the engine through `hooks` and `checkpoint`
(runtime/checkpoint_port.py) only.
"""
from __future__ import annotations

import concurrent.futures
import secrets
import threading
import time

import jax
import numpy as np

from engine.io.loader import LoadedModel
from engine.plan import REFERENCE, KernelPlan, check_plan
from engine.runtime.checkpoint_port import CheckpointPort, EngineHooks
from engine.runtime.keep_warm import KeepWarm, KeepWarmConfig
from engine.runtime.loop import StepLoop
from engine.runtime.memory import Memory, token_key
from engine.runtime.request import (DoneEvent, GenerationRequest,  # noqa: F401 (re-export)
                                    PromptTooLong, TokenEvent)
from engine.runtime.runner import BatchSampler, ModelRunner
from engine.runtime.sampling import request_key
from engine.runtime.scheduler import (Inbox, QueueFull, Scheduler,  # noqa: F401 (re-export)
                                      Sequence)


class Engine:
    """An engine of `max_concurrency` rows over `model` under `plan`. `hooks`: the callbacks it
    makes into its host, on the engine thread (a checkpointer's `before_evict`); `checkpoint`:
    what a checkpointer may read and call (engine/runtime/checkpoint_port.py)."""

    def __init__(self, model: LoadedModel, *, context_tokens: int, prefill_chunk: int,
                 max_concurrency: int = 1, max_queue: int = 16, queue_timeout_s: float = 120.0,
                 capacity_tokens: int | None = None, state_slots: int = 8,
                 host_state_bytes: int = 0, hooks: EngineHooks | None = None,
                 plan: KernelPlan = REFERENCE, keep_warm: KeepWarmConfig | None = None,
                 speculative=None):
        # what runs: the forward's implementations and the loop's form (engine/plan.py)
        self.plan = check_plan(plan)
        self.context_tokens = context_tokens
        self.B = max_concurrency
        self.sched = Scheduler(max_concurrency=max_concurrency, max_queue=max_queue,
                               queue_timeout_s=queue_timeout_s,
                               capacity_tokens=min(capacity_tokens or context_tokens *
                                                   max_concurrency,
                                                   context_tokens * max_concurrency),
                               prefill_chunk=prefill_chunk,
                               short_piece=self.plan.short_piece)
        self.runner = ModelRunner(model, self.plan, batch=max_concurrency,
                                  prefill_chunk=prefill_chunk)
        self.sampler = BatchSampler(batch=max_concurrency, n_vocab=model.tokenizer.vocab_size,
                                    context_tokens=context_tokens)
        hooks = hooks or EngineHooks()
        mtp = speculative is not None and speculative.mtp
        if mtp and not (model.cfg.mtp_layers and "mtp" in model.params):
            raise ValueError(f"speculative.method {speculative.drafter.name!r} needs a model "
                             f"with MTP weights; "
                             f"{model.cfg.name!r} has none (allowed here: 'off', "
                             f"'prompt_lookup')")
        self.mem = Memory(model.cfg, batch=max_concurrency, context_tokens=context_tokens,
                          capacity_tokens=capacity_tokens or context_tokens * max_concurrency,
                          kv_dtype=model.kv_dtype, conv_dtype=model.compute_dtype,
                          state_slots=state_slots, host_state_bytes=host_state_bytes,
                          before_evict=hooks.before_evict, mtp=mtp)
        self.inbox = Inbox(max_queue)
        # chained decode steps (the plan's chain_decode): the next step is dispatched with the
        # sampled tokens still on the device, before the host reads them
        # speculative: a SpecConfig (engine/runtime/speculative.py) or None; its verify passes
        # replace the decode steps, which are then never chained
        self.speculative = speculative
        self.loop = StepLoop(sched=self.sched, mem=self.mem, runner=self.runner,
                             sampler=self.sampler, inbox=self.inbox,
                             context_tokens=context_tokens,
                             chain_decode=self.plan.chain_decode and speculative is None,
                             speculative=speculative)
        self.checkpoint = CheckpointPort(self.mem, self.call)
        # while idle, the GPU's clocks kept up (runtime/keep_warm.py; a no-op off CUDA)
        self.keep_warm = KeepWarm.for_backend(keep_warm or KeepWarmConfig(),
                                              jax.default_backend())
        self.loop.keep_warm = self.keep_warm
        self._thread = threading.Thread(target=self.loop.run, name="ninfer-engine", daemon=True)

    @property
    def model(self) -> LoadedModel:
        return self.runner.model

    @property
    def exec_counts(self) -> dict:
        """How many of the forward's executables compile() loaded from the store and compiled."""
        return self.runner.exec_counts

    @property
    def exec_saving(self) -> threading.Thread | None:
        """compile()'s background saves into the store, or None."""
        return self.runner.exec_saving

    @property
    def chained_steps(self) -> int:
        """Decode steps dispatched before the last one's tokens were read."""
        return self.loop.chain.steps

    @property
    def _pending(self) -> int:
        """Requests submitted and not yet admitted (or expired)."""
        return self.inbox.pending

    def memory_stats(self) -> dict:
        """The memory's gauges (`Memory.stats`: pages, state images, evictions)."""
        return self.mem.stats()

    def stats(self) -> dict:
        """The memory's gauges (`Memory.stats`: pages, state images, evictions) with the
        sequences running and waiting (submitted, not yet admitted)."""
        return {**self.mem.stats(), "running": len(self.sched.running),
                "waiting": self.inbox.pending}

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.inbox.put(None)
        self._thread.join(timeout=30)
        self.keep_warm.close()

    def submit(self, req: GenerationRequest) -> None:
        """Queue a request; raises QueueFull when max_queue requests already wait, and
        PromptTooLong at once for a prompt that leaves no room in the context (it would wait
        in the queue until its timeout, as no row can ever hold it)."""
        if len(req.prompt_ids) >= self.context_tokens:
            raise PromptTooLong(f"the prompt is {len(req.prompt_ids)} tokens; the context holds "
                                f"{self.context_tokens}, including at least one output token")
        self.inbox.reserve()
        seed = req.sampling.seed
        if seed is None:  # unseeded sampling: a fresh key per request
            seed = secrets.randbits(63)
        req.key_data = np.asarray(jax.random.key_data(request_key(seed)))
        if self.speculative is not None:
            from engine.runtime.speculative import SpecStats

            req.speculative = SpecStats()
        self.inbox.put(Sequence(prompt_ids=list(req.prompt_ids), max_tokens=req.max_tokens,
                                emit=req.emit, payload=req, breakpoint=req.prefix_boundary))

    def forget(self, principal: str, tokens) -> None:
        """Drop the stored state that follows exactly `tokens` for `principal` (asynchronous:
        done by the engine thread before its next step)."""
        self.inbox.put(("forget", principal, token_key(principal, tokens)))

    def forget_session(self, principal: str, session: str) -> None:
        """Drop every stored state of (principal, session) (asynchronous, like `forget`)."""
        self.inbox.put(("forget_session", principal, session))

    def call(self, fn) -> concurrent.futures.Future:
        """Run `fn(self)` on the engine thread between steps (it may read and change `mem`);
        returns a Future with its result. Used for checkpoint export and restore."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self))
                except Exception as e:  # reported to the caller, never kills the loop
                    fut.set_exception(e)

        self.inbox.put(run)
        return fut

    # ---- compile and warm-up ------------------------------------------------------------
    def warmup(self, threads: int | None = None) -> float:
        """Compile the decode step, every prefill piece width and the sampler; returns seconds.
        The same as compile() then warm_run()."""
        return self.compile(threads) + self.warm_run()

    def compile(self, threads: int | None = None, store=None) -> float:
        """Compile the forward for the decode step and every prefill piece width, ahead of
        time (`ModelRunner.compile`: store, an ExecStore or None, holds executables across
        starts); returns seconds. Needs only the params' shapes and dtypes, so it may run
        before they are on the device: an engine built on ModelLoad.abstract compiles while
        the weights are copied, and attach() gives it the loaded model afterwards."""
        return self.runner.compile(self.mem.cache, threads, store)

    def load_exported(self, blobs: dict) -> float:
        """Take the forward of every shape from `blobs` ({(rows, width): an exported forward},
        engine/runtime/exported.py) instead of compile(): checked against this engine (platform,
        plan, shapes, model and cache; ExportMismatch says what differs), then compiled without
        tracing the model; returns seconds."""
        from engine.runtime.exported import load_forwards

        return load_forwards(self.runner, blobs, self.mem.cache)

    def attach(self, model: LoadedModel) -> None:
        """Give an engine built on a ModelLoad's abstract model the loaded one (same config,
        shapes and dtypes: the compiled executables stay valid). Before start() only."""
        self.runner.attach(model)

    def warm_run(self) -> float:
        """Run the decode step once (length 0: nothing is written), the samplers on its logits
        and the chained steps' inputs, so that the first request neither compiles nor loads
        anything; returns seconds. Needs the params on the device."""
        t0 = time.monotonic()
        self.mem.warm()  # admission, reuse and storing's device ops (`Memory.warm`)
        logits, self.mem.cache = self.runner.warm(self.mem.cache)
        picked, _ = self.sampler.sample(logits[:, 0], [None] * self.B)
        self.loop.chain.warm(picked)
        self.sampler.warm(logits[:, 0])
        if self.loop.spec is not None:  # the verify pass and its commit, with nothing written
            self.loop.spec.warm()
        jax.block_until_ready(self.mem.cache)
        return time.monotonic() - t0
