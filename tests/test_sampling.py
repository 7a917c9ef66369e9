"""Tests for specdecode.sampling: the shared logits transform, probs and sampling."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdecode.params import SamplingParams
from specdecode.sampling import probs_from_logits, sample, transform_logits

NEG_INF = float("-inf")


def one_row(values):
    """[V] list -> [1, 1, V] float32 logits."""
    return torch.tensor(values, dtype=torch.float32).view(1, 1, -1)


# ----------------------------------------------------------------------------- transform


def test_fast_path_is_temperature_division_only():
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=0.5), SamplingParams(temperature=1.0)]
    out = transform_logits(logits, params, None, None, None)
    assert out.dtype == torch.float32
    assert torch.equal(out[0], logits[0])            # greedy: untouched
    assert torch.allclose(out[1], logits[1] / 0.5)
    assert torch.equal(out[2], logits[2])
    assert torch.equal(logits, torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0)))


def test_low_precision_input_is_computed_in_float32():
    logits = torch.randn(2, 1, 20, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = transform_logits(logits, [SamplingParams(temperature=0.7)] * 2, None, None, None)
    assert out.dtype == torch.float32
    assert torch.allclose(out, logits.float() / 0.7)


def test_logit_bias():
    logits = one_row([1.0, 2.0, 3.0, 4.0])
    out = transform_logits(logits, [SamplingParams(logit_bias={0: 5.0, 3: -2.5})], None, None, None)
    assert out[0, 0].tolist() == [6.0, 2.0, 3.0, 1.5]
    assert logits[0, 0].tolist() == [1.0, 2.0, 3.0, 4.0]  # input not modified


def test_logit_bias_outside_vocab_raises():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        transform_logits(one_row([0.0, 0.0]), [SamplingParams(logit_bias={5: 1.0})], None, None, None)


def test_repetition_penalty_positive_and_negative_logits_prompt_and_output():
    logits = one_row([2.0, -2.0, 2.0, -2.0, 1.0])
    params = [SamplingParams(repetition_penalty=2.0)]
    # Token 0 is in the prompt, token 1 in the output: the repetition penalty counts both.
    out = transform_logits(logits, params, history=[[0, 1]], prompt_lens=[1], block_tokens=None)
    assert out[0, 0].tolist() == [1.0, -4.0, 2.0, -2.0, 1.0]


def test_repetition_penalty_counts_block_prefix_per_position():
    logits = torch.tensor([[4.0, -4.0, 4.0, 4.0]]).repeat(3, 1).unsqueeze(0)    # [1, 3, 4]
    params = [SamplingParams(repetition_penalty=4.0)]
    out = transform_logits(logits, params, history=[[0]], prompt_lens=[1],
                           block_tokens=torch.tensor([[1, 2]]))
    assert out[0, 0].tolist() == [1.0, -4.0, 4.0, 4.0]      # only the history
    assert out[0, 1].tolist() == [1.0, -16.0, 4.0, 4.0]     # + block token 1
    assert out[0, 2].tolist() == [1.0, -16.0, 1.0, 4.0]     # + block token 2


def test_presence_and_frequency_count_output_and_block_prefix_only():
    vocab = 6
    logits = torch.zeros(1, 3, vocab)
    history = [[0, 0, 1, 2, 2, 2]]       # prompt = [0, 0, 1], output = [2, 2, 2]
    block = torch.tensor([[3, 2]])
    presence = transform_logits(logits, [SamplingParams(presence_penalty=0.5)], history, [3], block)
    assert presence[0, 0].tolist() == [0, 0, -0.5, 0, 0, 0]      # prompt tokens 0, 1 don't count
    assert presence[0, 1].tolist() == [0, 0, -0.5, -0.5, 0, 0]
    assert presence[0, 2].tolist() == [0, 0, -0.5, -0.5, 0, 0]
    frequency = transform_logits(logits, [SamplingParams(frequency_penalty=0.25)], history, [3], block)
    assert frequency[0, 0].tolist() == [0, 0, -0.75, 0, 0, 0]
    assert frequency[0, 1].tolist() == [0, 0, -0.75, -0.25, 0, 0]
    assert frequency[0, 2].tolist() == [0, 0, -1.0, -0.25, 0, 0]
    # Negative penalties encourage repeats.
    negative = transform_logits(logits, [SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)],
                                history, [3], block)
    assert negative[0, 2].tolist() == [0, 0, 3.0, 1.5, 0, 0]


def test_block_padding_tokens_are_ignored():
    logits = torch.zeros(1, 3, 4)
    out = transform_logits(logits, [SamplingParams(frequency_penalty=1.0)], [[]], [0],
                           torch.tensor([[1, -1]]))
    assert out[0, 2].tolist() == [0, -1.0, 0, 0]


def test_penalties_require_history():
    with pytest.raises(ValueError, match="history"):
        transform_logits(one_row([0.0, 1.0]), [SamplingParams(repetition_penalty=1.5)], None, None, None)
    with pytest.raises(ValueError, match="prompt_lens"):
        transform_logits(one_row([0.0, 1.0]), [SamplingParams(presence_penalty=1.0)], [[1]], None, None)
    empty = transform_logits(one_row([0.0, 1.0]), [SamplingParams(presence_penalty=1.0)], [[]], [0], None)
    assert empty[0, 0].tolist() == [0.0, 1.0]


def test_temperature():
    logits = one_row([1.0, 2.0, -3.0])
    out = transform_logits(logits, [SamplingParams(temperature=0.5)], None, None, None)
    assert out[0, 0].tolist() == [2.0, 4.0, -6.0]


def test_top_k():
    logits = one_row([0.5, 3.0, 1.0, 2.0, -1.0])
    out = transform_logits(logits, [SamplingParams(temperature=1.0, top_k=2)], None, None, None)
    assert out[0, 0].tolist() == [NEG_INF, 3.0, NEG_INF, 2.0, NEG_INF]
    # top_k >= vocab disables it.
    out = transform_logits(logits, [SamplingParams(temperature=1.0, top_k=5)], None, None, None)
    assert torch.equal(out, logits)


def test_top_p_smallest_set_reaching_p_and_keeps_top_token():
    probs = torch.tensor([0.1, 0.5, 0.25, 0.15])
    logits = probs.log().view(1, 1, -1)
    out = transform_logits(logits, [SamplingParams(temperature=1.0, top_p=0.7)], None, None, None)
    kept = torch.isfinite(out[0, 0]).tolist()
    assert kept == [False, True, True, False]            # 0.5 + 0.25 >= 0.7
    out = transform_logits(logits, [SamplingParams(temperature=1.0, top_p=0.75)], None, None, None)
    assert torch.isfinite(out[0, 0]).tolist() == [False, True, True, False]  # exactly reaches 0.75
    out = transform_logits(logits, [SamplingParams(temperature=1.0, top_p=0.76)], None, None, None)
    assert torch.isfinite(out[0, 0]).tolist() == [False, True, True, True]
    # A tiny top_p still keeps the top token.
    out = transform_logits(logits, [SamplingParams(temperature=1.0, top_p=1e-6)], None, None, None)
    assert torch.isfinite(out[0, 0]).tolist() == [False, True, False, False]
    assert out[0, 0, 1].item() == pytest.approx(math.log(0.5))


def test_top_p_applies_after_temperature():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().view(1, 1, -1)
    # At temperature 1 the top token alone (0.6) reaches 0.55; at temperature 2 it does not.
    out = transform_logits(logits, [SamplingParams(temperature=1.0, top_p=0.55)], None, None, None)
    assert torch.isfinite(out[0, 0]).tolist() == [True, False, False]
    out = transform_logits(logits, [SamplingParams(temperature=2.0, top_p=0.55)], None, None, None)
    assert torch.isfinite(out[0, 0]).tolist() == [True, True, False]


def test_min_p():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    logits = probs.log().view(1, 1, -1)
    out = transform_logits(logits, [SamplingParams(temperature=1.0, min_p=0.2)], None, None, None)
    assert torch.isfinite(out[0, 0]).tolist() == [True, True, True, False]   # 0.08 < 0.2 * 0.5
    out = transform_logits(logits, [SamplingParams(temperature=1.0, min_p=0.7)], None, None, None)
    assert torch.isfinite(out[0, 0]).tolist() == [True, False, False, False]


def test_filters_compose_top_k_then_top_p_then_min_p():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().view(1, 1, -1)
    # top_k=3 -> [0.444, 0.333, 0.222]; top_p=0.7 -> first two (0.777); min_p=0.8 -> only the top.
    out = transform_logits(logits, [SamplingParams(temperature=1.0, top_k=3, top_p=0.7)], None, None, None)
    assert torch.isfinite(out[0, 0]).tolist() == [True, True, False, False]
    out = transform_logits(logits, [SamplingParams(temperature=1.0, top_k=3, top_p=0.7, min_p=0.8)],
                           None, None, None)
    assert torch.isfinite(out[0, 0]).tolist() == [True, False, False, False]


def test_greedy_rows_ignore_temperature_and_filters_but_get_bias_and_penalties():
    logits = one_row([1.0, 3.0, 2.0, -1.0])
    params = [SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9,
                             logit_bias={3: 1.0}, repetition_penalty=2.0)]
    out = transform_logits(logits, params, history=[[1]], prompt_lens=[1], block_tokens=None)
    assert out[0, 0].tolist() == [1.0, 1.5, 2.0, 0.0]
    probs = probs_from_logits(out, params)
    assert probs[0, 0].tolist() == [0.0, 0.0, 1.0, 0.0]


def test_mixed_rows_have_independent_params():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(4, 1).unsqueeze(1)   # [4, 1, 4]
    params = [SamplingParams(), SamplingParams(temperature=2.0, top_k=2),
              SamplingParams(temperature=1.0, logit_bias={0: 10.0}), SamplingParams(temperature=0.5, min_p=0.5)]
    out = transform_logits(logits, params, None, None, None)
    assert out[0, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert out[1, 0].tolist() == [NEG_INF, NEG_INF, 1.0, 1.5]
    assert out[2, 0].tolist() == [10.0, 1.0, 2.0, 3.0]
    assert out[3, 0].tolist() == [NEG_INF, NEG_INF, NEG_INF, 6.0]   # 4-6 < log(0.5)


def reference_transform(logits, params, history, prompt_lens, block_tokens):
    """Slow, obviously-correct per-row, per-position transcription of the spec."""
    batch, block_len, vocab = logits.shape
    out = torch.empty(batch, block_len, vocab, dtype=torch.float64)
    for b, p in enumerate(params):
        for t in range(block_len):
            x = logits[b, t].double().clone()
            for token, bias in p.logit_bias.items():
                x[token] += bias
            block_prefix = [int(v) for v in block_tokens[b, :t] if v >= 0] if t and block_tokens is not None else []
            seen = list(history[b]) + block_prefix
            output = list(history[b][prompt_lens[b]:]) + block_prefix
            for token in set(seen):
                if p.repetition_penalty != 1.0:
                    x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
            for token, count in Counter(output).items():
                x[token] -= p.presence_penalty + count * p.frequency_penalty
            if not p.greedy:
                x = x / p.temperature
                if 0 < p.top_k < vocab:
                    kth = x.sort(descending=True).values[p.top_k - 1]
                    x[x < kth] = NEG_INF
                if p.top_p < 1.0:
                    probs = x.softmax(-1)
                    keep = torch.zeros(vocab, dtype=torch.bool)
                    total = 0.0
                    for token in probs.argsort(descending=True).tolist():
                        keep[token] = True
                        total += probs[token].item()
                        if total >= p.top_p:
                            break
                    x[~keep] = NEG_INF
                if p.min_p > 0.0:
                    probs = x.softmax(-1)
                    x[probs < p.min_p * probs.max()] = NEG_INF
            out[b, t] = x
    return out


def test_matches_reference_on_random_mixed_rows():
    gen = torch.Generator().manual_seed(123)
    batch, block_len, vocab = 6, 4, 40
    logits = torch.randn(batch, block_len, vocab, generator=gen) * 2
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05, repetition_penalty=1.3),
        SamplingParams(temperature=1.3, top_p=0.9, presence_penalty=0.7, frequency_penalty=0.3,
                       logit_bias={3: 2.0, 7: -5.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=-0.4, logit_bias={1: 1.5}),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.9, min_p=0.1, repetition_penalty=0.8, presence_penalty=-0.5),
    ]
    history = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (0, 12, 7, 20, 3, 9)]
    prompt_lens = [0, 5, 7, 10, 1, 2]
    block_tokens = torch.randint(0, vocab, (batch, block_len - 1), generator=gen)
    out = transform_logits(logits, params, history, prompt_lens, block_tokens)
    expected = reference_transform(logits, params, history, prompt_lens, block_tokens)
    assert torch.equal(torch.isfinite(out), torch.isfinite(expected))
    finite = torch.isfinite(expected)
    assert torch.allclose(out[finite].double(), expected[finite], atol=1e-5)
    # The same rows transformed one at a time give the same result (rows are independent).
    for b in range(batch):
        single = transform_logits(logits[b:b + 1], params[b:b + 1], history[b:b + 1], prompt_lens[b:b + 1],
                                  block_tokens[b:b + 1])
        assert torch.equal(single[0], out[b])


def test_top_p_wide_nucleus_and_ties_match_reference():
    """Nuclei wider than the first topk candidate window (256 -> 2048 -> full sort), and ties."""
    gen = torch.Generator().manual_seed(321)
    vocab = 10_000
    scales = torch.tensor([0.1, 1.0, 3.0, 2.0]).view(-1, 1, 1)
    logits = torch.randn(4, 2, vocab, generator=gen) * scales
    params = [SamplingParams(temperature=1.0, top_p=0.9),                 # ~8800 tokens: full sort
              SamplingParams(temperature=0.8, top_p=0.95, top_k=500),     # ~450: second window
              SamplingParams(temperature=1.0, top_p=0.5, min_p=0.001),    # first window
              SamplingParams(temperature=1.0, top_p=0.7)]                 # ~700: second window
    out = transform_logits(logits, params, None, None, None)
    expected = reference_transform(logits, params, [[]] * 4, [0] * 4, None)
    assert torch.equal(torch.isfinite(out), torch.isfinite(expected))
    kept = torch.isfinite(out).sum(-1)
    assert kept[0].min() > 2048 and 256 < kept[3].min() and kept[3].max() < 2048 and kept[2].max() < 256
    # Each row alone (different candidate windows) gives the same result.
    for b in range(4):
        assert torch.equal(transform_logits(logits[b:b + 1], params[b:b + 1], None, None, None)[0], out[b])
    # Ties: top_k keeps every token tied with the k-th; top_p widens past the top_k window.
    tied = one_row([3.0, 3.0, 3.0, 1.0, 0.0])
    params = [SamplingParams(temperature=1.0, top_k=2, top_p=0.9)]
    out = transform_logits(tied, params, None, None, None)
    assert torch.isfinite(out[0, 0]).tolist() == [True, True, True, False, False]
    params = [SamplingParams(temperature=1.0, top_k=2, top_p=0.5)]
    out = transform_logits(tied, params, None, None, None)
    assert torch.isfinite(out[0, 0]).tolist() == [True, True, True, False, False]   # tied cutoff


# ----------------------------------------------------------------------------- probs


def test_probs_from_logits_softmax_and_greedy_one_hot_lowest_index_on_ties():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0]], [[1.0, 3.0, 3.0, 0.0]]])
    params = [SamplingParams(), SamplingParams(temperature=1.0)]
    probs = probs_from_logits(logits, params)
    assert probs[0, 0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert torch.allclose(probs[1, 0], logits[1, 0].softmax(-1))
    filtered = transform_logits(logits, [SamplingParams(temperature=1.0, top_k=1)] * 2, None, None, None)
    probs = probs_from_logits(filtered, [SamplingParams(temperature=1.0, top_k=1)] * 2)
    assert probs[0, 0, 0].item() == 0.0 and not torch.isnan(probs).any()


# ----------------------------------------------------------------------------- sample


def test_sample_point_mass_and_never_zero_probability():
    probs = torch.zeros(64, 7)
    probs[:, 6] = 1.0
    probs[:32, 6] = 0.0
    probs[:32, 0] = 1.0                      # first and last token edge cases
    tokens = sample(probs, torch.Generator().manual_seed(0))
    assert tokens.dtype == torch.int64
    assert tokens[:32].tolist() == [0] * 32 and tokens[32:].tolist() == [6] * 32
    sparse = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.5, 0.0]]).expand(20_000, -1)
    tokens = sample(sparse, None)
    assert set(tokens.tolist()) == {1, 4}


def test_sample_follows_distribution():
    probs = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.3])
    n = 100_000
    tokens = sample(probs.expand(n, -1), torch.Generator().manual_seed(5))
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[1] == 0
    support = probs > 0
    expected = probs[support].double() / probs[support].double().sum() * n
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3


def test_sample_per_row_generators_reproducible_and_batch_independent():
    gen = torch.Generator().manual_seed(9)
    probs = torch.rand(5, 30, generator=gen)
    seeds = [11, 12, 13, 14, 15]
    batch = sample(probs, [torch.Generator().manual_seed(s) for s in seeds])
    again = sample(probs, [torch.Generator().manual_seed(s) for s in seeds])
    assert torch.equal(batch, again)
    for b, s in enumerate(seeds):
        alone = sample(probs[b:b + 1], [torch.Generator().manual_seed(s)])
        assert alone.item() == batch[b].item()
    single = sample(probs, torch.Generator().manual_seed(3))
    assert torch.equal(single, sample(probs, torch.Generator().manual_seed(3)))
    with pytest.raises(ValueError):
        sample(probs, [torch.Generator()] * 2)
