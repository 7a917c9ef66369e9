"""SamplingParams (params.py) refuses every bad value with an error naming the parameter, and the
bad values cover every field."""
from __future__ import annotations

import dataclasses

import pytest

from specdecode import ParamError, SamplingParams

BAD_PARAMS = [
    ("temperature", -1.0), ("temperature", float("nan")), ("temperature", "1"), ("temperature", 101.0),
    ("top_k", -1), ("top_k", 1.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("inf")),
    ("min_p", -0.1), ("min_p", 1.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", 11.0), ("repetition_penalty", float("nan")),
    ("presence_penalty", 2.5), ("presence_penalty", float("inf")),
    ("frequency_penalty", -2.5), ("frequency_penalty", "x"),
    ("logit_bias", [1, 2]), ("logit_bias", {-1: 1.0}), ("logit_bias", {"x": 1.0}), ("logit_bias", {1: 200.0}),
    ("logit_bias", {1: float("nan")}),
    ("seed", -1), ("seed", 2**63), ("seed", 1.5), ("seed", "7"),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0), ("max_tokens", True),
    ("stop", [""]), ("stop", ["a"] * 17), ("stop", [1]),
    ("stop", 5), ("ignore_eos", "yes"), ("structured", {"type": "object"}), ("structured", "json"),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("prediction", ""), ("prediction", 3),
    ("prompt_logprobs", 21), ("prompt_logprobs", -1), ("prompt_logprobs", False),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.5]), ("stop_token_ids", 3), ("stop_token_ids", [True]),
    ("stop_token_ids", list(range(65))),
]


def test_bad_params_cover_every_field():
    assert {name for name, *_ in (p.values if hasattr(p, "values") else p for p in BAD_PARAMS)} == \
        {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("name,value", BAD_PARAMS)
def test_bad_sampling_param_names_the_parameter(name, value):
    with pytest.raises(ParamError) as err:
        SamplingParams(**{name: value})
    assert name in str(err.value)
