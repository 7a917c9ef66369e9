"""The synchronous front of the engine core: a call's prompts submitted at once and run to
completion on the calling thread (`LLM.generate`, `specdecode bench`, `specdecode distill`).

An offline engine starts with one row and a few blocks and grows between calls (`EngineCore.grow`):
rows up to OFFLINE_ROWS, blocks for the call's longest request on every row plus the prefix
cache's bound, so a later chat turn finds the earlier turns' blocks. An LLM that serves
(`LLM.serve_core`) has one core at the server's size instead, and its calls join the server's batch.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..footprint import kv_bytes_per_token
from ..params import SamplingParams
from .config import EngineConfig
from .core import EngineCore
from .sequence import Failed, Finished, Request, Sequence, Tokens, check_prompt_ids

OFFLINE_ROWS = 32        # rows decoding at once in one call
BLOCK_SIZE = 16
StreamCallback = Callable[[Sequence, list[int]], None]


def offline_core(target, drafter, num_speculative_tokens: int, adaptive: bool = True,
                 prefix_cache_bytes: int = 0, config: EngineConfig | None = None) -> EngineCore:
    """The one place an engine core is built. For calls on the calling thread (an LLM's, a bench
    cell's, distill's): one row and one block to start (`run` grows it), prefix caching up to
    `prefix_cache_bytes` of idle blocks (0: off). With `config` (a server's, `LLM.serve_core`): at
    that config's full size, rows and flags, never grown; calls then queue beside its requests."""
    if config is not None:
        return EngineCore(target, drafter, config)
    block_bytes = kv_bytes_per_token(target.model) * BLOCK_SIZE
    config = EngineConfig(max_batch_size=OFFLINE_ROWS, max_queue=1_000_000, prefill_stall_ms=0, block_size=BLOCK_SIZE,
                          num_speculative_tokens=num_speculative_tokens if drafter is not None else 0,
                          adaptive=adaptive, prefix_cache=prefix_cache_bytes > 0,
                          prefix_cache_blocks=prefix_cache_bytes // max(block_bytes, 1))
    return EngineCore(target, drafter, config, rows=1, num_blocks=2)


def prepare(core: EngineCore, rows: int, tokens: int) -> None:
    """Rows and blocks for `rows` requests of up to `tokens` positions, and the cost curve their
    steps read (a call does it itself; a caller that times calls does it first). Between two
    iterations of a core that serves (`core.gate`)."""
    with core.gate:
        core.grow(min(rows, OFFLINE_ROWS), tokens)
        core.measure_costs(min(rows, OFFLINE_ROWS))


def run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams],
        num_speculative_tokens: int | None = None, on_tokens: StreamCallback | None = None) -> list[Sequence]:
    """Every prompt to completion; the finished sequences in prompt order, each with the call's
    wall time as its total (`stats.total_seconds`).
    `num_speculative_tokens`: this call's k (0: plain decoding) where not the engine's."""
    model = core.target.model
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        check_prompt_ids(i, prompt, p, core.context, model.vocab_size)
    prepare(core, len(prompts), max(len(prompt) + p.max_tokens for prompt, p in zip(prompts, params)))
    k = num_speculative_tokens
    done: dict[int, Sequence] = {}
    errors: list[str] = []
    ended = threading.Semaphore(0)                # one release per request that ended

    def sink_for(i: int):
        def sink(event) -> None:
            if isinstance(event, Tokens):
                if on_tokens is not None:
                    on_tokens(event.sequence, event.ids)
                return
            if isinstance(event, Finished):
                done[i] = event.sequence
            elif isinstance(event, Failed):
                errors.append(event.message)
            ended.release()
        return sink
    started = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.submit(Request(list(prompt), p, sink_for(i), speculate=False if k == 0 else None,
                            num_speculative_tokens=k if k and k != core.config.num_speculative_tokens else None,
                            id=i))
    if core.looping:                              # a served core: its loop runs the call's requests
        for _ in prompts:
            ended.acquire()
    else:
        core.run_until_idle()
    if errors:
        raise RuntimeError(f"generation failed: {errors[0]}")
    total = time.perf_counter() - started
    seqs = [done[i] for i in range(len(prompts))]
    for s in seqs:
        s.stats.total_seconds = total
    return seqs
