"""Gemma 2 and Gemma 3 natively (models/gemma.py). Tiny random models of each family saved by
transformers' own classes, shaped like the real ones: windowed layers interleaved with global ones
(Gemma 2 every other layer, Gemma 3 five of six) with a window of 8 so it matters within the
prompts, a score scale query_pre_attn_scalar != head_dim, Gemma 2's attention and final soft-caps,
Gemma 3's q/k norms and different local / global RoPE bases (linear scaling on the global ones), norm
weights away from zero. Checked: logits against transformers (fp32 and bf16; prefill, decode, verify
blocks, a ragged batch in contiguous and paged caches, tree passes windowed along each path), greedy
output against transformers' generate, greedy speculative output (chain and tree drafters, and
through the transformers adapter) identical to plain decoding, <bos> added and <end_of_turn> a stop
id, GGUF files (llama.cpp's gemma2 / gemma3 names, norms stored with +1) loading natively."""
import json

import pytest
import torch
from conftest import CORPUS, assert_tree_paths_match_chains
from conftest import hf_reference as reference

from specdecode import LLM, SamplingParams
from specdecode.cache.paged import PagedKVCache
from specdecode.fast import decoder as fast_decoder
from specdecode.fast import linear as fast_linear
from specdecode.forward import ForwardBatch
from specdecode.models.config import ModelConfig, ModelError
from specdecode.models.loader import load_model

WINDOW = 8
HEAD_DIM = 16
SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
PAD, EOS, BOS, END_OF_TURN = 0, 1, 2, 4
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                 "else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                 "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "1 2 3 4 5 6 7 8 1 2 3 4 5"]


def make_tokenizer(folder):
    """A byte-level BPE vocabulary with Gemma's special tokens and chat format; tokenizer_config.json
    does not ask for <bos> (the loader adds it for Gemma)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
    return len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])


def make_gemma(folder, arch):
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = make_tokenizer(folder)
    torch.manual_seed(13)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=HEAD_DIM, query_pre_attn_scalar=24, max_position_embeddings=256,
                  rms_norm_eps=1e-6, sliding_window=WINDOW, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    if arch == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**common, num_hidden_layers=4, attn_logit_softcapping=4.0,
                                               final_logit_softcapping=8.0))
    else:
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, num_hidden_layers=6, rope_parameters=rope,
                                                   final_logit_softcapping=None))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:                 # Gemma's norm weights start at 0 (x (1 + 0)): move them
                param.normal_(0.0, 0.3)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(6.0)                # scores large enough for Gemma 2's soft-cap to bend them
        model.model.embed_tokens.weight.mul_(2.0)    # a sharper output distribution: fewer near-ties
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    return request.param, make_gemma(tmp_path_factory.mktemp(request.param), request.param)


def test_config(gemma):
    arch, path = gemma
    cfg = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(cfg)
    assert config.arch == arch and config.sliding_window == WINDOW and config.tie_word_embeddings
    assert config.query_pre_attn_scalar == 24 and config.attention_scale == 24 ** -0.5
    if arch == "gemma2":
        assert config.sliding_layers == (True, False, True, False) and not config.qk_norm
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (4.0, 8.0)
        # the spelling of transformers < 5 (real Gemma 2 checkpoints): the same config
        old = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
        assert ModelConfig.from_hf(dict(old, rope_theta=10000.0, hidden_act="gelu_pytorch_tanh")) == config
    else:
        assert config.sliding_layers == (True,) * 5 + (False,) and config.qk_norm
        assert (config.rope_theta, config.rope_local_theta, config.rope_scaling) == (1e6, 1e4, {"rope_type": "linear",
                                                                                              "factor": 2.0})
        assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None
        # the spelling of transformers < 5 (real Gemma 3 checkpoints): the same config
        old = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
        old.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6,
                   rope_scaling={"rope_type": "linear", "factor": 2.0})
        assert ModelConfig.from_hf(old) == config
    assert ModelConfig.from_hf(config.to_hf()) == config          # the GGUF cache's config.json
    with pytest.raises(ModelError, match="hidden_activation"):
        ModelConfig.from_hf(dict(cfg, hidden_activation="relu"))
    with pytest.raises(ModelError, match="layer_types"):
        ModelConfig.from_hf(dict(cfg, layer_types=["chunked_attention"] * config.num_layers))


def check_logits(model, ref, tokens, tol):
    """Prefill longer than the window, decode, a verify block, then a ragged batch (per-row starts
    and cache rows) in a contiguous cache and in paged caches with blocks smaller than, equal to and
    not dividing the window."""
    expected = ref(tokens).logits                                          # [1, 40, vocab]
    cache = model.new_cache(1, 64)
    torch.testing.assert_close(model.forward(tokens[:, :20], cache, 0), expected[:, :20], atol=tol, rtol=tol)
    for pos in range(20, 23):
        torch.testing.assert_close(model.forward(tokens[:, pos:pos + 1], cache, pos)[:, 0], expected[:, pos],
                                   atol=tol, rtol=tol)
    torch.testing.assert_close(model.forward(tokens[:, 23:30], cache, 23), expected[:, 23:30], atol=tol, rtol=tol)
    c = model.config
    caches = [model.new_cache(3, 64)] + [
        PagedKVCache(c.num_layers, 3, c.num_kv_heads, c.head_dim, 64, 40, size, model.dtype) for size in (4, 8, 5)]
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


def skip_unsupported(dtype, fast=True):
    if fast and dtype == "bf16" and not fast_linear._load().get("bf16"):
        pytest.skip("no avx512_bf16")


def load(path, dtype, fast=True):
    lm = load_model(str(path), dtype=dtype, progress=False, fast=fast)
    assert lm.native and lm.model.config.is_gemma
    if fast and fast_linear._load()["lib"] is not None:           # the fused decoder takes Gemma
        assert lm.model.fused is not None and fast_decoder.why_not(lm.model) is None
    return lm.model


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_logits_match_transformers(gemma, fast, dtype):
    skip_unsupported(dtype, fast)
    arch, path = gemma
    model = load(path, dtype, fast)
    ref = reference(path)
    tokens = torch.randint(3, model.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    if dtype == "fp32" and not fast:          # the window and Gemma 2's attention soft-cap change these logits
        expected = ref(tokens).logits
        ref.config.sliding_window = 1000
        assert not torch.allclose(ref(tokens).logits[:, 20:], expected[:, 20:], atol=1e-2)
        ref.config.sliding_window = WINDOW
        if arch == "gemma2":
            for layer in ref.model.layers:
                layer.self_attn.attn_logit_softcapping = None
            assert not torch.allclose(ref(tokens).logits, expected, atol=1e-2)
            ref = reference(path)
    check_logits(model, ref, tokens, 1e-4 if dtype == "fp32" else 1e-1)


@pytest.mark.parametrize("fast", [False, True])
def test_tree_pass_windows_each_path(gemma, fast):
    """A tree node sees the last W keys along its own path on the windowed layers and its whole path
    on the global ones: its logits equal those of the same path run as a chain."""
    _, path = gemma
    assert_tree_paths_match_chains(load(path, "fp32", fast), reference(path), low=3)


def test_greedy_matches_generate_bos_and_stop_ids(gemma):
    """<end_of_turn> stops a generation (listed in generation_config.json or not); <bos> starts
    plain prompts, and chat prompts once (the template writes it)."""
    _, path = gemma
    for listed in (True, False):
        if listed:
            (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, END_OF_TURN]}))
        llm = LLM(model=str(path), method="ngram", dtype="fp32", progress=False, adaptive=False)
        (path / "generation_config.json").unlink(missing_ok=True)
        assert {EOS, END_OF_TURN} <= set(llm.target.eos_token_ids)
    ids = llm.encode(PROMPTS[0], chat=False)
    assert ids[0] == BOS and BOS not in ids[1:]
    chat = llm.encode("hello", chat=True)                            # the template writes <bos> once
    assert chat[0] == BOS and chat.count(BOS) == 1 and llm.tokenizer.decode(chat, skip_special=False).endswith(
        "<start_of_turn>model\n")
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=64, ignore_eos=True), num_speculative_tokens=0)[0]
    assert out.prompt_token_ids == ids and len(ids) > WINDOW
    prompt = torch.tensor([ids])
    expected = reference(path).generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert out.token_ids == expected[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_rows_are_batch_invariant(gemma, dtype):
    """In the fused decoder a row's results do not depend on the rest of the pass: row t of a verify
    block equals decoding its tokens one at a time, a ragged batch's rows (contiguous and paged caches)
    equal each sequence run alone, and a tree node equals its path verified as a chain, bitwise."""
    from specdecode.cache.contiguous import KVCache
    skip_unsupported(dtype)
    _, path = gemma
    model = load(path, dtype)
    if model.fused is None:
        pytest.skip("no native kernels")
    c, none = model.config, torch.zeros(1, 0, dtype=torch.long)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, model.vocab_size, (n,), generator=gen) for n in (37, 21, 12)]
    refs = []
    for p in prompts:                          # alone: prefill, a 6-token block, the same one by one
        a, b = model.new_cache(1, 96), model.new_cache(1, 96)
        for cache in (a, b):
            model.forward(p[None, :-6], cache, 0, logit_index=none)
        block = model.forward(p[None, -6:], a, len(p) - 6)                        # [1, 6, vocab]
        for t in range(6):
            pos = len(p) - 6 + t
            assert torch.equal(model.forward(p[None, pos:pos + 1], b, pos)[0, 0], block[0, t])
        refs.append(block[0])
    blocks, starts = torch.stack([p[-6:] for p in prompts]), torch.tensor([len(p) - 6 for p in prompts])
    caches = [KVCache(c.num_layers, 3, c.num_kv_heads, c.head_dim, 96, model.dtype)]
    caches += [PagedKVCache(c.num_layers, 4, c.num_kv_heads, c.head_dim, 96, 80, size, model.dtype) for size in (16, 5)]
    for cache in caches:
        rows = torch.tensor([3, 1, 2]) if isinstance(cache, PagedKVCache) else torch.tensor([2, 0, 1])
        for r, p in zip(rows.tolist(), prompts):
            if isinstance(cache, PagedKVCache):
                cache.reserve(r, 60)
            model.forward(p[None, :-6], cache, torch.tensor([0]), rows=torch.tensor([r]), logit_index=none)
        got = model.forward(blocks, cache, starts, rows=rows)
        for i, ref in enumerate(refs):
            assert torch.equal(got[i], ref), (type(cache).__name__, i)
    prompt, nodes = prompts[0][None, :12], prompts[1][None, :5]
    parents = torch.tensor([[-1, 0, 1, -1, 3]])
    cache = model.new_cache(1, 64)
    model.forward(prompt[:, :11], cache, 0, logit_index=none)
    fb = ForwardBatch.tree(torch.cat([prompt[:, 11:], nodes], 1), torch.tensor([11]), None, [1], parents)
    tree = model.logits(model.run(fb, cache))[0]
    for branch, index in (([0, 1, 2], [1, 2, 3]), ([3, 4], [4, 5])):
        chain = model.new_cache(1, 64)
        model.forward(prompt[:, :11], chain, 0, logit_index=none)
        expected = model.forward(torch.cat([prompt[:, 11:], nodes[:, branch]], 1), chain, 11)[0]
        assert torch.equal(tree[[0] + index], expected)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["ngram", "suffix", "recycle"])
def test_greedy_speculation_equals_plain(gemma, dtype, method):
    skip_unsupported(dtype)
    _, path = gemma
    llm = LLM(model=str(path), method=method, dtype=dtype, progress=False, adaptive=False, num_speculative_tokens=8)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    spec = llm.generate(PROMPTS, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]


def test_adapter_matches_native(gemma, monkeypatch):
    """The same model through the transformers adapter (as if not native): speculative = plain = native."""
    _, path = gemma
    native = LLM(model=str(path), method="ngram", dtype="fp32", progress=False, adaptive=False)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    out = native.generate(PROMPTS[1], params, num_speculative_tokens=0)[0]
    prompt, expected = [out.prompt_token_ids], out.token_ids       # with <bos>

    def not_native(cfg):
        raise ModelError("forced through the adapter")
    monkeypatch.setattr(ModelConfig, "from_hf", staticmethod(not_native))
    llm = LLM(model=str(path), method="ngram", dtype="fp32", progress=False, adaptive=False, num_speculative_tokens=4)
    assert not llm.target.native
    assert llm.generate(prompt, params)[0].token_ids == expected
    assert llm.generate(prompt, params, num_speculative_tokens=0)[0].token_ids == expected


@pytest.mark.parametrize("weights", ["dense", "native"])
def test_gguf_loads_natively(gemma, tmp_path, monkeypatch, weights):
    """llama.cpp's layout: ffn_norm is the pre-feedforward norm, post_attention_norm / post_ffw_norm the
    others, every norm weight stored with +1; the score scale follows llama.cpp's rule (head_dim**-0.5,
    so the reference is set to it), the local RoPE base its default (10000)."""
    from gguf_writer import write_gguf
    arch, path = gemma
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    if weights == "native" and fast_linear._load()["lib"] is None:
        pytest.skip("native quantized weights need the native kernels")
    ref = reference(path)
    for layer in ref.model.layers:
        layer.self_attn.scaling = HEAD_DIM ** -0.5
    if arch == "gemma2":         # (the window, head_dim etc. come from transformers' GGUF key table)
        metadata = {"gemma2.attn_logit_softcapping": 4.0, "gemma2.final_logit_softcapping": 8.0}
    else:
        metadata = {"gemma3.rope.freq_base": 1e6, "gemma3.rope.scaling.type": "linear",
                    "gemma3.rope.scaling.factor": 2.0}
    gguf = write_gguf(tmp_path / f"{arch}.gguf", ref, arch, path / "tokenizer.json", "<eos>", bos_token="<bos>",
                      metadata=metadata, norm_shift=1.0)
    lm = load_model(str(gguf), dtype="fp32" if weights == "dense" else None, progress=False, weights=weights)
    config = lm.model.config
    assert lm.native and config.arch == arch and config.sliding_window == WINDOW
    assert config.sliding_layers == ModelConfig.from_hf(json.loads((path / "config.json").read_text())).sliding_layers
    assert END_OF_TURN in lm.eos_token_ids and lm.tokenizer.encode("the fox")[0] == BOS
    tokens = torch.randint(3, lm.model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    tol = 1e-4 if weights == "dense" else 1e-1
    torch.testing.assert_close(lm.model.forward(tokens, lm.model.new_cache(1, 32), 0), ref(tokens).logits,
                               atol=tol, rtol=tol)


def test_quantized_projections_in_the_fused_decoder(gemma):
    """dtype int8 (every projection quantized per channel, QuantLinear in the fused decoder): logits
    near the dense model's, greedy speculative output identical to plain decoding."""
    _, path = gemma
    if fast_linear._load()["lib"] is None:
        pytest.skip("quantized weights need the native kernels")
    llm = LLM(model=str(path), method="suffix", dtype="int8", progress=False, adaptive=False, num_speculative_tokens=8)
    model = llm.target.model
    assert model.quantized and model.fused is not None
    tokens = torch.randint(3, model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(5))
    expected = reference(path)(tokens).logits
    got = model.forward(tokens, model.new_cache(1, 32), 0)
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    assert [s.token_ids for s in llm.generate(PROMPTS, params)] == [p.token_ids for p in plain]
