"""Qwen3.5 from llama.cpp's GGUF layout (models/qwen3_5_gguf.py): the tiny random model of conftest
written as its converter would (gguf_writer.write_qwen35_gguf: value heads tiled, norms + 1, A_log
as -exp(A_log), ...), read back densely (the HF layout again, transformers loads it) and natively on
its Q8_0 blocks."""
from __future__ import annotations

import json

import pytest
import torch
from gguf_writer import write_qwen35_gguf

from specdecode.fast import linear as fast_linear
from specdecode.forward import ForwardBatch
from specdecode.models.config import ModelConfig, ModelError
from specdecode.models.loader import load_model
from specdecode.params import SamplingParams

TOKENS = torch.tensor([[5, 17, 40, 99, 23, 8, 61, 7, 12, 33] * 8])      # 80 tokens: the chunked delta rule


@pytest.fixture(scope="module")
def files(qwen35, tmp_path_factory):
    folder, model = qwen35
    out = tmp_path_factory.mktemp("qwen35_gguf")
    return {q: write_qwen35_gguf(out / f"tiny-{q}.gguf", model, folder / "tokenizer.json", "<|im_end|>", qtype=q)
            for q in ("F32", "Q8_0")}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path_factory.getbasetemp() / "qwen35_cache"))


def logits(model, tokens=TOKENS):
    cache = model.new_paged_cache(1, 512, 32, 16)
    cache.reserve(0, tokens.shape[1] + 8)
    return model.logits(model.run(ForwardBatch.chain(tokens, 0, torch.tensor([0])), cache))[0]


def test_config_from_metadata(qwen35, files):
    lm = load_model(str(files["F32"]), dtype="fp32", progress=False)
    want = ModelConfig.from_hf(json.loads((qwen35[0] / "config.json").read_text()))
    got = lm.model.config
    assert type(lm.model).__name__ == "Qwen35Transformer" and lm.native
    assert (got.linear_layers, got.partial_rotary_factor, got.head_dim, got.num_kv_heads, got.rope_theta) == \
        (want.linear_layers, want.partial_rotary_factor, want.head_dim, want.num_kv_heads, want.rope_theta)
    assert got.linear_attention == want.linear_attention           # the dense directory: grouped heads again
    original = load_model(str(qwen35[0]), dtype="fp32", progress=False)
    assert lm.tokenizer.encode("the quick brown fox") == original.tokenizer.encode("the quick brown fox")


def test_dense_load_equals_transformers_and_its_directory_loads_in_transformers(qwen35, files):
    """Every transform undone: the same logits as the original; the converted directory (what peers
    such as transformers read, LoadedModel.dense_path) is a Qwen3_5ForCausalLM checkpoint."""
    import transformers
    _, hf = qwen35
    lm = load_model(str(files["F32"]), dtype="fp32", progress=False)
    with torch.no_grad():
        reference = hf(TOKENS).logits[0]
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(lm.dense_path()), dtype=torch.float32)
        assert torch.allclose(reloaded(TOKENS).logits[0], reference, atol=1e-5, rtol=1e-5)
    assert torch.allclose(logits(lm.model), reference, atol=1e-4, rtol=1e-4)


def test_files_own_head_order_equals_transformers(qwen35, files):
    """The tensors as the native load reads them (native_weights: value heads left tiled, the decoder
    told so) in fp32 on plain torch: the same logits as the original."""
    from specdecode.models.gguf import native_weights
    from specdecode.models.loader import build_decoder
    config, weights = native_weights(files["F32"], torch.float32, torch.device("cpu"))
    assert config.linear_attention["tiled"] == 1
    with torch.no_grad():
        reference = qwen35[1](TOKENS).logits[0]
    assert torch.allclose(logits(build_decoder(config, weights)), reference, atol=1e-4, rtol=1e-4)


def test_native_q8_0_runs_on_its_blocks_in_the_files_head_order(qwen35, files):
    """Projections stay Q8_0 blocks (value heads left tiled, as out_proj's columns cannot move): logits
    near the same file's dense load (fp32) and the same argmax almost everywhere; speculative greedy
    decoding identical to plain."""
    from specdecode import LLM
    if fast_linear._load()["lib"] is None:
        pytest.skip("native quantized weights need the native kernels")
    native = LLM(model=str(files["Q8_0"]), method="ngram", adaptive=False, num_speculative_tokens=4, progress=False)
    dense = LLM(model=str(files["Q8_0"]), method="none", dtype="fp32", progress=False)
    model = native.target.model
    assert native.target.weights_kind == "native Q8_0" and model.config.linear_attention["tiled"] == 1
    assert all(hasattr(lin, "weight_q") for ly in model.layers for k in ("inputs", "out", "gate_up", "down", "qkv", "o")
               if k in ly for lin in [ly[k]])
    want, got = logits(dense.target.model), logits(model)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9     # bf16 activations: a near-tie may flip
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox"
    assert native.generate(prompt, params)[0].token_ids == native.generate(prompt, params,
                                                                           num_speculative_tokens=0)[0].token_ids


def test_missing_delta_net_tensor_is_named(qwen35, tmp_path):
    folder, model = qwen35
    path = write_qwen35_gguf(tmp_path / "cut.gguf", model, folder / "tokenizer.json", "<|im_end|>",
                             skip=("blk.1.ssm_a",))
    with pytest.raises(ModelError, match=r"missing tensors: 1 .*blk\.1\.ssm_a"):
        load_model(str(path), dtype="fp32", progress=False)
