"""Predicted Outputs and long copies (drafters/prediction.py, the `copies` capability): a
prediction of the answer (the file being edited) is a draft source that re-aligns after an edit;
drafts of a copying drafter grow past k while they are accepted whole; the answer is the
target's own either way (greedy and seeded), and the usage counts OpenAI's accepted / rejected
prediction tokens."""
from __future__ import annotations

import httpx
import openai
import pytest

from specdecode import LLM, SamplingParams
from specdecode.drafters.base import DrafterCapabilities
from specdecode.drafters.prediction import PredictionIndex, prediction_usage
from specdecode.engine.config import EngineConfig
from specdecode.engine.controller import SpeculationController
from specdecode.engine.costs import StepCosts
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state


def test_a_prediction_realigns_after_an_edit():
    prediction = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    index = PredictionIndex(prediction)
    assert index.draft([], 4) == [1, 2, 3, 4]                    # the answer starts as predicted
    assert index.draft([1, 2, 3], 4) == [4, 5, 6, 7]
    assert index.draft([1, 2, 3, 99, 98], 3) == []               # inside the edit: nothing to follow
    assert index.draft([1, 2, 3, 99, 98, 5, 6], 3) == [7, 8, 9]  # the answer meets the prediction again
    assert index.draft(prediction, 3) == []                      # the prediction is used up
    repeats = PredictionIndex([7, 1, 2, 8, 1, 2, 9, 1, 2, 5])    # `1 2` three times: the nearest one
    assert repeats.draft([7, 1, 2, 8, 1, 2], 1) == [9]
    assert repeats.draft([7, 1, 2], 1) == [8]
    usage = prediction_usage([1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6])
    assert usage == {"accepted_prediction_tokens": 4, "rejected_prediction_tokens": 1}


def test_a_copying_rows_drafts_grow_past_k_only_while_they_are_accepted_whole():
    curve = {1: 0.01, 2: 0.011, 4: 0.013, 8: 0.017, 16: 0.025, 32: 0.041}
    for span, cap in ((32, 32), (0, 5)):             # without a span, k is the cap
        ctrl = SpeculationController(DrafterCapabilities(copies=True), StepCosts(dict(curve)))
        row = ctrl.new_row(5, span=span, predicted=True)
        assert row.levels[-1] == cap
        sizes = []
        for _ in range(10):                          # a long copy: every draft accepted
            size = ctrl.plan([row], [1])[0]
            sizes.append(size)
            ctrl.observe([row], [size], [size], [list(range(size))], 1 + size, curve[1] * (1 + size * 0.1), 0.0)
        assert max(sizes) == sizes[-1] == cap and sizes[:4] == sorted(sizes[:4])


FILE = "".join(f"def function_{i}(value):\n    return value * {i} + {i * 3}\n\n" for i in range(3))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_generate_with_a_prediction_is_the_targets_answer(tiny_models, method):
    llm = LLM(model=str(tiny_models["llama"]), method=method, dtype="fp32", progress=False, prefix_cache=False)
    tok = llm.tokenizer
    prompt = tok.encode("Rename function_3 to compute in this file:\n" + FILE)
    plain = llm.generate([prompt], SamplingParams(max_tokens=60, ignore_eos=True), num_speculative_tokens=0)[0]
    # the prediction: what the answer will be, with one edit (a perfect prediction of a random model's answer)
    answer = tok.decode(plain.token_ids)
    predicted = answer[:len(answer) // 3] + " EDITED " + answer[len(answer) // 3:]
    for params in (SamplingParams(max_tokens=60, ignore_eos=True, prediction=predicted),
                   SamplingParams(max_tokens=60, ignore_eos=True, prediction=predicted, temperature=0.8, seed=5)):
        got = llm.generate([prompt], params)[0]
        want = llm.generate([prompt], params, num_speculative_tokens=0)[0]
        assert got.token_ids == want.token_ids
    edited = llm.generate([prompt], SamplingParams(max_tokens=60, ignore_eos=True, prediction=predicted))[0]
    assert edited.stats["rejected_prediction_tokens"] > 0
    exact = llm.generate([prompt], SamplingParams(max_tokens=60, ignore_eos=True, prediction=answer))[0]
    assert exact.token_ids == plain.token_ids
    assert exact.stats["accepted_prediction_tokens"] == len(tok.encode(answer, add_special=False))
    assert exact.stats["accepted_tokens"] >= 40                            # nearly every token a draft ...
    assert len(exact.stats["acceptance_per_position"]) > 5                 # ... in drafts past k = 5


def test_the_server_takes_openais_prediction_field(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=256, served_model_name="tiny"),
                        check_budget=False)
    tok = llm.tokenizer
    prompt = "Rename function_3 to compute:\n" + FILE
    with BackgroundServer(create_app(state)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        ask = dict(model="tiny", prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        plain = client.completions.create(**dict(ask, extra_body={"ignore_eos": True, "speculate": False}))
        text = plain.choices[0].text
        out = client.completions.create(**dict(ask, extra_body={"ignore_eos": True, "prediction": {
            "type": "content", "content": text}}))
        assert out.choices[0].text == text
        details = out.usage.completion_tokens_details
        assert details.accepted_prediction_tokens == len(tok.encode(text, add_special=False))
        assert details.rejected_prediction_tokens == 0
        assert out.model_extra["speculation"]["mean_accepted_length"] > 3
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=20, temperature=0,
                                              prediction={"type": "content", "content": text})
        assert chat.usage.completion_tokens_details.accepted_prediction_tokens >= 0
        for extra, word in (({"n": 2}, "n > 1"), ({"logprobs": 2}, "logprobs"),
                            ({"prediction": {"type": "text", "content": "x"}}, "must be")):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                    "prediction": {"type": "content", "content": text}, **extra}
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prediction" and word in r.text, r.text
