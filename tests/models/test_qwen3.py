"""Qwen3 natively: an RMSNorm over each q and k head before RoPE (`ModelConfig.qk_norm`), no qkv
bias. A tiny random Qwen3 saved by transformers' own class: logits against transformers, eager
and fused, and greedy speculative output identical to plain decoding."""
import pytest
import torch
from conftest import make_model

from specdecode import LLM, SamplingParams
from specdecode.fast import linear as fast_linear
from specdecode.models.loader import load_model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=7, layers=2, hidden=64, heads=4, kv_heads=2)


@pytest.mark.parametrize("fast", [False, True])
def test_logits_match_transformers(qwen3, fast):
    from transformers import AutoModelForCausalLM
    lm = load_model(str(qwen3), dtype="fp32", progress=False, fast=fast)
    assert lm.model.config.arch == "qwen3" and lm.model.config.qk_norm
    if fast and fast_linear._load()["lib"] is not None:
        assert lm.model.fused is not None
    ref = AutoModelForCausalLM.from_pretrained(str(qwen3), dtype=torch.float32).eval()
    tokens = torch.randint(0, lm.model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    expected = ref(tokens).logits
    cache = lm.model.new_cache(1, 64)
    got = lm.model.forward(tokens[:, :16], cache, 0)                      # prefill
    torch.testing.assert_close(got, expected[:, :16], atol=1e-4, rtol=1e-4)
    for pos in range(16, 18):                                              # decode
        torch.testing.assert_close(lm.model.forward(tokens[:, pos:pos + 1], cache, pos)[:, 0], expected[:, pos],
                                   atol=1e-4, rtol=1e-4)
    got = lm.model.forward(tokens[:, 18:24], cache, 18)                   # a verify-sized block
    torch.testing.assert_close(got, expected[:, 18:24], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_speculation_equals_plain(qwen3, dtype, method):
    if dtype == "bf16" and not fast_linear._load().get("bf16"):
        pytest.skip("no avx512_bf16")
    llm = LLM(model=str(qwen3), method=method, dtype=dtype, progress=False, adaptive=False, num_speculative_tokens=8)
    prompts = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "1 2 3 4 5 6 7 8 1 2 3"]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    spec = llm.generate(prompts, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
