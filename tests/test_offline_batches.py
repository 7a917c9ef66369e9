"""`LLM.generate` of many prompts through the server's scheduler (serve/offline.py): the same
outputs as the fixed batch and as each prompt alone, rows admitted as others end, and the calls
it does not take left to the fixed batch."""
from __future__ import annotations

import pytest

from specdecode import LLM, SamplingParams
from specdecode.params import ParamError
from specdecode.serve import offline


def ragged(tok) -> list[list[int]]:
    """Prompts of a few to ~70 tokens: a fixed batch pads every one to the longest."""
    texts = ["hi", "the quick brown fox jumps", " ".join(f"word{i}" for i in range(10)), "a b c d e f g",
             "one two", " ".join(f"x{i}" for i in range(8))]
    return [tok.encode(t) for t in texts]


@pytest.mark.parametrize("method", ["none", "ngram", "suffix"])
def test_many_prompts_run_through_the_scheduler_with_the_fixed_batchs_outputs(tiny_models, method):
    llm = LLM(model=str(tiny_models["llama"]), method=method, dtype="fp32", progress=False)
    prompts = ragged(llm.tokenizer)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 5, 33, 12, 1, 27)]
    calls = []
    inner = llm.offline.generate
    llm.offline.generate = lambda *a, **kw: calls.append(len(a[0])) or inner(*a, **kw)
    got = llm.generate(prompts, params)
    assert calls == [len(prompts)]                           # the scheduler ran this call
    fixed = llm.engine().generate(prompts, params)          # one fixed batch, lockstep
    assert [o.token_ids for o in got] == [s.output_ids for s in fixed]
    for prompt, p, o in zip(prompts, params, got):
        assert len(o.token_ids) == p.max_tokens and o.finish_reason == "length"
        assert o.prompt_token_ids == prompt and o.text == llm.tokenizer.decode(o.token_ids)
        assert o.stats["num_tokens"] == p.max_tokens and o.stats["total_s"] > 0
    alone = llm.generate([prompts[2]], params[2])[0]        # one prompt: the fixed batch
    assert calls == [len(prompts)] and alone.token_ids == got[2].token_ids
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    assert [o.token_ids for o in plain] == [o.token_ids for o in got]
    first = llm.offline.scheduler
    longer = llm.generate(prompts + prompts, [SamplingParams(max_tokens=60, ignore_eos=True)] * 12)
    assert len(calls) == 3 and all(len(o.token_ids) == 60 for o in longer)
    assert llm.offline.scheduler is not first and llm.offline.context >= max(map(len, prompts)) + 60   # rebuilt


def test_calls_the_scheduler_does_not_take(tiny_models):
    """Fewer than CONTINUOUS_MIN prompts, a fixed draft size (adaptive=False), a drafter with
    per-request state, seeded sampling, logprobs or a streaming callback: the fixed batch."""
    llm = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False)
    prompts = ragged(llm.tokenizer)
    greedy = [SamplingParams(max_tokens=4)] * len(prompts)
    assert offline.suits(llm, prompts, greedy, None)
    assert not offline.suits(llm, prompts[:offline.CONTINUOUS_MIN - 1], greedy, None)
    assert not offline.suits(llm, prompts, greedy, lambda s, t: None)
    assert not offline.suits(llm, prompts, [SamplingParams(max_tokens=4, temperature=0.7, seed=1)] * 6, None)
    assert offline.suits(llm, prompts, [SamplingParams(max_tokens=4, temperature=0.7)] * 6, None)
    assert not offline.suits(llm, prompts, [SamplingParams(max_tokens=4, logprobs=2)] * 6, None)
    fixed = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False, adaptive=False)
    assert not offline.suits(fixed, prompts, greedy, None)
    pair = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama_draft"]), dtype="fp32",
               progress=False, method="model")
    assert not offline.suits(pair, prompts, greedy, None)


def test_a_bad_request_is_refused_by_name_as_in_the_fixed_batch(tiny_models):
    """The scheduler's calls are checked as the fixed batch's: a prompt that does not fit, an empty
    one, token ids outside the vocabulary (these once reached the native kernels: a crash)."""
    llm = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False)
    prompts = ragged(llm.tokenizer)
    context, vocab = llm.target.model.max_len, llm.target.model.vocab_size
    with pytest.raises(ParamError, match="exceeds the model's context"):
        llm.generate(prompts, SamplingParams(max_tokens=context))
    with pytest.raises(ParamError, match="prompt 5 is empty"):
        llm.generate(prompts[:5] + [[]], SamplingParams(max_tokens=4))
    with pytest.raises(ParamError, match=r"prompt 5 has token ids outside the vocabulary"):
        llm.generate(prompts[:5] + [[1, vocab + 7]], SamplingParams(max_tokens=4))
    assert llm.offline.scheduler is None                     # refused before anything ran


def test_a_call_whose_kv_pool_does_not_fit_runs_as_one_fixed_batch(tiny_models, monkeypatch):
    import specdecode.serve.server as server
    llm = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False)
    prompts = ragged(llm.tokenizer)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    monkeypatch.setattr(server, "available_bytes", lambda: 1)          # no memory to spare
    got = llm.generate(prompts, params)
    assert llm.offline.scheduler is None and llm.offline.refused is None     # not built; tried again later
    assert [o.token_ids for o in got] == [s.output_ids for s in llm.engine().generate(prompts, [params] * 6)]
    monkeypatch.undo()
    llm.generate(prompts, params)
    assert llm.offline.scheduler is not None
