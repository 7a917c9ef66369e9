"""Phi-3 natively: Llama with q|k|v stored fused (qkv_proj) and gate|up fused (gate_up_proj, gate
first), untied head, an attention window like Phi-3-mini's, and RoPE on part of each head when
partial_rotary_factor < 1 (eager; the fused decoder refuses it by name). Tiny random Phi-3 models
saved by transformers' own class: logits against transformers (eager and fused, fp32 and bf16),
greedy output against transformers', greedy speculative output identical to plain decoding, end-of-
turn ids from generation_config, a GGUF file (llama.cpp's phi3: attn_qkv, ffn_up = gate|up), and
longrope scaling refused by name."""
import json

import pytest
import torch
from conftest import hf_reference as reference
from conftest import make_tokenizer
from test_mistral import greedy_reference

from specdecode import LLM, SamplingParams
from specdecode.fast import decoder as fast_decoder
from specdecode.fast import linear as fast_linear
from specdecode.models.config import ModelConfig, ModelError
from specdecode.models.loader import load_model

WINDOW = 12


def make_phi3(folder, partial_rotary_factor=1.0):
    from transformers import Phi3Config, Phi3ForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    vocab_size = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(5)
    config = Phi3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        original_max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                        sliding_window=WINDOW, tie_word_embeddings=False, partial_rotary_factor=partial_rotary_factor,
                        bos_token_id=None, eos_token_id=2, pad_token_id=None)
    model = Phi3ForCausalLM(config)
    with torch.no_grad():                      # a sharper output distribution: fewer near-ties in greedy
        model.model.embed_tokens.weight.mul_(2.5)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return make_phi3(tmp_path_factory.mktemp("phi3"))


@pytest.fixture(scope="module")
def phi3_partial(tmp_path_factory):
    return make_phi3(tmp_path_factory.mktemp("phi3_partial"), partial_rotary_factor=0.5)


def check_logits(lm, path, tol):
    ref = reference(path)
    tokens = torch.randint(0, lm.model.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    expected = ref(tokens).logits
    cache = lm.model.new_cache(1, 64)
    torch.testing.assert_close(lm.model.forward(tokens[:, :16], cache, 0), expected[:, :16], atol=tol, rtol=tol)
    for pos in range(16, 19):
        torch.testing.assert_close(lm.model.forward(tokens[:, pos:pos + 1], cache, pos)[:, 0], expected[:, pos],
                                   atol=tol, rtol=tol)
    torch.testing.assert_close(lm.model.forward(tokens[:, 19:30], cache, 19), expected[:, 19:30], atol=tol, rtol=tol)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_logits_match_transformers(phi3, fast, dtype):
    if dtype == "bf16" and fast and not fast_linear._load().get("bf16"):
        pytest.skip("no avx512_bf16")
    lm = load_model(str(phi3), dtype=dtype, progress=False, fast=fast)
    config = lm.model.config
    assert lm.native and config.arch == "phi3" and config.sliding_window == WINDOW and not config.tie_word_embeddings
    if fast and fast_linear._load()["lib"] is not None:
        assert lm.model.fused is not None
    check_logits(lm, phi3, 1e-4 if dtype == "fp32" else 8e-2)


def test_partial_rotary(phi3_partial):
    lm = load_model(str(phi3_partial), dtype="fp32", progress=False, fast=True)
    assert lm.model.config.rotary_dim == lm.model.config.head_dim // 2
    assert lm.model.fused is None and "partial_rotary_factor" in fast_decoder.why_not(lm.model)
    check_logits(lm, phi3_partial, 1e-4)


def test_greedy_matches_transformers_and_stop_ids(phi3):
    (phi3 / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))   # e.g. <|endoftext|>, <|end|>
    try:
        llm = LLM(model=str(phi3), method="ngram", dtype="fp32", progress=False, adaptive=False)
    finally:
        (phi3 / "generation_config.json").unlink()
    assert {1, 2} <= set(llm.target.eos_token_ids)
    out = llm.generate("the quick brown fox jumps over the lazy dog. the quick brown fox",
                       SamplingParams(max_tokens=64, ignore_eos=True), num_speculative_tokens=0)[0]
    assert len(out.prompt_token_ids) > WINDOW
    assert out.token_ids == greedy_reference(reference(phi3), out.prompt_token_ids, 64)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_speculation_equals_plain(phi3, dtype, method):
    if dtype == "bf16" and not fast_linear._load().get("bf16"):
        pytest.skip("no avx512_bf16")
    llm = LLM(model=str(phi3), method=method, dtype=dtype, progress=False, adaptive=False, num_speculative_tokens=8)
    prompts = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "1 2 3 4 5 6 7 8 1 2 3"]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    spec = llm.generate(prompts, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]


@pytest.mark.parametrize("weights", ["dense", "native"])
def test_gguf_loads_natively(phi3, tmp_path, monkeypatch, weights):
    from gguf_writer import write_gguf
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    if weights == "native" and fast_linear._load()["lib"] is None:
        pytest.skip("native quantized weights need the native kernels")
    ref = reference(phi3)
    path = write_gguf(tmp_path / "phi3.gguf", ref, "phi3", phi3 / "tokenizer.json", "<|im_end|>",
                      metadata={"phi3.attention.sliding_window": WINDOW})
    lm = load_model(str(path), dtype="fp32" if weights == "dense" else None, progress=False, weights=weights)
    assert lm.native and lm.model.config.arch == "phi3" and lm.model.config.sliding_window == WINDOW
    tokens = torch.randint(0, lm.model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    tol = 1e-4 if weights == "dense" else 8e-2
    torch.testing.assert_close(lm.model.forward(tokens, lm.model.new_cache(1, 32), 0), ref(tokens).logits,
                               atol=tol, rtol=tol)


def test_longrope_is_refused_by_name(phi3):
    cfg = json.loads((phi3 / "config.json").read_text())
    long = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    with pytest.raises(ModelError, match="longrope"):
        ModelConfig.from_hf(dict(cfg, rope_parameters=dict(long, rope_theta=10000.0), rope_scaling=None))
    with pytest.raises(ModelError, match="partial_rotary_factor"):
        ModelConfig.from_hf(dict(cfg, partial_rotary_factor=1.5))
