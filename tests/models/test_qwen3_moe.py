"""Qwen3-MoE natively (models/moe.py, fast/decoder_moe.c): a tiny random qwen3_moe saved by transformers
and the same model as llama.cpp's converter writes it (qwen3moe GGUF). Logits against transformers,
eager and fused, greedy continuations identical to transformers' plain and with the default drafter,
rows of a batched or verify pass bitwise equal to batch-1 steps, sampling that keeps the target's
distribution, and the native decoder (not the transformers adapter) chosen."""
from __future__ import annotations

import conftest
import pytest
import torch
from conftest import compare_samples, make_qwen3_moe, null_tv
from gguf_writer import write_qwen3moe_gguf

from specdecode import LLM, SamplingParams
from specdecode.fast import linear as fast_linear
from specdecode.models.loader import load_model
from specdecode.models.transformer import Transformer
from specdecode.sampling import probs_from_logits, transform_logits

PROMPTS = conftest.QWEN35_PROMPTS
pytestmark = pytest.mark.usefixtures("one_thread")
needs_kernels = pytest.mark.skipif(fast_linear._load()["lib"] is None, reason="no native kernels")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """(directory, transformers model) of the tiny Qwen3-MoE; its last layer a dense MLP (mlp_only_layers)."""
    folder = tmp_path_factory.mktemp("qwen3_moe")
    return folder, make_qwen3_moe(folder, mlp_only_layers=(2,))


@pytest.fixture(scope="module")
def moe_gguf(qwen3_moe, tmp_path_factory):
    """The same model as a Q8_0 qwen3moe GGUF file (every layer a MoE layer there: llama.cpp's qwen3moe
    has no dense layers, so a model of its own with all three)."""
    folder = tmp_path_factory.mktemp("qwen3_moe_all")
    hf = make_qwen3_moe(folder, seed=9)
    return hf, write_qwen3moe_gguf(folder / "tiny-qwen3moe-q8_0.gguf", hf, folder / "tokenizer.json",
                                   "<|im_end|>", qtype="Q8_0")


def _check_logits(model, hf, atol: float) -> None:
    tokens = torch.randint(0, model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
    cache = model.new_cache(1, 64)
    torch.testing.assert_close(model.forward(tokens[:, :16], cache, 0), expected[:, :16], atol=atol, rtol=0)
    for pos in range(16, 18):
        torch.testing.assert_close(model.forward(tokens[:, pos:pos + 1], cache, pos)[:, 0], expected[:, pos],
                                   atol=atol, rtol=0)
    torch.testing.assert_close(model.forward(tokens[:, 18:24], cache, 18), expected[:, 18:24], atol=atol, rtol=0)


@pytest.mark.parametrize("fast", [False, True])
def test_logits_match_transformers(qwen3_moe, fast):
    folder, hf = qwen3_moe
    lm = load_model(str(folder), dtype="fp32", progress=False, fast=fast)
    assert lm.native and type(lm.model) is Transformer          # not the transformers adapter
    config = lm.model.config
    assert config.arch == "qwen3moe" and config.moe_layers == (True, True, False)
    assert config.moe == {"experts": 8, "used": 2, "intermediate": 64, "norm_topk": True}
    if fast and fast_linear._load()["lib"] is not None:
        assert lm.model.fused is not None and lm.model.fused.moe_count is not None
    _check_logits(lm.model, hf, 1e-4)


def test_routing_matters(qwen3_moe):
    """The test model's experts decide its logits (so the tests above could fail): routing every
    row to the same experts changes them."""
    folder, hf = qwen3_moe
    model = load_model(str(folder), dtype="fp32", progress=False, fast=False).model
    tokens = torch.randint(0, model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    base = model.forward(tokens, model.new_cache(1, 16), 0)
    for layer in model.layers[:2]:
        router = layer["router"]
        layer["router"] = lambda x, router=router: router(x) * 0 + torch.arange(8, dtype=x.dtype)
    assert (model.forward(tokens, model.new_cache(1, 16), 0) - base).abs().max() > 0.1


@needs_kernels
def test_verify_and_batched_rows_bitwise_equal_to_single_steps(qwen3_moe):
    """bf16, fused: a 6-row verify pass gives each row's logits bitwise as 6 single steps, and the
    distinct experts a pass read are recorded per layer."""
    folder, _ = qwen3_moe
    model = load_model(str(folder), dtype="bf16", progress=False).model
    tokens = torch.randint(0, model.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(1, 32)
    model.forward(tokens[:, :14], cache, 0)
    block = model.forward(tokens[:, 14:20], cache, 14)
    block_experts = model.fused.moe_count.tolist()
    steps = [model.forward(tokens[:, p:p + 1], cache, p)[:, 0] for p in range(14, 20)]
    assert torch.equal(block[0], torch.cat(steps))
    assert 2 <= block_experts[0] <= 8 and block_experts[2] == 0          # layer 2: dense MLP
    assert model.fused.moe_count.tolist()[0] == 2                         # one row: its 2 experts


@needs_kernels
def test_a_long_pass_runs_in_one_call_with_the_rows_of_short_ones(qwen3_moe):
    """bf16, fused: a MoE model runs up to MAX_MOE_T rows in one native call (a prefill chunk reads each routed
    expert once), each row bitwise as in passes of at most 64 rows (the dense models' call) and of 1."""
    from specdecode.fast.decoder import MAX_MOE_T, MAX_T
    folder, _ = qwen3_moe
    model = load_model(str(folder), dtype="bf16", progress=False).model
    assert model.fused.max_rows == MAX_MOE_T > 200 > MAX_T
    tokens = torch.randint(0, model.vocab_size, (1, 200), generator=torch.Generator().manual_seed(3))
    whole = model.fused.forward(tokens, model.new_cache(1, 208), 0)
    assert model.fused.moe_count.tolist() == [8, 8, 0]        # one call: every expert of the MoE layers read
    cache = model.new_cache(1, 208)
    short = torch.cat([model.fused.forward(tokens[:, a:a + MAX_T], cache, a) for a in range(0, 200, MAX_T)], 1)
    assert torch.equal(whole, short)
    single = model.fused.forward(tokens[:, 199:], cache, 199)
    assert torch.equal(whole[:, 199:], single)


def test_greedy_identical_to_transformers_plain_and_speculative(qwen3_moe):
    folder, hf = qwen3_moe
    llm = LLM(model=str(folder), dtype="fp32", progress=False)
    assert llm.method == "ngram" and llm.target.native
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for prompt in PROMPTS:
        ids = llm.encode(prompt, False)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert llm.generate(prompt, params, num_speculative_tokens=0)[0].token_ids == ref
        assert llm.generate(prompt, params, num_speculative_tokens=4)[0].token_ids == ref


@needs_kernels
def test_bf16_speculative_and_batched_equal_plain(qwen3_moe):
    """bf16 on the fused decoder, paged cache, verify passes of k + 1 rows and several requests in one
    batch: the same tokens as plain decoding one request at a time."""
    folder, _ = qwen3_moe
    llm = LLM(model=str(folder), dtype="bf16", progress=False, adaptive=False)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    alone = [llm.generate(p, params, num_speculative_tokens=0)[0].token_ids for p in PROMPTS]
    for k in (0, 3, 6):
        batch = llm.generate(PROMPTS, params, num_speculative_tokens=k)
        assert [o.token_ids for o in batch] == alone, k


def test_seeded_sampling_keeps_the_target_distribution(qwen3_moe):
    """Speculative sampling (temperature 0.8, top_k 2, ngram drafts of 2) on the MoE model draws its
    first three tokens from transformers' exact distribution: chi-square p > 1e-3, total variation
    within 0.01 * sqrt(10^5 / n)."""
    folder, hf = qwen3_moe
    llm = LLM(model=str(folder), dtype="fp32", progress=False, adaptive=False)
    prompt = llm.encode("1 2 3 1 2 3 1 2", False)
    params = lambda seed=None: SamplingParams(temperature=0.8, top_k=2, max_tokens=3, ignore_eos=True,  # noqa: E731
                                              seed=seed)

    @torch.no_grad()
    def next_probs(prefix):
        logits = hf(torch.tensor([prompt + prefix])).logits[:, -1:].float()
        return probs_from_logits(transform_logits(logits, [params()]), [params()])[0, 0].double()
    exact = conftest.exact_joint(next_probs, 3)
    n = 4_000
    bound = 0.01 * (100_000 / n) ** 0.5
    assert len(exact) == 8 and abs(sum(exact.values()) - 1) < 1e-4
    assert null_tv(exact, n) < 0.7 * bound
    counts, _ = conftest.draw_samples(llm, prompt, params, n, 2, seed0=3_000_000)
    p_value, tv, outside = compare_samples(counts, exact)
    assert outside == 0
    assert p_value > 1e-3 and tv < bound, (p_value, tv)


@needs_kernels
def test_gguf_runs_natively_on_its_own_blocks(moe_gguf):
    """llama.cpp's qwen3moe layout: the expert stacks read in place as Q8_0 blocks (each expert a view
    of its rows), logits near transformers', greedy speculation identical to plain decoding."""
    hf, path = moe_gguf
    lm = load_model(str(path), progress=False)
    assert lm.native and lm.weights_kind == "native Q8_0" and lm.model.fused is not None
    layer = lm.model.layers[0]
    stack = layer["experts_gate_up"][0].weight_q.segments[0][1]
    assert stack.data_ptr() + stack.shape[0] * stack.shape[1] == layer["experts_gate_up"][1].weight_q.segments[0][
        1].data_ptr()                                              # expert 1's rows follow expert 0's in the file
    _check_logits(lm.model, hf, 0.05)
    llm = LLM(model=str(path), progress=False, adaptive=False)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    spec = llm.generate(PROMPTS, params, num_speculative_tokens=4)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_gguf_dense_conversion_matches_transformers(moe_gguf):
    """`--weights dense`: the stacks dequantized and split back into one matrix per expert."""
    hf, path = moe_gguf
    lm = load_model(str(path), progress=False, weights="dense", dtype="fp32", fast=False)
    assert lm.native and lm.model.config.moe["experts"] == 8
    _check_logits(lm.model, hf, 0.05)


@needs_kernels
@pytest.mark.parametrize("dtype", [None, "q4_0"])
def test_expert_rows_stay_readable_after_their_pages_are_dropped(moe_gguf, dtype):
    """The file's expert rows, released from the process once repacked, read back as the file's values
    (a view of the mapping); re-quantized experts live in anonymous memory and are never released."""
    hf, path = moe_gguf
    lm = load_model(str(path), progress=False, dtype=dtype)
    lin = lm.model.layers[1]["experts_gate_up"][3]
    assert lin.weight_q.mapped == (dtype is None)
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj[3]
    torch.testing.assert_close(lin.weight_q.dequantize(), gate_up, atol=0.02 if dtype else 0.002, rtol=0)
