"""The engine on a CUDA device (skipped without one; run on a GPU machine with
`python -m pytest -q tests/test_cuda.py`): greedy speculative decoding equals plain decoding for
the chain, tree and draft-model drafters and a predicted output, a ragged batch included, and a
seeded sampled request gives the same text with speculation on and off. The CPU-only parts stay
off there (no fused decoder, so no prefix cache)."""
from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox",
           "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
           "1 2 3 4 5 6 7 8 9 10 11 12"]


@pytest.mark.parametrize("method", ["ngram", "suffix", "model", "recycle"])
def test_speculative_equals_plain_on_cuda(tiny_models, method):
    draft = str(tiny_models["llama_draft"]) if method == "model" else None
    llm = LLM(model=str(tiny_models["llama"]), draft=draft, method=method, dtype="fp32", device="cuda",
              progress=False)
    assert llm.target.model.device.type == "cuda" and not llm.core.config.prefix_cache
    tok = llm.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = llm.generate(ids, greedy, num_speculative_tokens=0)
    spec = llm.generate(ids, greedy)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    one = llm.generate([ids[0]], greedy)[0]                     # batch 1 as in the batch
    assert one.token_ids == plain[0].token_ids
    if method in ("ngram", "suffix"):
        answer = tok.decode(plain[1].token_ids)
        predicted = llm.generate([ids[1]], SamplingParams(max_tokens=40, ignore_eos=True, prediction=answer))[0]
        assert predicted.token_ids == plain[1].token_ids
        seeded = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=11)
        assert llm.generate([ids[2]], seeded)[0].token_ids == \
            llm.generate([ids[2]], seeded, num_speculative_tokens=0)[0].token_ids


def test_bf16_on_cuda_runs_and_stays_greedy_equal(tiny_models):
    llm = LLM(model=str(tiny_models["qwen2"]), method="ngram", dtype="bf16", device="cuda", progress=False,
              adaptive=False)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = llm.generate(ids, greedy, num_speculative_tokens=0)
    spec = llm.generate(ids, greedy)
    same = sum(s.token_ids == p.token_ids for s, p in zip(spec, plain))
    assert same >= len(ids) - 1        # bf16 on a GPU is not batch invariant: a near-tie may flip one row
