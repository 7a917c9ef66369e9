"""gpt-oss natively (models/gpt_oss.py, models/moe.py's variants, the fused decoder's sinks and
decoder_moe.c's router and activation): a tiny random gpt_oss saved by transformers. Logits against
transformers, eager and fused, greedy continuations identical to transformers' plain and with the
default drafter, batched and verify rows bitwise equal to batch-1 steps, the sliding window kept across
long generations with rollback, and the native decoder (not the transformers adapter) chosen."""
from __future__ import annotations

import dataclasses

import conftest
import pytest
import torch
from conftest import assert_tree_paths_match_chains, make_gpt_oss
from gguf_writer import write_gpt_oss_gguf

from specdecode import LLM, SamplingParams
from specdecode.cache.paged import PagedKVCache
from specdecode.fast import linear as fast_linear
from specdecode.forward import ForwardBatch
from specdecode.models.gpt_oss import GptOssTransformer
from specdecode.models.loader import load_model
from specdecode.models.transformer import rope_inv_freq

PROMPTS = conftest.QWEN35_PROMPTS
pytestmark = pytest.mark.usefixtures("one_thread")
needs_kernels = pytest.mark.skipif(fast_linear._load()["lib"] is None, reason="no native kernels")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(directory, transformers model) of the tiny gpt-oss (window 6 on layers 0 and 2)."""
    folder = tmp_path_factory.mktemp("gpt_oss")
    return folder, make_gpt_oss(folder)


@pytest.fixture(scope="module")
def gpt_oss_gguf(gpt_oss):
    """The same model as llama.cpp's converter writes it: MXFP4 expert stacks, Q8_0 matrices."""
    folder, hf = gpt_oss
    return write_gpt_oss_gguf(folder.parent / "tiny-gpt-oss-mxfp4.gguf", hf, folder / "tokenizer.json", "<|im_end|>")


def _dequantized_reference(path):
    """transformers' gpt-oss on the file's weights dequantized exactly (the dense conversion, which
    writes gpt_oss's own checkpoint layout back): what the file's rounding leaves of the model."""
    import transformers
    lm = load_model(str(path), dtype="fp32", progress=False, weights="dense", fast=False)
    return lm, transformers.GptOssForCausalLM.from_pretrained(str(lm.path), dtype=torch.float32).eval()


def _check_logits(model, hf, atol: float, length: int = 40) -> None:
    """Prefill, single steps and a block, well past the window, against transformers' logits."""
    tokens = torch.randint(0, model.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
    cache = model.new_cache(1, 64)
    torch.testing.assert_close(model.forward(tokens[:, :16], cache, 0), expected[:, :16], atol=atol, rtol=0)
    for pos in range(16, 19):
        torch.testing.assert_close(model.forward(tokens[:, pos:pos + 1], cache, pos)[:, 0], expected[:, pos],
                                   atol=atol, rtol=0)
    torch.testing.assert_close(model.forward(tokens[:, 19:length], cache, 19), expected[:, 19:length],
                               atol=atol, rtol=0)


@pytest.mark.parametrize("fast", [False, True])
def test_logits_match_transformers(gpt_oss, fast):
    folder, hf = gpt_oss
    lm = load_model(str(folder), dtype="fp32", progress=False, fast=fast)
    assert lm.native and type(lm.model) is GptOssTransformer          # not the transformers adapter
    config = lm.model.config
    assert config.arch == "gpt-oss" and config.sliding_layers == (True, False, True, False)
    assert config.sliding_window == 6 and config.attention_sinks and config.rope_scaling["rope_type"] == "yarn"
    assert config.moe == {"experts": 8, "used": 2, "intermediate": 64, "norm_topk": False, "router": "topk_softmax",
                          "activation": "swiglu_clamp", "alpha": 1.702, "limit": 7.0}
    if fast and fast_linear._load()["lib"] is not None:
        assert lm.model.fused is not None and lm.model.fused.moe_count is not None
    _check_logits(lm.model, hf, 1e-4)


@pytest.mark.parametrize("part", ["sinks", "window", "yarn", "clamp", "router_bias", "expert_bias"])
def test_each_part_matters(gpt_oss, part, tmp_path):
    """Each of gpt-oss's own parts changes the test model's logits (so the comparisons above could fail)."""
    folder, _ = gpt_oss
    model = load_model(str(folder), dtype="fp32", progress=False, fast=False).model
    if part in ("router_bias", "expert_bias"):             # the same checkpoint with those biases zero
        from safetensors.torch import load_file, save_file
        for f in folder.iterdir():
            if f.is_file():
                (tmp_path / f.name).write_bytes(f.read_bytes())
        ends = ("router.bias",) if part == "router_bias" else ("gate_up_proj_bias", "down_proj_bias")
        weights = {k: v * 0 if k.endswith(ends) else v for k, v in load_file(str(folder / "model.safetensors")).items()}
        save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    tokens = torch.randint(0, model.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    base = model.forward(tokens, model.new_cache(1, 32), 0)
    c = model.config
    if part == "sinks":
        model.sinks = [s * 0 - 1e9 for s in model.sinks]
    elif part == "window":
        object.__setattr__(c, "sliding_window", None)
    elif part == "yarn":                                   # plain RoPE's tables instead
        angles = torch.outer(torch.arange(model.rope_cos.shape[0], dtype=torch.float32),
                             rope_inv_freq(dataclasses.replace(c, rope_scaling=None)))
        model.rope_cos, model.rope_sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    elif part == "clamp":
        c.moe["limit"] = 1e9
    else:
        model = load_model(str(tmp_path), dtype="fp32", progress=False, fast=False).model
    assert (model.forward(tokens, model.new_cache(1, 32), 0) - base).abs().max() > 0.05


def test_greedy_identical_to_transformers_plain_and_speculative(gpt_oss):
    folder, hf = gpt_oss
    llm = LLM(model=str(folder), dtype="fp32", progress=False)
    assert llm.method == "ngram" and llm.target.native
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for prompt in PROMPTS:
        ids = llm.encode(prompt, False)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert len(ref) == 24 or ref[-1] == 2                     # transformers stops at the eos token
        for k in (0, 4):
            assert llm.generate(prompt, params, num_speculative_tokens=k)[0].token_ids[:len(ref)] == ref, k


@pytest.mark.parametrize("fast", [False, True])
def test_ragged_batches_and_paged_caches_keep_the_window(gpt_oss, fast):
    """Two requests at different positions in one pass, in a contiguous cache and in paged caches whose
    blocks are smaller than, equal to and not dividing the window: each row's logits as transformers'."""
    folder, hf = gpt_oss
    model = load_model(str(folder), dtype="fp32", progress=False, fast=fast).model
    tokens = torch.randint(0, model.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(tokens).logits
    c = model.config
    caches = [model.new_cache(3, 64)] + [
        PagedKVCache(c.num_layers, 3, c.num_kv_heads, c.head_dim, 64, 40, size, model.dtype) for size in (4, 6, 5)]
    rows = torch.tensor([2, 0])
    for cache in caches:
        for r, n in zip(rows.tolist(), (30, 26)):
            if isinstance(cache, PagedKVCache):
                cache.reserve(r, 40)
            model.forward(tokens[:, :n], cache, torch.tensor([0]), rows=torch.tensor([r]))
        fb = ForwardBatch.chain(torch.cat([tokens[:, 30:36], tokens[:, 26:32]]), torch.tensor([30, 26]), rows)
        got = model.logits(model.run(fb, cache))
        torch.testing.assert_close(got[0], expected[0, 30:36], atol=1e-4, rtol=0)
        torch.testing.assert_close(got[1], expected[0, 26:32], atol=1e-4, rtol=0)


@pytest.mark.parametrize("fast", [False, True])
def test_tree_pass_windows_each_path(gpt_oss, fast):
    """A draft tree's nodes each see the last keys of their own path, sinks included."""
    folder, hf = gpt_oss
    assert_tree_paths_match_chains(load_model(str(folder), dtype="fp32", progress=False, fast=fast).model, hf)


@needs_kernels
def test_verify_and_batched_rows_bitwise_equal_to_single_steps(gpt_oss):
    """bf16, fused: a 6-row verify pass past the window gives each row's logits bitwise as 6 single
    steps, and the distinct experts a pass read are recorded per layer."""
    folder, _ = gpt_oss
    model = load_model(str(folder), dtype="bf16", progress=False).model
    tokens = torch.randint(0, model.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(1, 32)
    model.forward(tokens[:, :14], cache, 0)
    block = model.forward(tokens[:, 14:20], cache, 14)
    assert 2 <= max(model.fused.moe_count.tolist()) <= 8
    steps = [model.forward(tokens[:, p:p + 1], cache, p)[:, 0] for p in range(14, 20)]
    assert torch.equal(block[0], torch.cat(steps))
    assert model.fused.moe_count.tolist() == [2] * 4                       # one row: its 2 experts


@needs_kernels
def test_bf16_long_speculative_and_batched_equal_plain(gpt_oss):
    """bf16 on the fused decoder, paged cache, 96 tokens (sixteen windows), verify passes of k + 1 rows
    whose rejected rows roll back, several requests in one batch: the tokens of plain decoding one
    request at a time."""
    folder, _ = gpt_oss
    llm = LLM(model=str(folder), dtype="bf16", progress=False, adaptive=False)
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    alone = [llm.generate(p, params, num_speculative_tokens=0)[0].token_ids for p in PROMPTS]
    for k in (3, 6):
        batch = llm.generate(PROMPTS, params, num_speculative_tokens=k)
        assert [o.token_ids for o in batch] == alone, k


def test_long_greedy_identical_to_transformers(gpt_oss):
    """fp32, 64 tokens past a prompt longer than the window, plain and speculative (rollbacks)."""
    folder, hf = gpt_oss
    llm = LLM(model=str(folder), dtype="fp32", progress=False, adaptive=False)
    ids = llm.encode(PROMPTS[0], False)
    assert len(ids) > 6
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(64):
            seq = torch.cat([seq, hf(seq).logits[:, -1:].argmax(-1)], 1)
    ref = seq[0, len(ids):].tolist()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for k in (0, 5):
        assert llm.generate(ids, params, num_speculative_tokens=k)[0].token_ids == ref, k


def test_gguf_dense_load_is_transformers_on_the_dequantized_weights(gpt_oss_gguf, gpt_oss):
    """The file read back (names, expert layout, YaRN, window, sinks) and dequantized exactly: logits and
    greedy continuations those of transformers on the same dequantized weights (which MXFP4's rounding
    moved away from the original model's)."""
    lm, ref = _dequantized_reference(gpt_oss_gguf)
    assert lm.native and type(lm.model) is GptOssTransformer
    c = lm.model.config
    assert c.arch == "gpt-oss" and c.sliding_layers == (True, False, True, False) and c.sliding_window == 6
    assert c.rope_scaling["factor"] == 8.0 and c.moe["router"] == "topk_softmax" and c.attention_sinks
    _check_logits(lm.model, ref, 1e-4)
    tokens = torch.randint(0, c.vocab_size, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        drift = (ref(tokens).logits - gpt_oss[1](tokens).logits).abs().max()
    assert drift > 0.01
    llm = LLM(model=str(gpt_oss_gguf), dtype="fp32", weights="dense", progress=False, adaptive=False)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ids = llm.encode(PROMPTS[0], False)
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(32):
            seq = torch.cat([seq, ref(seq).logits[:, -1:].argmax(-1)], 1)
    for k in (0, 4):
        assert llm.generate(ids, params, num_speculative_tokens=k)[0].token_ids == seq[0, len(ids):].tolist()


@needs_kernels
def test_gguf_runs_natively_on_mxfp4_blocks_read_in_place(gpt_oss_gguf):
    """The native load: each expert's gate, up and down rows views of the mapped file (no copy), logits
    off the dequantized weights' by at most 3x what bf16 alone costs transformers, verify rows
    bitwise equal to single steps, and greedy speculation identical to plain decoding."""
    lm = load_model(str(gpt_oss_gguf), progress=False)
    assert lm.native and lm.weights_kind == "native MXFP4+Q8_0" and lm.model.fused is not None
    layer = lm.model.layers[1]
    gate_up, down = layer["experts_gate_up"][3], layer["experts_down"][3]
    (_, gate), (_, up) = gate_up.weight_q.segments
    assert gate_up.weight_q.mapped and down.weight_q.mapped
    assert [gate_up.qmat.data[0], gate_up.qmat.data[1]] == [gate.data_ptr(), up.data_ptr()]     # read in place
    assert down.qmat.data[0] == down.weight_q.segments[0][1].data_ptr()
    assert gate.data_ptr() == layer["experts_gate_up"][2].weight_q.segments[0][1].data_ptr() + gate.numel()
    _, ref = _dequantized_reference(gpt_oss_gguf)
    model = lm.model
    tokens = torch.randint(0, model.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(tokens).logits
        bf16_error = (ref.to(torch.bfloat16)(tokens).logits.float() - expected).abs().mean()
    native_error = (model.forward(tokens, model.new_cache(1, 64), 0) - expected).abs().mean()
    assert native_error < 3 * bf16_error            # bf16 and the activations' int8 rounding: the kernels' only errors
    tokens = torch.randint(0, model.vocab_size, (1, 20), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(1, 32)
    model.forward(tokens[:, :12], cache, 0)
    block = model.forward(tokens[:, 12:20], cache, 12)
    assert torch.equal(block[0], torch.cat([model.forward(tokens[:, p:p + 1], cache, p)[:, 0] for p in range(12, 20)]))
    llm = LLM(model=str(gpt_oss_gguf), progress=False, adaptive=False)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    spec = llm.generate(PROMPTS, params, num_speculative_tokens=4)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
