"""Qwen3.5-MoE natively (transformers' qwen3_5_moe_text: the hybrid stack of models/qwen3_5.py with MoE
MLPs and a gated shared expert, models/moe.py): logits against transformers, a verification pass cut
at every position (the recurrent state rolled back), greedy output identical to transformers' plain
and speculative, batched rows equal to alone in bf16; and the transformers adapter on a hybrid model
(which failed with an IndexError: a bare DynamicCache has no slot for a recurrent state)."""
from __future__ import annotations

import conftest
import pytest
import torch
from conftest import make_qwen35_moe

from specdecode import LLM, SamplingParams
from specdecode.forward import ForwardBatch
from specdecode.models.hf_adapter import AdapterCache, HFAdapter
from specdecode.models.loader import load_model
from specdecode.models.qwen3_5 import Qwen35Transformer

PROMPTS = conftest.QWEN35_PROMPTS
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen35_moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_moe")
    return folder, make_qwen35_moe(folder)


@pytest.mark.parametrize("fast", [False, True])
def test_logits_match_transformers(qwen35_moe, fast):
    folder, hf = qwen35_moe
    lm = load_model(str(folder), dtype="fp32", progress=False, fast=fast)
    model = lm.model
    assert lm.native and type(model) is Qwen35Transformer
    assert model.config.moe == {"experts": 8, "used": 2, "intermediate": 64, "norm_topk": True, "shared": 64}
    assert all("router" in layer and "shared_gate" in layer for layer in model.layers)
    ids = torch.tensor([[5, 17, 40, 99, 23, 8, 61, 7, 12, 33] * 9])                # 90 tokens: a chunked prefill
    cache = model.new_paged_cache(1, 256, 16, 16)
    cache.reserve(0, 120)
    logits = model.logits(model.run(ForwardBatch.chain(ids, 0, torch.tensor([0])), cache))[0]
    with torch.no_grad():
        reference = hf(ids).logits[0]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    cache.truncate(0, 90)
    seq = ids[0].tolist()
    for _ in range(3):                                                              # token by token
        seq.append(int(logits[-1].argmax()))
        logits = model.logits(model.run(ForwardBatch.chain(torch.tensor([seq[-1:]]), len(seq) - 1,
                                                           torch.tensor([0])), cache))[0]
        cache.truncate(0, len(seq))
    with torch.no_grad():
        torch.testing.assert_close(logits[-1], hf(torch.tensor([seq])).logits[0, -1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kept", [1, 3, 6])
def test_rollback_inside_a_verification_pass(qwen35_moe, kept):
    """A pass of 6 tokens cut at `kept` leaves the states of a pass of the first `kept` alone: the next
    token's logits are the same."""
    model = load_model(str(qwen35_moe[0]), dtype="fp32", progress=False).model
    prompt, chain = [5, 17, 40, 99, 23, 8, 61, 7], [12, 33, 40, 99, 5, 17]
    after = []
    for width in (len(chain), kept):
        cache = model.new_paged_cache(1, 256, 8, 16)
        cache.reserve(0, 64)
        model.run(ForwardBatch.chain(torch.tensor([prompt]), 0, torch.tensor([0])), cache)
        cache.truncate(0, len(prompt))
        model.run(ForwardBatch.chain(torch.tensor([chain[:width]]), len(prompt), torch.tensor([0])), cache)
        cache.truncate(0, len(prompt) + kept)
        nxt = torch.tensor([[chain[kept % len(chain)]]])
        after.append(model.logits(model.run(ForwardBatch.chain(nxt, len(prompt) + kept, torch.tensor([0])), cache)))
    torch.testing.assert_close(after[0], after[1], atol=1e-5, rtol=0)


def test_greedy_identical_to_transformers_plain_and_speculative(qwen35_moe):
    folder, hf = qwen35_moe
    llm = LLM(model=str(folder), dtype="fp32", progress=False, adaptive=False)
    assert llm.target.native
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    drafted = 0
    for prompt in PROMPTS:
        ids = llm.encode(prompt, False)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert llm.generate(prompt, params, num_speculative_tokens=0)[0].token_ids == ref
        spec = llm.generate(prompt, params, num_speculative_tokens=4)[0]
        assert spec.token_ids == ref
        drafted += spec.stats["drafted_tokens"]
    assert drafted > 0


def test_bf16_batched_and_speculative_equal_plain_alone(qwen35_moe):
    llm = LLM(model=str(qwen35_moe[0]), dtype="bf16", progress=False, adaptive=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [llm.generate(p, params, num_speculative_tokens=0)[0].token_ids for p in PROMPTS]
    for k in (0, 4):
        assert [o.token_ids for o in llm.generate(PROMPTS, params, num_speculative_tokens=k)] == alone, k


def test_adapter_rolls_a_hybrid_model_back_by_replaying(qwen35_moe):
    """The transformers adapter on a model with recurrent layers: a pass after a rollback inside an
    earlier one gives transformers' own logits of the kept tokens."""
    folder, hf = qwen35_moe
    adapter = HFAdapter(folder, torch.float32, torch.device("cpu"))
    assert adapter.recurrent
    cache = AdapterCache(1, 64)
    prompt, drafts, other = [5, 17, 40, 99, 23, 8, 61, 7], [12, 33, 40, 99], [44, 45]
    adapter.forward(torch.tensor([prompt]), cache, 0)
    adapter.forward(torch.tensor([drafts]), cache, len(prompt))                 # 4 drafts, 2 kept
    got = adapter.forward(torch.tensor([other]), cache, len(prompt) + 2)[0]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + drafts[:2] + other])).logits[0, -2:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_as_llama_cpp_writes_it(qwen35_moe, tmp_path, qtype):
    """llama.cpp's qwen35moe layout (expert stacks, ffn_*_shexp, ffn_gate_inp_shexp): native on the
    file's blocks near transformers' logits, dense exactly them, greedy speculation equal to plain."""
    from gguf_writer import write_qwen35_gguf
    folder, hf = qwen35_moe
    path = write_qwen35_gguf(tmp_path / f"tiny-qwen35moe-{qtype.lower()}.gguf", hf, folder / "tokenizer.json",
                             "<|im_end|>", qtype=qtype)
    ids = torch.tensor([[5, 17, 40, 99, 23, 8, 61, 7, 12, 33] * 3])
    with torch.no_grad():
        expected = hf(ids).logits
    exact = 1e-4 if qtype == "F32" else 0.05               # Q8_0's own rounding
    for options, atol in (({}, 0.05), ({"weights": "dense", "dtype": "fp32"}, exact)):
        lm = load_model(str(path), progress=False, **options)
        assert lm.native and lm.model.config.moe["shared"] == 64
        if qtype == "Q8_0" and not options:
            assert lm.weights_kind == "native Q8_0"
        cache = lm.model.new_paged_cache(1, 64, 8, 16)
        cache.reserve(0, 40)
        got = lm.model.logits(lm.model.run(ForwardBatch.chain(ids, 0, torch.tensor([0])), cache))
        torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    llm = LLM(model=str(path), progress=False, adaptive=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    assert [o.token_ids for o in llm.generate(PROMPTS, params, num_speculative_tokens=4)] == \
        [o.token_ids for o in plain]


def test_mtp_head_with_moe_mlp_drafts_losslessly(tmp_path):
    """A checkpoint whose MTP head's layer has the MoE MLP (as Qwen3.5-35B-A3B's): the default method is
    mtp, and greedy output with it is plain decoding's, alone and batched."""
    make_qwen35_moe(tmp_path, mtp=True)
    llm = LLM(model=str(tmp_path), dtype="fp32", progress=False, adaptive=False)
    assert llm.method == "mtp"
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(PROMPTS, params, num_speculative_tokens=0)]
    spec = llm.generate(PROMPTS, params, num_speculative_tokens=2)
    assert [o.token_ids for o in spec] == plain
    assert sum(o.stats["drafted_tokens"] for o in spec) > 0
    assert llm.generate(PROMPTS[0], params, num_speculative_tokens=2)[0].token_ids == plain[0]
