"""LLM(...) and LLM.generate (api.py) refuse bad input with an error naming it: the number of draft
tokens, an unknown method, method "model" without a draft, missing or unreadable model and draft
paths, a logit bias outside the vocabulary, empty or out-of-vocabulary prompts; a bare list of token
ids is one prompt."""
from __future__ import annotations

import pytest
from conftest import PROMPTS

from specdecode import LLM, ParamError, SamplingParams
from specdecode.drafters.base import DrafterError
from specdecode.models.config import ModelError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("k", [-1, 33, 2.0, "5"])
def test_bad_num_speculative_tokens(tiny_models, llms, k):
    with pytest.raises(ParamError, match="num_speculative_tokens"):
        LLM(model=str(tiny_models["llama"]), num_speculative_tokens=k, dtype="fp32", progress=False)
    with pytest.raises(ParamError, match="num_speculative_tokens"):
        llms["ngram"].generate(PROMPTS[0], SamplingParams(max_tokens=2), num_speculative_tokens=k)


@pytest.mark.parametrize("k", [0, 5])
def test_unknown_method(tiny_models, k):
    with pytest.raises(DrafterError, match="nosuch"):
        LLM(model=str(tiny_models["llama"]), method="nosuch", num_speculative_tokens=k, dtype="fp32", progress=False)


def test_method_model_needs_a_draft(tiny_models):
    with pytest.raises(DrafterError, match="draft"):
        LLM(model=str(tiny_models["llama"]), method="model", dtype="fp32", progress=False)


def test_missing_model_path(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ModelError, match="no_such_model"):
        LLM(model=str(missing), dtype="fp32", progress=False)


def test_text_file_as_model(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("not a model")
    with pytest.raises(ModelError, match="weights.txt"):
        LLM(model=str(path), dtype="fp32", progress=False)


def test_missing_draft_path(tiny_models, tmp_path):
    with pytest.raises(ModelError, match="nodraft"):
        LLM(model=str(tiny_models["llama"]), draft=str(tmp_path / "nodraft"), dtype="fp32", progress=False)


def test_logit_bias_outside_vocab(llms):
    vocab = llms["ngram"].target.model.config.vocab_size
    with pytest.raises(ParamError) as err:
        llms["ngram"].generate(PROMPTS[0], SamplingParams(max_tokens=3, logit_bias={vocab: 1.0}))
    assert str(vocab) in str(err.value) and "logit_bias" in str(err.value)
    # the last id is fine
    llms["ngram"].generate(PROMPTS[0], SamplingParams(max_tokens=3, logit_bias={vocab - 1: 1.0}))


def test_bad_prompts(llms):
    llm = llms["model"]
    with pytest.raises(ParamError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=3))
    with pytest.raises(ParamError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=3))
    with pytest.raises(ParamError, match="at least one prompt"):
        llm.generate([], SamplingParams(max_tokens=3))
    with pytest.raises(ParamError, match="vocabulary"):
        llm.generate([[5, 300]], SamplingParams(max_tokens=3))
    with pytest.raises(ParamError, match="vocabulary"):
        llm.generate([[-1, 5]], SamplingParams(max_tokens=3))
    with pytest.raises(ParamError, match="sampling_params"):
        llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=3)])


def test_single_token_id_prompt(llms):
    """A bare list of token ids is one prompt (not a list of prompts)."""
    ids = llms["ngram"].encode(PROMPTS[1], False)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    one = llms["model"].generate(ids, params)
    assert len(one) == 1 and one[0].prompt_token_ids == ids
    assert one[0].token_ids == llms["model"].generate([ids], params)[0].token_ids
