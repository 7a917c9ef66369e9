"""Mistral natively: Llama with a sliding attention window (`ModelConfig.sliding_window`: a query at
position p sees the keys at positions p-W+1..p). A tiny random Mistral with a window of 8 saved by
transformers' own class, prompts longer than the window: logits against transformers (eager and
fused, fp32 and bf16, prefill, decode, verify blocks, a ragged batch), greedy output against
transformers', and greedy speculative output (chain and tree drafters) identical to plain decoding.
A GGUF file (llama.cpp stores Mistral as "llama") with the window in its metadata loads natively."""
import json

import pytest
import torch
from conftest import assert_tree_paths_match_chains, make_tokenizer
from conftest import hf_reference as reference

from specdecode import LLM, SamplingParams
from specdecode.cache.paged import PagedKVCache
from specdecode.fast import linear as fast_linear
from specdecode.forward import ForwardBatch
from specdecode.models.config import ModelConfig
from specdecode.models.loader import load_model

WINDOW = 8


def make_mistral(folder, window=WINDOW):
    from transformers import MistralConfig, MistralForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    vocab_size = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(11)
    config = MistralConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=window, tie_word_embeddings=False,
                           eos_token_id=2, bos_token_id=None, pad_token_id=None)
    model = MistralForCausalLM(config)
    with torch.no_grad():                      # a sharper output distribution: fewer near-ties in greedy
        model.model.embed_tokens.weight.mul_(2.5)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return make_mistral(tmp_path_factory.mktemp("mistral"))


def test_config_reads_the_window(mistral):
    cfg = json.loads((mistral / "config.json").read_text())
    assert ModelConfig.from_hf(cfg).sliding_window == WINDOW
    assert ModelConfig.from_hf(dict(cfg, sliding_window=None)).sliding_window is None
    # Qwen2 configs carry a window that applies only with use_sliding_window
    qwen = dict(cfg, model_type="qwen2", layer_types=None, max_window_layers=0)
    assert ModelConfig.from_hf(dict(qwen, use_sliding_window=False)).sliding_window is None
    assert ModelConfig.from_hf(dict(qwen, use_sliding_window=True)).sliding_window == WINDOW
    with pytest.raises(ValueError, match="max_window_layers"):
        ModelConfig.from_hf(dict(qwen, use_sliding_window=True, max_window_layers=1))
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf(dict(cfg, sliding_window=-3))


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_logits_match_transformers(mistral, fast, dtype):
    if dtype == "bf16" and fast and not fast_linear._load().get("bf16"):
        pytest.skip("no avx512_bf16")
    lm = load_model(str(mistral), dtype=dtype, progress=False, fast=fast)
    assert lm.native and lm.model.config.sliding_window == WINDOW
    if fast and fast_linear._load()["lib"] is not None:
        assert lm.model.fused is not None
    tol = 1e-4 if dtype == "fp32" else 8e-2
    ref = reference(mistral)
    tokens = torch.randint(0, lm.model.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    expected = ref(tokens).logits
    ref.config.sliding_window = None                       # the window matters for this prompt
    assert not torch.allclose(ref(tokens).logits[:, 20:], expected[:, 20:], atol=1e-2)
    cache = lm.model.new_cache(1, 64)
    got = lm.model.forward(tokens[:, :20], cache, 0)                      # prefill, longer than the window
    torch.testing.assert_close(got, expected[:, :20], atol=tol, rtol=tol)
    for pos in range(20, 23):                                              # decode
        torch.testing.assert_close(lm.model.forward(tokens[:, pos:pos + 1], cache, pos)[:, 0], expected[:, pos],
                                   atol=tol, rtol=tol)
    got = lm.model.forward(tokens[:, 23:30], cache, 23)                   # a verify-sized block
    torch.testing.assert_close(got, expected[:, 23:30], atol=tol, rtol=tol)
    # a ragged batch (per-row starts and cache rows), in a contiguous and in paged caches (blocks
    # smaller than, equal to and not dividing the window)
    c = lm.model.config
    caches = [lm.model.new_cache(3, 64)] + [
        PagedKVCache(c.num_layers, 3, c.num_kv_heads, c.head_dim, 64, 40, size, lm.model.dtype) for size in (4, 8, 5)]
    rows = torch.tensor([2, 0])
    for cache in caches:
        for r, n in zip(rows.tolist(), (30, 26)):
            if isinstance(cache, PagedKVCache):
                cache.reserve(r, 40)
            lm.model.forward(tokens[:, :n], cache, torch.tensor([0]), rows=torch.tensor([r]))
        fb = ForwardBatch.chain(torch.cat([tokens[:, 30:36], tokens[:, 26:32]]), torch.tensor([30, 26]), rows)
        got = lm.model.logits(lm.model.run(fb, cache))
        torch.testing.assert_close(got[0], expected[0, 30:36], atol=tol, rtol=tol)
        torch.testing.assert_close(got[1], expected[0, 26:32], atol=tol, rtol=tol)


@pytest.mark.parametrize("fast", [False, True])
def test_tree_pass_windows_each_path(mistral, fast):
    """A tree node attends to the last W keys along its own path: its logits equal those of the
    same path run as a chain (the window counted by position, i.e. depth)."""
    lm = load_model(str(mistral), dtype="fp32", progress=False, fast=fast)
    assert_tree_paths_match_chains(lm.model, reference(lm.path))


def test_greedy_matches_transformers(mistral):
    llm = LLM(model=str(mistral), method="ngram", dtype="fp32", progress=False, adaptive=False)
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox"
    out = llm.generate(prompt, SamplingParams(max_tokens=64, ignore_eos=True), num_speculative_tokens=0)[0]
    assert len(out.prompt_token_ids) > WINDOW
    assert out.token_ids == greedy_reference(reference(mistral), out.prompt_token_ids, 64)


def greedy_reference(ref, prompt_ids: list[int], n: int) -> list[int]:
    """n greedy tokens of the transformers model, end-of-sequence ignored."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, ref(ids).logits[:, -1:].argmax(-1)], 1)
    return ids[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["ngram", "suffix", "recycle"])
def test_greedy_speculation_equals_plain(mistral, dtype, method):
    if dtype == "bf16" and not fast_linear._load().get("bf16"):
        pytest.skip("no avx512_bf16")
    llm = LLM(model=str(mistral), method=method, dtype=dtype, progress=False, adaptive=False, num_speculative_tokens=8)
    prompts = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "1 2 3 4 5 6 7 8 1 2 3 4 5"]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    spec = llm.generate(prompts, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]


def test_gguf_with_window_loads_natively(mistral, tmp_path, monkeypatch):
    from gguf_writer import write_gguf
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    ref = reference(mistral)
    path = write_gguf(tmp_path / "mistral.gguf", ref, "llama", mistral / "tokenizer.json", "<|im_end|>",
                      permute_qk=True, metadata={"llama.attention.sliding_window": WINDOW})
    lm = load_model(str(path), dtype="fp32", progress=False, fast=False)
    assert lm.native and lm.model.config.sliding_window == WINDOW
    tokens = torch.randint(0, lm.model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(lm.model.forward(tokens, lm.model.new_cache(1, 32), 0), ref(tokens).logits,
                               atol=1e-4, rtol=1e-4)
