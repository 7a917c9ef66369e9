"""Prefill chunks sized by their measured cost (serve/prefill.py): a long prompt arriving while
another request decodes is prefilled in small passes (the stream stalls about --prefill-stall-ms
per pass, not for a whole --prefill-chunk), alone it is prefilled in full chunks, and the greedy
outputs are those of each request alone whatever the chunking."""
from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from specdecode import LLM, SamplingParams
from specdecode.engine.config import EngineConfig
from specdecode.engine.scheduler import PrefillBudget
from specdecode.params import ParamError
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state


def test_budget_follows_the_measured_cost_only_while_requests_decode():
    b = PrefillBudget(chunk=256, stall_s=0.1)
    assert b.tokens(decoding=True) == 256                  # nothing measured yet
    b.observe(100, 0.1)                                    # 1 ms per token
    assert b.per_token_s == pytest.approx(0.001)
    assert b.tokens(decoding=True) == 100                  # 100 ms of prefill per pass
    assert b.tokens(decoding=False) == 256                 # nobody waits: full chunks
    b.observe(10, 0.1)                                     # 10 ms per token, smoothed
    assert b.per_token_s == pytest.approx(0.7 * 0.001 + 0.3 * 0.01)
    assert b.tokens(decoding=True) == 27                   # int(0.1 / 0.0037)
    b.per_token_s = 1.0
    assert b.tokens(decoding=True) == 16                   # the floor: prefill still progresses
    assert PrefillBudget(chunk=8, stall_s=0.1, per_token_s=1.0).tokens(decoding=True) == 8
    assert PrefillBudget(chunk=256, stall_s=0.0, per_token_s=1.0).tokens(decoding=True) == 256   # fixed
    b.observe(0, 1.0)
    b.observe(5, 0.0)                                      # nothing to learn from
    assert b.per_token_s == 1.0


@pytest.mark.parametrize("bad", [-1, 60_001, "100", True, float("nan")])
def test_bad_stall_is_refused_by_name(bad):
    with pytest.raises(ParamError, match="prefill_stall_ms must be a number of milliseconds in \\[0, 60000\\]"):
        EngineConfig(prefill_stall_ms=bad)


@pytest.mark.usefixtures("one_thread")
def test_a_long_prompt_is_prefilled_in_small_passes_while_another_request_decodes(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama_draft"]), dtype="fp32", progress=False)
    tok = llm.tokenizer
    short = "the quick brown fox"
    long = " ".join(f"word{i}" for i in range(14))
    n_long = len(tok.encode(long))
    assert 64 < n_long < 130
    want = {text: llm.generate([tok.encode(text)], SamplingParams(max_tokens=n, ignore_eos=True),
                               num_speculative_tokens=0)[0].token_ids
            for text, n in ((short, 60), (long, 4))}
    state = build_state(llm, EngineConfig(max_batch_size=2, block_size=4, prefill_chunk=64, prefill_stall_ms=50,
                                         max_model_len=200, served_model_name="tiny",
                                         prefix_cache=False))     # the second long prompt is prefilled again
    engine = state.engine
    engine.scheduler.budget.observe = lambda tokens, seconds: None     # a slow machine: 5 ms per prompt token
    engine.scheduler.budget.per_token_s = 0.005                        # -> 10 tokens fit 50 ms: the floor, 16
    passes = []                                                        # (tokens, requests decoding)
    inner = engine.runner.prefill

    def recording(chunks, draft=False):
        passes.append((sum(n for _, n in chunks), len(engine.scheduler.running)))
        return inner(chunks, draft)
    engine.runner.prefill = recording
    first_token, long_sent = threading.Event(), threading.Event()
    submit, step = engine.submit, engine.step

    def submitting(request):
        submit(request)
        if len(request.prompt_ids) > 64:
            long_sent.set()

    steps = []

    def stepping(*args, **kwargs):          # after its first step the short request waits for the long
        if steps:                           # one to arrive (a fast scheduler, or a client slow to read the
            long_sent.wait(60)              # first token, would see its 60 tokens finish first)
        steps.append(1)
        return step(*args, **kwargs)
    engine.submit, engine.step = submitting, stepping

    async def run(url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(text, n, wait):
            if wait:
                await asyncio.get_running_loop().run_in_executor(None, first_token.wait, 60)
            stream = await client.completions.create(model="tiny", prompt=text, max_tokens=n, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True,
                                                                              "return_token_ids": True})
            ids = []
            async for chunk in stream:
                if chunk.choices:
                    ids += chunk.choices[0].token_ids or []
                    first_token.set()
            return ids
        return await asyncio.gather(one(short, 60, False), one(long, 4, True))

    with BackgroundServer(create_app(state)) as server:
        got_short, got_long = asyncio.run(run(server.url))
        alone = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120).completions.create(
            model="tiny", prompt=long, max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
    assert got_short == want[short] and got_long == want[long]
    assert alone.choices[0].token_ids == want[long]
    during = [n for n, decoding in passes if decoding]
    assert during and max(during) == 16 and sum(during) >= n_long - 16   # the long prompt, 16 at a time
    idle = [n for n, decoding in passes if not decoding]
    assert 64 in idle                                                   # alone: full chunks


def test_a_short_prompt_is_not_queued_behind_a_long_prefill(tiny_models):
    """Prefill passes take the shortest remaining prompt first: a short request that arrives while
    a long prompt is being prefilled in small passes finishes its prefill in the next pass."""
    from specdecode.engine.sequence import Finished, Request
    llm = LLM(model=str(tiny_models["llama"]), method="none", dtype="fp32", progress=False)
    tok = llm.tokenizer
    long_ids = tok.encode(" ".join(f"word{i}" for i in range(14)))
    short_ids = tok.encode("the quick brown fox")
    state = build_state(llm, EngineConfig(max_batch_size=2, block_size=4, prefill_chunk=16, max_model_len=200,
                                         served_model_name="tiny"))
    sched = state.engine
    passes = []
    inner = sched.runner.prefill

    def recording(chunks, draft=False):
        passes.append([(len(s.prompt_ids), n) for s, n in chunks])
        return inner(chunks, draft)
    sched.runner.prefill = recording
    done = {name: threading.Event() for name in ("long", "short")}

    def sink_for(name):
        return lambda event: done[name].set() if isinstance(event, Finished) else None
    sched.start()
    try:
        with sched.gate:
            for name, ids in (("long", long_ids), ("short", short_ids)):
                sched.submit(Request(ids, SamplingParams(max_tokens=2, ignore_eos=True), sink_for(name)))
        assert done["long"].wait(60) and done["short"].wait(60)
    finally:
        sched.stop()
    short_pass = next(i for i, p in enumerate(passes) if any(length == len(short_ids) for length, _ in p))
    assert short_pass == 0, passes                      # with the long prompt's first chunk, not after its last
    # every prompt token but the last (a step's) in prefill passes
    assert sum(n for p in passes for length, n in p if length == len(long_ids)) == len(long_ids) - 1
