"""Gemma 4 with MoE blocks natively (models/gemma4.py, models/moe.py's "gemma4" router): a tiny random
gemma4_text with `enable_moe_block` (26B-A4B's layout in small: 8 experts, 2 routed, beside every
layer's dense MLP; k_eq_v global layers) saved by transformers. Logits against transformers (prefill,
decode, a verify block, a ragged batch in contiguous and paged caches, a tree pass), greedy
continuations identical to transformers' plain and with the default drafter, bf16 batched and
speculative rows equal to batch-1 plain decoding, the native decoder (not the adapter) chosen, and
clear errors for MoE settings it cannot run. The same model as llama.cpp's converter writes it (gemma4
GGUF, F32 and Q8_0) loads natively: logits and greedy output as the directory's, the expert stacks
read in place from the file."""
import json

import conftest
import pytest
import torch
from conftest import (
    GEMMA4_BOS,
    assert_tree_paths_match_chains,
    compare_samples,
    hf_reference,
    make_gemma4_moe,
    null_tv,
)
from gguf_writer import write_gemma4_gguf

from specdecode import LLM, SamplingParams
from specdecode.cache.paged import PagedKVCache
from specdecode.forward import ForwardBatch
from specdecode.models.config import ModelConfig, ModelError
from specdecode.models.gemma4 import Gemma4Transformer
from specdecode.models.loader import load_model
from specdecode.sampling import probs_from_logits, transform_logits

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "1 2 3 4 5 6 7 8 1 2 3 4 5"]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory):
    return make_gemma4_moe(tmp_path_factory.mktemp("gemma4_moe"))


def load(path, fast=False, dtype="fp32") -> Gemma4Transformer:
    lm = load_model(str(path), dtype=dtype, progress=False, fast=fast)
    assert lm.native and type(lm.model) is Gemma4Transformer          # not the transformers adapter
    return lm.model


def test_config_and_its_errors(gemma4_moe):
    cfg = json.loads((gemma4_moe / "config.json").read_text())
    config = ModelConfig.from_hf(cfg)
    assert config.moe == {"experts": 8, "used": 2, "intermediate": 32, "norm_topk": True, "router": "gemma4",
                          "activation": "gelu_tanh"}
    assert config.moe_layers == (True,) * 5 and config.intermediate_size == 96 and config.k_eq_v
    wrapper = {"model_type": "gemma4", "text_config": cfg, "tie_word_embeddings": True}
    assert ModelConfig.from_hf(wrapper) == config
    dense = ModelConfig.from_hf(dict(cfg, enable_moe_block=False))
    # per token: the router, its scales, three norms and 2 of the 8 experts (3 matrices of 64 x 32 each)
    assert config.weight_count() - dense.weight_count() == 5 * (8 * 65 + 4 * 64 + 2 * 3 * 64 * 32)
    for bad, match in ((dict(num_experts=None), "num_experts"), (dict(top_k_experts=0), "top_k_experts"),
                       (dict(top_k_experts=9), "num_experts_per_tok must be in"),
                       (dict(moe_intermediate_size=None), "moe_intermediate_size")):
        with pytest.raises(ModelError, match=match):
            ModelConfig.from_hf(dict(cfg, **bad))


def check_logits(model, ref, tokens, tol):
    """Prefill longer than the window, decode steps, a verify block, then a ragged batch (per-row
    starts and cache rows) in a contiguous cache and paged caches."""
    with torch.no_grad():
        expected = ref(tokens).logits                                          # [1, 36, vocab]
    cache = model.new_cache(1, 64)
    torch.testing.assert_close(model.forward(tokens[:, :20], cache, 0), expected[:, :20], atol=tol, rtol=tol)
    for pos in range(20, 23):
        torch.testing.assert_close(model.forward(tokens[:, pos:pos + 1], cache, pos)[:, 0], expected[:, pos],
                                   atol=tol, rtol=tol)
    torch.testing.assert_close(model.forward(tokens[:, 23:30], cache, 23), expected[:, 23:30], atol=tol, rtol=tol)
    layers, heads, dims = model.config.kv_geometry()
    rows = torch.tensor([2, 0])
    for cache in [model.new_cache(3, 64)] + [PagedKVCache(layers, 3, heads, dims, 64, 40, s, model.dtype)
                                              for s in (4, 5)]:
        for r, n in zip(rows.tolist(), (30, 26)):
            if isinstance(cache, PagedKVCache):
                cache.reserve(r, 40)
            model.forward(tokens[:, :n], cache, torch.tensor([0]), rows=torch.tensor([r]))
        fb = ForwardBatch.chain(torch.cat([tokens[:, 30:36], tokens[:, 26:32]]), torch.tensor([30, 26]), rows)
        got = model.logits(model.run(fb, cache))
        torch.testing.assert_close(got[0], expected[0, 30:36], atol=tol, rtol=tol)
        torch.testing.assert_close(got[1], expected[0, 26:32], atol=tol, rtol=tol)


@pytest.mark.parametrize("fast", [False, True])
def test_logits_match_transformers(gemma4_moe, fast):
    model = load(gemma4_moe, fast)
    assert all("router" in ly and len(ly["experts_gate_up"]) == 8 for ly in model.layers)
    tokens = torch.randint(3, model.vocab_size, (1, 36), generator=torch.Generator().manual_seed(0))
    check_logits(model, hf_reference(gemma4_moe), tokens, 1e-4)


def test_tree_pass(gemma4_moe):
    assert_tree_paths_match_chains(load(gemma4_moe, True), hf_reference(gemma4_moe), low=3)


def test_experts_and_their_scales_matter(gemma4_moe):
    """The test model's MoE blocks decide its logits (so the tests above could fail): routing every row
    to the same experts, or leaving out the per-expert scales, changes them."""
    model = load(gemma4_moe)
    tokens = torch.randint(3, model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    base = model.forward(tokens, model.new_cache(1, 16), 0)
    scales = [ly["expert_scale"] for ly in model.layers]
    for layer in model.layers:
        layer["expert_scale"] = torch.ones_like(layer["expert_scale"])
    assert (model.forward(tokens, model.new_cache(1, 16), 0) - base).abs().max() > 0.05
    for layer, scale in zip(model.layers, scales):
        layer["expert_scale"] = scale
        router = layer["router"]
        layer["router"] = lambda x, router=router: router(x) * 0 + torch.arange(8, dtype=x.dtype)
    assert (model.forward(tokens, model.new_cache(1, 16), 0) - base).abs().max() > 0.05


def test_greedy_identical_to_transformers_plain_and_speculative(gemma4_moe):
    llm = LLM(model=str(gemma4_moe), dtype="fp32", progress=False)
    assert llm.method == "ngram" and llm.target.native and type(llm.target.model) is Gemma4Transformer
    ref = hf_reference(gemma4_moe)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for prompt in PROMPTS:
        ids = llm.encode(prompt, False)
        assert ids[0] == GEMMA4_BOS
        with torch.no_grad():
            expected = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                    do_sample=False)[0, len(ids):].tolist()
        assert llm.generate(prompt, params, num_speculative_tokens=0)[0].token_ids == expected
        assert llm.generate(prompt, params, num_speculative_tokens=4)[0].token_ids == expected


@pytest.mark.parametrize("gguf", [False, True])
def test_bf16_batched_and_speculative_equal_plain(gemma4_moe, moe_gguf, gguf):
    """bf16 (the default), from the directory and from the Q8_0 file read in place: a verify block's rows
    bitwise equal to single steps (each query attends alone, each expert runs on the rows routed to it),
    and through the engine (paged cache, verify passes of k + 1 rows, several requests in one batch)
    the same tokens as plain decoding one request at a time."""
    source = str(moe_gguf["Q8_0"] if gguf else gemma4_moe)
    model = load_model(source, progress=False).model
    assert model.dtype == torch.bfloat16 and type(model) is Gemma4Transformer
    tokens = torch.randint(3, model.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(1, 32)
    model.forward(tokens[:, :14], cache, 0)
    block = model.forward(tokens[:, 14:20], cache, 14)
    steps = [model.forward(tokens[:, p:p + 1], cache, p)[:, 0] for p in range(14, 20)]
    assert torch.equal(block[0], torch.cat(steps))
    llm = LLM(model=source, progress=False, adaptive=False)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    alone = [llm.generate(p, params, num_speculative_tokens=0)[0].token_ids for p in PROMPTS]
    for k in (0, 3, 6):
        assert [o.token_ids for o in llm.generate(PROMPTS, params, num_speculative_tokens=k)] == alone, k


def test_seeded_sampling_keeps_the_target_distribution(gemma4_moe):
    """Speculative sampling (temperature 0.8, top_k 2, ngram drafts of 2) on the MoE model draws its
    first three tokens from transformers' exact distribution: chi-square p > 1e-3, total variation
    within 0.01 * sqrt(10^5 / n)."""
    ref = hf_reference(gemma4_moe)
    llm = LLM(model=str(gemma4_moe), dtype="fp32", progress=False, adaptive=False)
    prompt = llm.encode("1 2 3 1 2 3 1 2", False)
    params = lambda seed=None: SamplingParams(temperature=0.8, top_k=2, max_tokens=3, ignore_eos=True,  # noqa: E731
                                              seed=seed)

    @torch.no_grad()
    def next_probs(prefix):
        logits = ref(torch.tensor([prompt + prefix])).logits[:, -1:].float()
        return probs_from_logits(transform_logits(logits, [params()]), [params()])[0, 0].double()
    exact = conftest.exact_joint(next_probs, 3)
    n = 4_000
    bound = 0.01 * (100_000 / n) ** 0.5
    assert len(exact) == 8 and abs(sum(exact.values()) - 1) < 1e-4
    assert null_tv(exact, n) < 0.7 * bound
    counts, _ = conftest.draw_samples(llm, prompt, params, n, 2, seed0=4_000_000)
    p_value, tv, outside = compare_samples(counts, exact)
    assert outside == 0
    assert p_value > 1e-3 and tv < bound, (p_value, tv)


@pytest.fixture(scope="module")
def moe_gguf(gemma4_moe, tmp_path_factory):
    """The model as F32 and Q8_0 gemma4 GGUF files, as llama.cpp's converter writes them."""
    folder, ref = tmp_path_factory.mktemp("gemma4_moe_gguf"), hf_reference(gemma4_moe)
    return {q: write_gemma4_gguf(folder / f"tiny-gemma4-moe-{q.lower()}.gguf", ref, gemma4_moe / "tokenizer.json",
                                 "<|im_end|>", "<bos>", qtype=q) for q in ("F32", "Q8_0")}


def test_gguf_config_and_logits_match_the_directory(gemma4_moe, moe_gguf):
    """The file's metadata reads back to the directory's config (head shapes per layer type, k_eq_v from
    the missing attn_v, proportional RoPE from rope_freqs, the MoE keys); its logits are transformers'."""
    lm = load_model(str(moe_gguf["F32"]), dtype="fp32", progress=False)
    assert lm.native and type(lm.model) is Gemma4Transformer
    expected = ModelConfig.from_hf(json.loads((gemma4_moe / "config.json").read_text()))
    got = lm.model.config
    assert got.moe == expected.moe and got.kv_geometry() == expected.kv_geometry()
    assert (got.k_eq_v, got.rope_scaling, got.sliding_layers, got.final_logit_softcapping) == (
        expected.k_eq_v, expected.rope_scaling, expected.sliding_layers, expected.final_logit_softcapping)
    assert ModelConfig.from_hf(got.to_hf()) == got
    tokens = torch.randint(3, got.vocab_size, (1, 36), generator=torch.Generator().manual_seed(4))
    check_logits(lm.model, hf_reference(gemma4_moe), tokens, 1e-4)


def test_gguf_greedy_identical_to_the_directory(gemma4_moe, moe_gguf):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    directory = LLM(model=str(gemma4_moe), dtype="fp32", progress=False)
    llm = LLM(model=str(moe_gguf["F32"]), dtype="fp32", progress=False)
    assert llm.target.native and type(llm.target.model) is Gemma4Transformer
    for prompt in PROMPTS:
        ids = directory.encode(prompt, False)
        expected = directory.generate([ids], params, num_speculative_tokens=0)[0].token_ids
        assert llm.generate([ids], params, num_speculative_tokens=0)[0].token_ids == expected
        assert llm.generate([ids], params, num_speculative_tokens=4)[0].token_ids == expected


def test_gguf_q8_0_expert_stacks_read_in_place(gemma4_moe, moe_gguf):
    """Q8_0: each expert's gate|up rows a view of the mapped file's stack (expert 1's rows follow expert
    0's), as the checkpoint's matrix to Q8_0's rounding; the per-expert and router scales as stored."""
    lm = load_model(str(moe_gguf["Q8_0"]), progress=False)
    assert lm.native and lm.weights_kind == "native Q8_0"
    ref = hf_reference(gemma4_moe).model.layers[1]
    layer = lm.model.layers[1]
    first, second = (layer["experts_gate_up"][e].weight_q for e in (0, 1))
    rows = first.segments[0][1]
    assert first.mapped and rows.data_ptr() + rows.shape[0] * rows.shape[1] == second.segments[0][1].data_ptr()
    torch.testing.assert_close(layer["experts_gate_up"][3].weight_q.dequantize(), ref.experts.gate_up_proj[3],
                               atol=0.002, rtol=0)
    torch.testing.assert_close(layer["expert_scale"].float(), ref.router.per_expert_scale, atol=0.01, rtol=0.01)
    torch.testing.assert_close(layer["router_scale"].float(), ref.router.scale, atol=0.02, rtol=0.01)
    llm = LLM(model=str(moe_gguf["Q8_0"]), progress=False)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 8


def test_gguf_missing_tensor_is_one_error(gemma4_moe, tmp_path):
    """A gemma4 file without a layer's per-expert scales (or router scale) is refused, naming them."""
    ref = hf_reference(gemma4_moe)
    for name in ("blk.1.ffn_down_exps.scale", "blk.3.ffn_gate_inp.scale"):
        path = write_gemma4_gguf(tmp_path / f"missing-{name}.gguf", ref, gemma4_moe / "tokenizer.json", "<|im_end|>",
                                 "<bos>", skip=(name,))
        with pytest.raises(ModelError, match=rf"missing tensors: 1 of the gemma4 model's .*{name}"):
            load_model(str(path), progress=False)


def test_the_released_26b_a4b_config():
    """Gemma 4 26B-A4B's text_config (the values scripts/measure/make_random_gguf.py cites) reads natively,
    and the parameters it reads per token are the 3.8 B its model card calls active (25.2 B in all)."""
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 5
    text = {"model_type": "gemma4_text", "attention_k_eq_v": True, "enable_moe_block": True, "num_experts": 128,
            "top_k_experts": 8, "moe_intermediate_size": 704, "intermediate_size": 2112, "hidden_size": 2816,
            "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
            "num_global_key_value_heads": 2, "global_head_dim": 512, "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0, "layer_types": types, "sliding_window": 1024, "vocab_size": 262144,
            "final_logit_softcapping": 30.0, "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}}
    config = ModelConfig.from_hf({"model_type": "gemma4", "text_config": text, "tie_word_embeddings": True})
    assert config.kv_geometry()[1:] == (((8,) * 5 + (2,)) * 5, ((256,) * 5 + (512,)) * 5)
    assert round(config.weight_count() / 1e9, 1) == 3.8
    unrouted = 30 * (128 - 8) * 3 * 2816 * 704                   # the experts a token does not read
    assert round((config.weight_count() + unrouted) / 1e9, 1) == 25.2


def test_layer_skip_drafts_on_the_moe_model(gemma4_moe):
    """Self-drafting with two layers (and their MoE blocks) left out gives plain decoding's tokens (bf16)."""
    llm = LLM(model=str(gemma4_moe), method="layer-skip", skip_layers=[1, 3], progress=False, adaptive=False,
              num_speculative_tokens=4)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    spec = llm.generate(PROMPTS, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats["drafted_tokens"] for s in spec) > 0
