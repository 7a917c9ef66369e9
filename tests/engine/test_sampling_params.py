"""Every sampling parameter through the speculative loop: greedy output with penalties, logit bias
and filters equals plain decoding (k = 0) for every drafter, alone and with different parameters in
one batch; seeded sampling is reproducible."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import DRAFTERS, PROMPTS, plain

from specdecode import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


GREEDY_VARIANTS = {
    "repetition_penalty": dict(repetition_penalty=1.3),
    "presence_penalty": dict(presence_penalty=0.5),
    "frequency_penalty": dict(frequency_penalty=0.3),
    "logit_bias": dict(logit_bias={16: -4.0, 23: -4.0, 201: 2.5, 40: 3.0}),
    "min_p": dict(min_p=0.2, top_k=3, top_p=0.5),   # filters are no-ops under greedy
    "all": dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                logit_bias={16: -4.0, 201: 2.5}, min_p=0.1),
}


@pytest.mark.parametrize("variant", list(GREEDY_VARIANTS))
@pytest.mark.parametrize("method", DRAFTERS)
def test_greedy_lossless_for_every_parameter(llms, method, variant):
    params = SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY_VARIANTS[variant])
    base = plain(llms, PROMPTS, params)
    for k in (2, 5):
        out = llms[method].generate(PROMPTS, params, num_speculative_tokens=k)
        assert [o.token_ids for o in out] == [b.token_ids for b in base], (method, variant, k)
    if method == "self":
        assert all(o.stats["acceptance_rate"] == 1.0 for o in out)


def test_mixed_parameters_in_one_batch(llms):
    """Rows with and without penalties / bias side by side, each equal to its plain run."""
    params = [SamplingParams(max_tokens=25, ignore_eos=True, **v) for v in GREEDY_VARIANTS.values()]
    prompts = (PROMPTS * 2)[:len(params)]
    for method in DRAFTERS:
        out = llms[method].generate(prompts, params, num_speculative_tokens=4)
        for prompt, p, o in zip(prompts, params, out):
            assert o.token_ids == plain(llms, [prompt], p)[0].token_ids, method


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("method", ["ngram", "model"])
def test_seeded_sampling_is_reproducible(llms, method, k):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    first = llms[method].generate(PROMPTS, params, num_speculative_tokens=k)
    again = llms[method].generate(PROMPTS, params, num_speculative_tokens=k)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    other = llms[method].generate(PROMPTS, dataclasses.replace(params, seed=99), num_speculative_tokens=k)
    assert [o.token_ids for o in first] != [o.token_ids for o in other]
