"""Architectures without a native implementation run through the transformers adapter:
slower, still lossless (greedy speculative output equals plain output)."""
import pytest
import torch

from specdecode import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    from conftest import make_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel
    folder = tmp_path_factory.mktemp("gpt2")
    make_tokenizer(folder)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=128, n_embd=32, n_layer=2, n_head=2,
                                       eos_token_id=2, bos_token_id=None))
    model.save_pretrained(str(folder))
    return folder


def test_adapter_note_and_greedy_equality(tiny_gpt2, capsys):
    llm = LLM(model=str(tiny_gpt2), method="ngram", num_speculative_tokens=4, dtype="fp32", progress=False)
    assert "transformers adapter" in capsys.readouterr().err
    assert not llm.target.native
    prompts = ["the quick brown fox jumps over the lazy dog. the quick", "1 2 3 4 5 6 7 8"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    spec = llm.generate(prompts, params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
    # same tokens as transformers' own greedy generate
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_gpt2)).eval()
    ids = torch.tensor([plain[1].prompt_token_ids])
    expected = ref.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    assert expected.tolist() == plain[1].token_ids


def test_adapter_self_draft(tiny_gpt2):
    llm = LLM(model=str(tiny_gpt2), draft=str(tiny_gpt2), num_speculative_tokens=3, dtype="fp32", progress=False,
              method="model", adaptive=False)   # the draft model alone (the cascade adds lookups); a draft as
                                                # costly as the target: the budget would never draft
    out = llm.generate("1 2 3 4", SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.stats["acceptance_rate"] == 1.0
