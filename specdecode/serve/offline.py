"""`LLM.generate` of many prompts through the server's scheduler: continuous batching offline.

The offline engine (engine/engine.py) runs a batch in lockstep: every prompt prefilled to the
longest one's length, every row stepped until the last one ends. Ragged work wastes most of it
(64 Spec-Bench requests of 39-1,187 prompt tokens, 64 tokens each: 108.6 tok/s on the embedded
model, AMD Zen 5, 2 cores). The server's scheduler admits rows as others end, prefills each prompt
at its own length, and its speculation policy decides per row from the batch's costs: the same
64 requests ran at 343.5 tok/s with identical outputs. `OfflineBatches` runs a call's requests
through such a scheduler on the calling thread (no HTTP, no event loop) and returns the finished
sequences in prompt order, as the engine would.

Used for calls of CONTINUOUS_MIN prompts or more whose requests the two paths answer alike
(greedy or unseeded, no logprobs, no streaming callback), with a drafter without per-request state
(lookups: n-gram, suffix, recycle, lookahead) or none (see `suits`); the scheduler is built on
the first such call (its KV pool sized for the call's longest request) and kept while later
calls fit it.
"""
from __future__ import annotations

import time

from ..params import SamplingParams
from .scheduler import Failed, Finished, Request, ServeConfig

CONTINUOUS_MIN = 4      # prompts in a call from which it runs through the scheduler
ROWS = 32               # rows decoding at once


def suits(llm, prompts: list[list[int]], params: list[SamplingParams], on_tokens) -> bool:
    """Does this call run through the scheduler? Enough prompts, a native target, the adaptive
    draft budget (`LLM(adaptive=False)` asks for k drafts every step, which only the lockstep
    engine keeps), a drafter without per-request state or none (the scheduler's rows would share
    a stateful drafter's caches with the lockstep engine's calls), and requests whose answers the
    scheduler gives exactly as the lockstep engine does: greedy or unseeded sampling (a seeded
    sampled row drafts k every step offline so that its seed reproduces it), no logprobs, no
    per-step callback."""
    drafter = llm.drafter
    return (len(prompts) >= CONTINUOUS_MIN and on_tokens is None and llm.target.native
            and llm.adaptive is not False and (drafter is None or not drafter.capabilities.has_state)
            and all((p.greedy or p.seed is None) and p.logprobs is None for p in params))


class OfflineBatches:
    """One LLM's scheduler for its offline calls (built lazily, rebuilt when a call needs more
    context than it was sized for). None where the server path cannot take the model, or the KV pool
    a call needs does not fit the free memory: the caller then runs the fixed batch."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.scheduler = None
        self.context = 0
        self.refused: str | None = None     # why the server path cannot run this model (then never tried again)

    def _scheduler(self, context: int):
        if self.scheduler is not None and context <= self.context:
            return self.scheduler
        from ..models.config import ModelError
        from .memory import MemoryBudgetError
        from .server import build_state
        llm = self.llm
        config = ServeConfig(max_batch_size=ROWS, max_queue=1_000_000, max_model_len=context,
                             num_speculative_tokens=llm.num_speculative_tokens,
                             prefix_cache=llm.prefix_store is not None)
        try:
            self.scheduler = build_state(llm, config).scheduler
        except ModelError as exc:          # this model cannot run there: never again
            self.refused = str(exc)
            return None
        except MemoryBudgetError:          # this call's KV pool does not fit the free memory: this call not
            return None
        self.context = context
        return self.scheduler

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], num_speculative_tokens: int | None):
        """The finished sequences (ServeSequence, a Sequence), in prompt order; None when this
        model cannot run through the scheduler (the caller uses the lockstep engine)."""
        if self.refused is not None:
            return None
        from ..engine.engine import check_requests
        check_requests(prompts, params, self.llm.target.model)      # as the fixed batch checks them
        context_limit = self.llm.target.model.max_len
        need = max(len(prompt) + p.max_tokens for prompt, p in zip(prompts, params))
        sched = self._scheduler(min(context_limit, max(need, self.context)))
        if sched is None:
            return None
        k = num_speculative_tokens
        done: dict[int, object] = {}
        errors: list[str] = []

        def sink_for(i: int):
            def sink(event) -> None:
                if isinstance(event, Finished):
                    done[i] = event.sequence
                elif isinstance(event, Failed):
                    errors.append(event.message)
            return sink
        started = time.perf_counter()
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            sched.submit(Request(prompt, p, sink_for(i), speculate=False if k == 0 else None,
                                 num_speculative_tokens=k or None))
        sched.run_until_idle()
        if errors:
            raise RuntimeError(f"offline batch failed: {errors[0]}")
        total = time.perf_counter() - started
        seqs = [done[i] for i in range(len(prompts))]
        for s in seqs:
            s.stats.total_seconds, s.stats.cached_tokens = total, s.cached_tokens
            if s.first_token_at is not None:
                s.stats.prefill_seconds = s.first_token_at - started
        return seqs
