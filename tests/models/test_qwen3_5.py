"""Qwen3.5 natively (models/qwen3_5.py, cache/recurrent.py): a tiny random hybrid model (Gated
DeltaNet and gated attention layers) against transformers' own, and speculation on its recurrent
state: rollback to every position of a chain, outputs identical to plain decoding."""
from __future__ import annotations

import json

import pytest
import torch

from specdecode.forward import ForwardBatch
from specdecode.params import SamplingParams

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "def add(a, b):\n    return a + b\n",
           "1 2 3 4 5 6 7 8"]


@pytest.fixture(scope="module")
def native(qwen35):
    from specdecode.models.loader import load_model
    return load_model(str(qwen35[0]), dtype="fp32", progress=False)


def test_loads_natively(native):
    assert type(native.model).__name__ == "Qwen35Transformer" and native.native
    assert native.model.num_recurrent_layers == 3 and native.model.num_attention_layers == 1


def test_the_multimodal_checkpoint_layout_loads_its_text_model(qwen35, native, tmp_path):
    """Released Qwen3.5 checkpoints are the multimodal model: the decoder under model.language_model.,
    a vision tower beside it (left unread), the config's text part in text_config."""
    from safetensors.torch import load_file, save_file

    from specdecode.models.loader import load_model
    folder = qwen35[0]
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(dict(weights, **{"model.visual.patch_embed.proj.weight": torch.zeros(4, 4)}),
              str(tmp_path / "model.safetensors"))
    text = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text,
                                                      "architectures": ["Qwen3_5ForConditionalGeneration"]}))
    wrapped = load_model(str(tmp_path), dtype="fp32", progress=False).model
    ids = torch.tensor([[5, 17, 40, 99, 23, 8]])
    logits = []
    for model in (native.model, wrapped):
        cache = model.new_paged_cache(1, 64, 8, 16)
        cache.reserve(0, 16)
        logits.append(model.logits(model.run(ForwardBatch.chain(ids, 0, torch.tensor([0])), cache)))
    assert torch.equal(logits[0], logits[1])


def test_logits_match_transformers_chunked_and_token_by_token(qwen35, native):
    _, hf = qwen35
    model = native.model
    ids = torch.tensor([[5, 17, 40, 99, 23, 8, 61, 7, 12, 33] * 15])               # 150 tokens: chunked
    cache = model.new_paged_cache(1, 512, 32, 16)
    cache.reserve(0, 200)
    logits = model.logits(model.run(ForwardBatch.chain(ids, 0, torch.tensor([0])), cache))[0]
    with torch.no_grad():
        reference = hf(ids).logits[0]
    assert torch.allclose(logits, reference, atol=1e-4, rtol=1e-4)
    cache.truncate(0, 150)
    seq = ids[0].tolist()
    for _ in range(4):                                                            # then token by token
        seq.append(int(logits[-1].argmax()))
        logits = model.logits(model.run(ForwardBatch.chain(torch.tensor([seq[-1:]]), len(seq) - 1,
                                                           torch.tensor([0])), cache))[0]
        cache.truncate(0, len(seq))
    with torch.no_grad():
        assert torch.allclose(logits[-1], hf(torch.tensor([seq])).logits[0, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kept", range(1, 7))
def test_rollback_to_every_position_of_a_chain(native, kept):
    """A verification pass of 6 tokens cut at `kept`: the states and the next logits are those of a
    pass of the first `kept` tokens alone (ragged rows beside it change nothing)."""
    model = native.model
    prompt, chain = [5, 17, 40, 99, 23, 8, 61, 7], [12, 33, 40, 99, 5, 17]
    caches = []
    for width in (len(chain), kept):
        cache = model.new_paged_cache(2, 512, 16, 16)
        for row in (0, 1):
            cache.reserve(row, 64)
            model.run(ForwardBatch.chain(torch.tensor([prompt]), 0, torch.tensor([row])), cache)
            cache.truncate(row, len(prompt))
        tokens = torch.tensor([chain[:width], chain[:width][::-1]])               # row 1: other tokens
        model.run(ForwardBatch.chain(tokens, len(prompt), torch.tensor([0, 1]), lengths=[width, 2]), cache)
        cache.truncate(0, len(prompt) + kept)
        caches.append(cache)
    cut, alone = caches
    for layer in range(model.num_recurrent_layers):
        assert torch.allclose(cut.conv[layer][0], alone.conv[layer][0])
        assert torch.allclose(cut.ssm[layer][0], alone.ssm[layer][0], atol=1e-6)
    nxt = torch.tensor([[chain[kept % len(chain)]]])
    at = len(prompt) + kept
    after = [model.logits(model.run(ForwardBatch.chain(nxt, at, torch.tensor([0])), c))[0, -1] for c in caches]
    assert torch.allclose(after[0], after[1], atol=1e-5)


def test_greedy_identical_to_transformers_plain_and_speculative(qwen35):
    from specdecode import LLM
    folder, hf = str(qwen35[0]), qwen35[1]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    opts = dict(dtype="fp32", progress=False)
    llms = [LLM(model=folder, method="none", **opts), LLM(model=folder, **opts),          # the default drafter
            LLM(model=folder, method="ngram", adaptive=False, num_speculative_tokens=4, **opts),
            LLM(model=folder, draft=folder, method="model", adaptive=False, num_speculative_tokens=3, **opts)]
    for prompt in PROMPTS:
        ids = llms[0].tokenizer.encode(prompt)
        with torch.no_grad():
            reference = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        outs = [llm.generate(prompt, params)[0] for llm in llms]
        assert all(o.token_ids == reference for o in outs), prompt
        assert outs[3].stats["acceptance_rate"] == 1.0          # the model as its own draft: every draft kept
    batch = llms[2].generate(PROMPTS, params)                    # rows of one batch, ragged passes
    assert [o.token_ids for o in batch] == [llms[0].generate(p, params)[0].token_ids for p in PROMPTS]


def test_seeded_sampling_identical_with_and_without_speculation(qwen35):
    from specdecode import LLM
    llm = LLM(model=str(qwen35[0]), method="ngram", adaptive=False, num_speculative_tokens=4, dtype="fp32",
              progress=False)
    for seed in range(3):
        params = SamplingParams(max_tokens=32, temperature=0.8, seed=seed, ignore_eos=True)
        assert llm.generate(PROMPTS[0], params)[0].token_ids == \
            llm.generate(PROMPTS[0], params, num_speculative_tokens=0)[0].token_ids


def test_tree_drafters_are_refused_clearly(qwen35):
    from specdecode import LLM
    from specdecode.drafters.base import DrafterError
    with pytest.raises(DrafterError, match="verifies chains only"):
        LLM(model=str(qwen35[0]), method="suffix", dtype="fp32", progress=False)


def test_requantized_projections_include_the_deltanet_inputs(qwen35):
    """dtype int8 re-quantizes every projection, the DeltaNet layers' fused in_proj_qkv|z|b|a too;
    speculation on it is lossless as on the dense model."""
    from safetensors.torch import load_file

    from specdecode import LLM
    from specdecode.models.loader import quantize_projections
    weights = load_file(str(qwen35[0] / "model.safetensors"))
    quantize_projections(weights, "int8")
    assert all(type(weights[f"model.layers.0.linear_attn.in_proj_{n}.weight"]).__name__ == "QuantWeight"
               for n in ("qkv", "z", "b", "a"))
    llm = LLM(model=str(qwen35[0]), dtype="int8", method="ngram", adaptive=False, num_speculative_tokens=4,
              progress=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert llm.generate(PROMPTS[0], params)[0].token_ids == \
        llm.generate(PROMPTS[0], params, num_speculative_tokens=0)[0].token_ids
