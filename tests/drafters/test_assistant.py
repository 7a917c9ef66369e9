"""Gemma 4's assistant as a drafter (drafters/assistant.py, models/gemma4_assistant.py), against
transformers' Gemma4AssistantForCausalLM: tiny random gemma4_text targets (conftest.make_gemma4) and
tiny random assistants built with transformers here. Checked: a step's logits and next feature equal
transformers' forward given the same target hidden state and shared keys/values (two rows, one past
the window), with the LM head and with ordered embeddings; the drafter's proposal through a read-only
view of a target cache equals transformers' chained drafts; greedy output with the assistant is plain
decoding's, one prompt and a batch, with drafts accepted (a "copying" assistant); seeded sampling
gives the same text on and off; and the errors for a draft and a method that do not go together."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import GEMMA4_WINDOW, make_gemma4, make_seq

from specdecode import LLM, SamplingParams
from specdecode.drafters.assistant import AssistantDrafter
from specdecode.drafters.base import DrafterError, TargetCacheView
from specdecode.forward import ForwardBatch
from specdecode.models.errors import ModelError
from specdecode.models.gemma4_assistant import AssistantConfig
from specdecode.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "a a a a a a a a"]


def make_assistant(folder, target_path, ordered: bool = False, copying: bool = False, hidden: int = 32):
    """A random Gemma4AssistantForCausalLM for the target at `target_path`, saved by transformers: a
    windowed and a global layer reading the target's keys (head dims 16 and 32, as the target's).
    `copying`: its argmax is mostly its input token (pre_projection keeps the target's embedding, the
    head is the target's embedding table, attention and MLP add little), so where the target repeats
    itself its drafts are accepted."""
    from transformers import AutoModelForCausalLM, Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig
    target = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch.float32)
    backbone, vocab = target.config.hidden_size, target.config.vocab_size
    hidden = backbone if copying else hidden
    text = Gemma4TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=GEMMA4_WINDOW,
                            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_hidden_layers=2,
                            layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=2,
                            max_position_embeddings=256)
    assert vocab % 4 == 0                  # clusters of 4 tokens, the 3 best scored: 12 of the vocabulary
    config = Gemma4AssistantConfig(text_config=text.to_dict(), backbone_hidden_size=backbone,
                                   use_ordered_embeddings=ordered, num_centroids=vocab // 4,
                                   centroid_intermediate_top_k=3)
    torch.manual_seed(7)
    model = Gemma4AssistantForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.7 + 0.2 * i)
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(vocab))
        if copying:
            model.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            model.pre_projection.weight.zero_()
            model.pre_projection.weight[:, :backbone].copy_(torch.eye(backbone))
            model.model.norm.weight.fill_(1.0)
            for layer in model.model.layers:         # attention and MLP outputs are normed: their norms scale them
                layer.post_attention_layernorm.weight.mul_(0.05)
                layer.post_feedforward_layernorm.weight.mul_(0.05)
        else:
            model.model.embed_tokens.weight.mul_(4.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_gemma4(tmp_path_factory.mktemp("g4_target"))


@pytest.fixture(scope="module")
def copying(target, tmp_path_factory):
    return make_assistant(tmp_path_factory.mktemp("g4_copying"), target, copying=True)


def reference_drafts(ref_target, ref, ids: torch.Tensor, end: int, steps: int):
    """transformers' chained drafts after ids[:end + 1] (as its candidate generator runs them), with
    each step's (logits, next feature); and the target's inputs: its hidden state and shared keys."""
    with torch.no_grad():
        out = ref_target(ids[:, :end], output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
        feature, kv = out.hidden_states[-1][:, -1:], dict(out.shared_kv_states)
        token, outs = ids[:, end:end + 1], []
        for _ in range(steps):
            embeds = torch.cat([ref_target.get_input_embeddings()(token), feature], dim=-1)
            step = ref(inputs_embeds=embeds, position_ids=torch.tensor([[end]]), shared_kv_states=kv)
            token, feature = step.logits.argmax(dim=-1), step.last_hidden_state
            outs.append((step.logits[0, 0], feature[0, 0], int(token)))
    return outs, out.hidden_states[-1][0, -1], kv


@pytest.mark.parametrize("variant", ["e2b", "k_eq_v"])
@pytest.mark.parametrize("ordered", [False, True], ids=["lm_head", "ordered"])
def test_step_and_drafts_match_transformers(tmp_path, variant, ordered):
    from transformers import AutoModelForCausalLM, Gemma4AssistantForCausalLM
    target_path = make_gemma4(tmp_path / "target", variant)
    folder = make_assistant(tmp_path / "assistant", target_path, ordered=ordered)
    ref_target = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch.float32).eval()
    ref = Gemma4AssistantForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    target = load_model(str(target_path), dtype="fp32", progress=False, fast=False)
    drafter = AssistantDrafter(target, draft=str(folder), fast=False)
    assistant = drafter.model
    ids = torch.randint(5, target.model.vocab_size, (1, 32), generator=torch.Generator().manual_seed(2))
    ends = [21, 6]                 # 21 keys: past the window (8 + 1 seen); 6: fewer than it
    refs = [reference_drafts(ref_target, ref, ids, end, 3) for end in ends]
    # 1. one step of both rows at once, from transformers' own inputs
    lengths = torch.tensor(ends)
    keys = {}
    for sliding, (positions, visible) in assistant.key_positions(lengths).items():
        kind = "sliding_attention" if sliding else "full_attention"
        k = torch.stack([r[2][kind][0][0][:, positions[b]] for b, r in enumerate(refs)])
        v = torch.stack([r[2][kind][1][0][:, positions[b]] for b, r in enumerate(refs)])
        keys[sliding] = k, v, visible
    assert keys[True][2].sum(dim=1).tolist() == [GEMMA4_WINDOW + 1, 6] and keys[False][2].sum(dim=1).tolist() == ends
    embeds = ref_target.get_input_embeddings()(ids[0, ends])
    logits, features = assistant.step(embeds, torch.stack([r[1] for r in refs]), keys, lengths)
    for b, (outs, _, _) in enumerate(refs):
        torch.testing.assert_close(logits[b], outs[0][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(features[b], outs[0][1], atol=1e-4, rtol=1e-4)
    # 2. the drafter's proposal: the target's pass observed, its keys read through a view of its cache
    cache = target.model.new_cache(3, 64)
    rows = [2, 0]
    drafter.use_target_cache(TargetCacheView(cache))
    seqs = [make_seq(str(b), ids[0, :end + 1].tolist(), SamplingParams(), row=row)
            for b, (end, row) in enumerate(zip(ends, rows))]
    for s, end in zip(seqs, ends):
        hidden = target.model.run(ForwardBatch.chain(ids[:, :end], torch.tensor([0]), torch.tensor([s.row])), cache)
        cache.truncate(s.row, end)
        drafter.observe([s], [0], hidden)
    before = [t.clone() for t in cache.keys + cache.values]
    proposal = drafter.propose(seqs, [3, 2])
    assert proposal.probs is None and proposal.num_tokens.tolist() == [3, 2]
    for b, (outs, _, _) in enumerate(refs):
        assert proposal.tokens[b, :[3, 2][b]].tolist() == [o[2] for o in outs][:[3, 2][b]]
    assert all(torch.equal(a, b) for a, b in zip(before, cache.keys + cache.values))    # read, never written


def test_greedy_with_the_assistant_equals_plain(target, copying):
    """The default method for a gemma4_assistant draft; one prompt and a batch give plain decoding's
    tokens, and drafts were accepted."""
    llm = LLM(model=str(target), draft=str(copying), dtype="fp32", progress=False, adaptive=False,
              num_speculative_tokens=4)
    assert llm.method == "assistant" and isinstance(llm.drafter, AssistantDrafter) and llm.draft is None
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    spec = llm.generate(PROMPTS, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert llm.generate(PROMPTS[1], params)[0].token_ids == plain[1].token_ids
    assert sum(s.stats["accepted_tokens"] for s in spec) > 0


def test_seeded_sampling_is_the_same_with_and_without_the_assistant(target, copying):
    llm = LLM(model=str(target), draft=str(copying), dtype="fp32", progress=False, adaptive=False,
              num_speculative_tokens=3)
    params = [SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=s) for s in (1, 2)]
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    spec = llm.generate(PROMPTS, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats["drafted_tokens"] for s in spec) > 0


def test_a_draft_and_a_method_that_do_not_go_together(target, copying, tmp_path):
    with pytest.raises(DrafterError, match="drafts with method 'assistant'"):
        LLM(model=str(target), draft=str(copying), method="model", progress=False)
    with pytest.raises(DrafterError, match="draft_dtype"):
        LLM(model=str(target), draft=str(copying), draft_dtype="int8", progress=False)
    with pytest.raises(DrafterError, match="is not one"):
        LLM(model=str(target), draft=str(target), method="assistant", progress=False)
    with pytest.raises(DrafterError, match="needs Gemma 4's assistant"):
        LLM(model=str(target), method="assistant", progress=False)
    with pytest.raises(DrafterError, match="natively loaded Gemma 4 target"):
        LLM(draft=str(copying), progress=False)                       # the embedded SmolLM2
    target_lm = load_model(str(target), dtype="fp32", progress=False)
    with pytest.raises(DrafterError, match="backbone_hidden_size"):
        AssistantDrafter(target_lm, draft=str(edited(copying, tmp_path / "wide", backbone_hidden_size=96)))
    narrow = edited(copying, tmp_path / "narrow", text={"per_layer_config": {"1": {"head_dim": 16}}})
    with pytest.raises(DrafterError, match="global layers have 4 query heads of 16, and target .* global keys are "
                                           "2 kv heads of 32: it was made for another target"):
        AssistantDrafter(target_lm, draft=str(narrow))
    cfg = json.loads((copying / "config.json").read_text())
    for bad, match in ((dict(use_ordered_embeddings=True, num_centroids=7), "num_centroids"),
                       (dict(text_config=dict(cfg["text_config"], hidden_size_per_layer_input=16)),
                        "hidden_size_per_layer_input")):
        with pytest.raises(ModelError, match=match):
            AssistantConfig.from_hf(dict(cfg, **bad))


def edited(folder, copy, text=None, **fields):
    """A copy of an assistant's folder whose config.json has `fields` (and `text` in its text_config) changed."""
    import shutil
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg.update(fields, text_config=dict(cfg["text_config"], **(text or {})))
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_assistant_on_a_moe_target(tmp_path_factory, dtype):
    """A Gemma 4 target with MoE blocks (26B-A4B's layout, conftest.make_gemma4_moe): the assistant reads
    its features and its last windowed and global layers' keys as a dense target's; greedy (drafts
    accepted) and seeded sampled output are plain decoding's, in bf16 too."""
    from conftest import make_gemma4_moe
    target_path = make_gemma4_moe(tmp_path_factory.mktemp("g4_moe_target"))
    assistant = make_assistant(tmp_path_factory.mktemp("g4_moe_copying"), target_path, copying=True)
    llm = LLM(model=str(target_path), draft=str(assistant), dtype=dtype, progress=False, adaptive=False,
              num_speculative_tokens=4)
    assert llm.method == "assistant" and llm.target.model.config.moe is not None
    for params, counted in ((SamplingParams(max_tokens=40, ignore_eos=True), "accepted_tokens"),
                            ([SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=s) for s in (1, 2)],
                             "drafted_tokens")):
        plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
        spec = llm.generate(PROMPTS, params)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
        assert sum(s.stats[counted] for s in spec) > 0


def test_assistant_on_a_gguf_moe_target(tmp_path_factory):
    """The MoE target as llama.cpp's Q8_0 gemma4 file, read natively: the assistant drafts for it as for
    the directory, plain decoding's tokens in bf16, drafts accepted."""
    from conftest import hf_reference, make_gemma4_moe
    from gguf_writer import write_gemma4_gguf
    target_path = make_gemma4_moe(tmp_path_factory.mktemp("g4_moe_gguf_target"))
    assistant = make_assistant(tmp_path_factory.mktemp("g4_moe_gguf_copying"), target_path, copying=True)
    gguf = write_gemma4_gguf(target_path.parent / "tiny-gemma4-moe-q8_0.gguf", hf_reference(target_path),
                             target_path / "tokenizer.json", "<|im_end|>", "<bos>", qtype="Q8_0")
    llm = LLM(model=str(gguf), draft=str(assistant), progress=False, adaptive=False, num_speculative_tokens=4)
    assert llm.method == "assistant" and llm.target.model.config.moe is not None
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    spec = llm.generate(PROMPTS, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats["accepted_tokens"] for s in spec) > 0
