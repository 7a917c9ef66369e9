"""Gemma 4 natively (models/gemma4.py). Tiny random gemma4_text models saved by transformers' own
classes, shaped like E2B: windowed layers (window 8, so it matters within the prompts) and global
ones with twice as wide heads and proportional RoPE, per-layer inputs, the last two layers reusing
the keys/values of the last earlier layer of their type (one windowed, one global; the first
windowed layer is not the one they read), double-wide MLPs on those, a final soft-cap, norm weights
and layer scalars away from 1; a second variant has k_eq_v global layers with one kv head. Checked
against transformers: logits (prefill, decode, verify block, a ragged batch in contiguous and paged
caches, tree passes), greedy output against generate, speculative output (n-gram and a smaller
Gemma 4 draft) identical to plain decoding, the multimodal wrapper's text model loading natively."""
import json

import pytest
import torch
from conftest import (
    GEMMA4_BOS,
    GEMMA4_EOS,
    GEMMA4_TYPES,
    GEMMA4_WINDOW,
    assert_tree_paths_match_chains,
    gemma4_text_config,
    make_gemma4,
)
from conftest import (
    hf_reference as reference,
)

from specdecode import LLM, SamplingParams
from specdecode.cache.paged import PagedKVCache
from specdecode.forward import ForwardBatch
from specdecode.models.config import ModelConfig, ModelError
from specdecode.models.gemma4 import Gemma4Transformer
from specdecode.models.loader import load_model

WINDOW, TYPES, BOS, EOS = GEMMA4_WINDOW, GEMMA4_TYPES, GEMMA4_BOS, GEMMA4_EOS
END_OF_TURN = 4                           # make_tokenizer's ids: <bos> is 3, then <turn|>
PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "1 2 3 4 5 6 7 8 1 2 3 4 5"]


@pytest.fixture(scope="module", params=["e2b", "k_eq_v"])
def gemma4(request, tmp_path_factory):
    return request.param, make_gemma4(tmp_path_factory.mktemp(request.param), request.param)


def test_config(gemma4):
    variant, path = gemma4
    cfg = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(cfg)
    assert config.arch == "gemma4" and config.sliding_window == WINDOW and config.tie_word_embeddings
    assert config.sliding_layers == tuple(t == "sliding_attention" for t in TYPES) and config.attention_scale == 1.0
    assert (config.head_dim, config.global_head_dim, config.kv_shared_layers) == (16, 32, 2)
    assert config.global_kv_heads == (1 if variant == "k_eq_v" else 2) and config.k_eq_v == (variant == "k_eq_v")
    assert config.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 1.0}
    # the cache keeps layers 0..2 only: two windowed ones with 16-wide heads, the global one 32 wide
    assert config.kv_geometry() == (3, 2 if variant == "e2b" else (2, 2, 1), (16, 16, 32))
    # checkpoints spell the global head shape as global_head_dim / num_global_key_value_heads
    old = {k: v for k, v in cfg.items() if k != "per_layer_config"}
    old.update(global_head_dim=32, num_global_key_value_heads=1 if variant == "k_eq_v" else None)
    assert ModelConfig.from_hf(old) == config
    wrapper = {"model_type": "gemma4", "text_config": cfg, "tie_word_embeddings": True}
    assert ModelConfig.from_hf(wrapper) == config
    for bad, match in ((dict(enable_moe_block=True), "enable_moe_block"), (dict(hidden_activation="relu"),
                       "hidden_activation"), (dict(num_kv_shared_layers=5), "num_kv_shared_layers"),
                       (dict(layer_types=["chunked_attention"] * 5), "layer_types"),
                       (dict(per_layer_config={"2": {"sliding_window": 4}}), "per_layer_config")):
        with pytest.raises(ModelError, match=match):
            ModelConfig.from_hf(dict(cfg, **bad))
    with pytest.raises(ModelError, match="makes the keys"):    # shared global layers, no global layer before
        ModelConfig.from_hf(dict(old, layer_types=TYPES[:2] + ["sliding_attention"] + TYPES[3:]))


def load(path, fast=False, dtype="fp32"):
    lm = load_model(str(path), dtype=dtype, progress=False, fast=fast)
    assert lm.native and isinstance(lm.model, Gemma4Transformer)
    return lm.model


def check_logits(model, ref, tokens, tol):
    """Prefill longer than the window, decode, a verify block, then a ragged batch (per-row starts
    and cache rows) in a contiguous cache and in paged caches with blocks smaller than, equal to and
    not dividing the window."""
    with torch.no_grad():
        expected = ref(tokens).logits                                          # [1, 40, vocab]
    cache = model.new_cache(1, 64)
    assert len(cache.keys) == 3 and cache.keys[2].shape[-1] == 32               # no cache for shared layers
    torch.testing.assert_close(model.forward(tokens[:, :20], cache, 0), expected[:, :20], atol=tol, rtol=tol)
    for pos in range(20, 23):
        torch.testing.assert_close(model.forward(tokens[:, pos:pos + 1], cache, pos)[:, 0], expected[:, pos],
                                   atol=tol, rtol=tol)
    torch.testing.assert_close(model.forward(tokens[:, 23:30], cache, 23), expected[:, 23:30], atol=tol, rtol=tol)
    layers, heads, dims = model.config.kv_geometry()
    caches = [model.new_cache(3, 64)] + [
        PagedKVCache(layers, 3, heads, dims, 64, 40, size, model.dtype) for size in (4, 8, 5)]
    rows = torch.tensor([2, 0])
    for cache in caches:
        for r, n in zip(rows.tolist(), (30, 26)):
            if isinstance(cache, PagedKVCache):
                cache.reserve(r, 40)
            model.forward(tokens[:, :n], cache, torch.tensor([0]), rows=torch.tensor([r]))
        fb = ForwardBatch.chain(torch.cat([tokens[:, 30:36], tokens[:, 26:32]]), torch.tensor([30, 26]), rows)
        got = model.logits(model.run(fb, cache))
        torch.testing.assert_close(got[0], expected[0, 30:36], atol=tol, rtol=tol)
        torch.testing.assert_close(got[1], expected[0, 26:32], atol=tol, rtol=tol)


@pytest.mark.parametrize("fast", [False, True])
def test_logits_match_transformers(gemma4, fast):
    _, path = gemma4
    model = load(path, fast)
    ref = reference(path)
    tokens = torch.randint(3, model.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    if not fast:     # the window and the kv sharing change these logits, so the comparison sees them
        with torch.no_grad():
            expected = ref(tokens).logits
            ref.config.sliding_window = 1000
            assert not torch.allclose(ref(tokens).logits[:, 20:], expected[:, 20:], atol=1e-2)
            ref.config.sliding_window = WINDOW
            ref.model.layers[3].self_attn.layer_type = "full_attention"     # reads the global layer's keys
            with pytest.raises(RuntimeError):    # ... of another width: the reuse is real
                ref(tokens)
            ref = reference(path)
    check_logits(model, ref, tokens, 1e-4)


@pytest.mark.parametrize("fast", [False, True])
def test_tree_pass_windows_each_path(gemma4, fast):
    _, path = gemma4
    assert_tree_paths_match_chains(load(path, fast), reference(path), low=3)


def test_greedy_matches_generate_bos_and_stop_ids(gemma4):
    """<bos> starts plain prompts and <turn|> (Gemma 4's end of turn) is a stop id; greedy output is
    transformers' generate's."""
    _, path = gemma4
    llm = LLM(model=str(path), method="ngram", dtype="fp32", progress=False, adaptive=False)
    assert llm.target.native and isinstance(llm.target.model, Gemma4Transformer)
    assert {EOS, END_OF_TURN} <= set(llm.target.eos_token_ids)
    ids = llm.encode(PROMPTS[0], chat=False)
    assert ids[0] == BOS and BOS not in ids[1:] and len(ids) > WINDOW
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=48, ignore_eos=True), num_speculative_tokens=0)[0]
    prompt = torch.tensor([ids])
    expected = reference(path).generate(prompt, max_new_tokens=48, min_new_tokens=48, do_sample=False)
    assert out.token_ids == expected[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("drafter", ["ngram", "draft", "layer-skip"])
def test_greedy_speculation_equals_plain(gemma4, tmp_path, drafter):
    """Chain (n-gram) and draft-model speculation (a smaller Gemma 4 drafting), and layer skipping
    (a skipped producing layer takes its shared layers with it), give plain decoding's output; the
    engine's paged cache has the model's mixed head shapes."""
    variant, path = gemma4
    draft = str(make_gemma4(tmp_path / "draft", variant, layers=2, seed=5)) if drafter == "draft" else None
    options = {"skip_layers": [1]} if drafter == "layer-skip" else {}
    llm = LLM(model=str(path), draft=draft, method=None if draft else drafter, dtype="fp32",
              progress=False, adaptive=False, num_speculative_tokens=4, **options)
    if draft is not None:
        assert isinstance(llm.draft.model, Gemma4Transformer)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    assert [s.token_ids for s in llm.generate(PROMPTS, params)] == [p.token_ids for p in plain]


def test_multimodal_wrapper_loads_its_text_model(tmp_path):
    """A gemma4 checkpoint (Gemma4ForConditionalGeneration: model.language_model.* weights) loads
    natively with the text model's logits."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    path = make_gemma4(tmp_path / "text")
    text = reference(path)
    vocab_size = text.config.vocab_size
    wrapper = Gemma4ForConditionalGeneration(Gemma4Config(text_config=gemma4_text_config(vocab_size, "e2b").to_dict(),
                                                          vision_config=None, audio_config=None))
    wrapper.model.language_model.load_state_dict(text.model.state_dict())
    folder = tmp_path / "wrapper"
    wrapper.save_pretrained(str(folder), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text((path / name).read_text())
    model = load(folder)
    tokens = torch.randint(3, vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = text(tokens).logits
    torch.testing.assert_close(model.forward(tokens, model.new_cache(1, 32), 0), expected, atol=1e-4, rtol=1e-4)


def test_gguf_as_llama_cpp_writes_it_loads_natively(gemma4, tmp_path):
    """The model as llama.cpp's converter writes it (gemma4 GGUF: per-layer input tensors, kv-shared
    layers without k/v, per-layer kv heads and MLP widths in the metadata) loads natively with the
    directory's config and transformers' logits."""
    from gguf_writer import write_gemma4_gguf
    variant, path = gemma4
    ref = reference(path)
    gguf = write_gemma4_gguf(tmp_path / f"tiny-gemma4-{variant}.gguf", ref, path / "tokenizer.json", "<|im_end|>",
                             "<bos>")
    model = load(gguf)
    expected = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert model.config.kv_geometry() == expected.kv_geometry()
    for field in ("per_layer_input_size", "per_layer_vocab_size", "kv_shared_layers", "double_wide_mlp", "k_eq_v",
                  "rope_scaling", "sliding_layers", "intermediate_size"):
        assert getattr(model.config, field) == getattr(expected, field), field
    tokens = torch.randint(3, model.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
    check_logits(model, ref, tokens, 1e-4)


def test_bf16_verify_rows_bitwise_and_speculation_lossless(gemma4):
    """bf16 (the default dtype): each query attends alone over the keys it sees (gemma4.row_attention),
    so a verify block's rows are bitwise single steps, and speculative and batched decoding give plain
    decoding's tokens (one SDPA call over the pass did not: its sums depend on the pass's shape)."""
    _, path = gemma4
    model = load(path, fast=True, dtype="bf16")
    tokens = torch.randint(3, model.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(1, 32)
    model.forward(tokens[:, :14], cache, 0)
    block = model.forward(tokens[:, 14:20], cache, 14)
    assert torch.equal(block[0], torch.cat([model.forward(tokens[:, p:p + 1], cache, p)[:, 0] for p in range(14, 20)]))
    llm = LLM(model=str(path), progress=False, adaptive=False)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    alone = [llm.generate(p, params, num_speculative_tokens=0)[0].token_ids for p in PROMPTS]
    for k in (0, 4):
        assert [o.token_ids for o in llm.generate(PROMPTS, params, num_speculative_tokens=k)] == alone, k
