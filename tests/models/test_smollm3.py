"""SmolLM3 natively: Llama with no RoPE on some layers (ModelConfig.rope_layers, models/transformer.py).
A tiny random SmolLM3 saved by transformers (NoPE on every 4th layer, its default), checked against
transformers: logits over a prefill, decode steps and a tree pass; greedy output against generate
and speculative output identical to plain decoding."""
import json

import pytest
import torch
from conftest import assert_tree_paths_match_chains, make_tokenizer
from conftest import hf_reference as reference

from specdecode import LLM, SamplingParams
from specdecode.fast import decoder as fast_decoder
from specdecode.models.config import ModelConfig
from specdecode.models.loader import load_model

PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown fox"


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM
    folder = tmp_path_factory.mktemp("smollm3")
    make_tokenizer(folder)
    vocab_size = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(3)
    model = SmolLM3ForCausalLM(SmolLM3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, bos_token_id=None, pad_token_id=0))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(5.0)       # a sharper output distribution: fewer near-ties
        for layer in model.model.layers:                # scores large enough for positions to matter
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def test_config(smollm3):
    cfg = json.loads((smollm3 / "config.json").read_text())
    config = ModelConfig.from_hf(cfg)
    assert config.arch == "llama" and config.rope_layers == (True, True, True, False) and config.tie_word_embeddings
    assert ModelConfig.from_hf({k: v for k, v in cfg.items() if k != "no_rope_layers"}) == config   # the default
    assert ModelConfig.from_hf(config.to_hf()) == config


@pytest.mark.parametrize("fast", [False, True])
def test_logits_match_transformers(smollm3, fast):
    lm = load_model(str(smollm3), dtype="fp32", progress=False, fast=fast)
    model, ref = lm.model, reference(smollm3)
    assert lm.native and model.fused is None
    if fast:
        assert fast_decoder.why_not(model) == "layers without RoPE (SmolLM3) run eagerly"
    tokens = torch.randint(3, model.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(tokens).logits
        ref.model.layers[3].self_attn.use_rope = True             # RoPE on every layer: other logits
        assert not torch.allclose(ref(tokens).logits, expected, atol=1e-2)
    cache = model.new_cache(1, 32)
    torch.testing.assert_close(model.forward(tokens[:, :24], cache, 0), expected[:, :24], atol=1e-4, rtol=1e-4)
    for pos in range(24, 30):
        torch.testing.assert_close(model.forward(tokens[:, pos:pos + 1], cache, pos)[:, 0], expected[:, pos],
                                   atol=1e-4, rtol=1e-4)
    assert_tree_paths_match_chains(model, reference(smollm3))


def test_greedy_matches_generate_and_speculation(smollm3):
    llm = LLM(model=str(smollm3), method="ngram", dtype="fp32", progress=False, adaptive=False,
              num_speculative_tokens=4)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = llm.generate(PROMPT, params, num_speculative_tokens=0)[0]
    assert llm.generate(PROMPT, params)[0].token_ids == plain.token_ids
    prompt = torch.tensor([plain.prompt_token_ids])
    expected = reference(smollm3).generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    assert plain.token_ids == expected[0, prompt.shape[1]:].tolist()
