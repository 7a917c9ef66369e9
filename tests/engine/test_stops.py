"""Where a request ends, checked against plain decoding (k = 0): EOS, stop strings and max_tokens
inside an accepted draft, the context limit (k larger than the room left), and the rows of a ragged
batch finishing at different steps."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import DRAFTERS, PROMPTS, plain, step_sizes

from specdecode import ParamError, SamplingParams

EOS = 2          # <|im_end|> in the tiny tokenizer (conftest)

pytestmark = pytest.mark.usefixtures("one_thread")


def eos_bias(llm, ids, positions=(2, 3, 4)):
    """A logit_bias on EOS that makes greedy decoding emit EOS exactly at output index j
    (one of `positions`, all inside a first draft of k = 5), or None."""
    n = max(positions) + 1
    tokens = llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True), num_speculative_tokens=0)[0].token_ids
    if EOS in tokens:
        return None
    model = llm.target.model
    logits = model.forward(torch.tensor([ids + tokens]), model.new_cache(1, len(ids) + n + 1), 0)[0]
    gaps = [float(logits[len(ids) - 1 + j].max() - logits[len(ids) - 1 + j, EOS]) for j in range(n)]
    for j in positions:
        before = min(gaps[:j])
        if before - gaps[j] > 0.01:              # EOS overtakes the argmax first at index j
            return j, (before + gaps[j]) / 2
    return None


@pytest.fixture(scope="module")
def eos_case(llms):
    for prompt in ["1 2 3 4 5", "the quick brown fox", "Summarize the following text.", "hello world"]:
        for chat in (False, True):
            ids = llms["ngram"].encode(prompt, chat)
            found = eos_bias(llms["ngram"], ids)
            if found:
                return ids, found[0], found[1]
    pytest.fail("no prompt lets a logit_bias place EOS inside the first draft")


@pytest.mark.parametrize("method", DRAFTERS)
def test_eos_inside_accepted_draft_stops_there(llms, eos_case, method):
    ids, j, bias = eos_case
    params = SamplingParams(max_tokens=30, logit_bias={EOS: bias})
    base = plain(llms, [ids], params)[0]
    assert base.token_ids[-1] == EOS and len(base.token_ids) == j + 1 and base.finish_reason == "stop"
    out, sizes = step_sizes(llms[method], [ids], params, k=5)
    assert out[0].token_ids == base.token_ids
    assert out[0].finish_reason == "stop" and out[0].text == base.text
    if method == "self":                           # EOS was draft j of the first (fully accepted) step
        assert sizes[0] == [j + 1] and out[0].stats["steps"] == 1
        assert out[0].stats["accepted_tokens"] == j + 1
    # ignore_eos: generation runs on past the EOS, still identical to plain
    params = SamplingParams(max_tokens=12, logit_bias={EOS: bias}, ignore_eos=True)
    assert (llms[method].generate([ids], params, num_speculative_tokens=5)[0].token_ids
            == plain(llms, [ids], params)[0].token_ids)


DIVERSE = dict(frequency_penalty=2.0, repetition_penalty=1.5)   # greedy output with varied tokens


@pytest.fixture(scope="module")
def stop_cases(llms):
    """(stop string, index of the token completing it, expected text) for stops that complete
    inside the first step of a k = 5 self-draft: one single-token and one two-token stop."""
    tok = llms["ngram"].tokenizer
    params = SamplingParams(max_tokens=20, ignore_eos=True, **DIVERSE)
    tokens = plain(llms, [PROMPTS[0]], params)[0].token_ids
    full = tok.decode(tokens)
    cases = {}
    for j in range(1, 6):
        for width in (1, 2):
            if width in cases or j - width + 1 < 0:
                continue
            head = tok.decode(tokens[:j - width + 1])
            piece = tok.decode(tokens[:j + 1])[len(head):]
            if (piece.strip() and piece.isprintable() and "\ufffd" not in piece
                    and full.startswith(head) and full.find(piece) == len(head)):
                cases[width] = (piece, j, head)
    assert set(cases) == {1, 2}, f"no stop strings found in {full!r}"
    return cases


@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("method", DRAFTERS)
def test_stop_string_inside_accepted_draft(llms, stop_cases, method, width):
    stop, j, expected_text = stop_cases[width]
    params = SamplingParams(max_tokens=20, stop=["@@never@@", stop], **DIVERSE)
    base = plain(llms, [PROMPTS[0]], params)[0]
    assert base.finish_reason == "stop" and base.text == expected_text and len(base.token_ids) == j + 1
    out, sizes = step_sizes(llms[method], [PROMPTS[0]], params, k=5)
    assert out[0].token_ids == base.token_ids
    assert out[0].text == expected_text and stop not in out[0].text
    assert out[0].finish_reason == "stop"
    if method == "self":
        assert sizes[0] == [j + 1]


@pytest.mark.parametrize("method", DRAFTERS)
def test_max_tokens_reached_mid_draft(llms, method):
    base = plain(llms, PROMPTS, SamplingParams(max_tokens=7, ignore_eos=True))
    for max_tokens in range(1, 8):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        out, sizes = step_sizes(llms[method], PROMPTS, params, k=5)
        for o, b, s in zip(out, base, sizes):
            assert o.token_ids == b.token_ids[:max_tokens], (method, max_tokens)
            assert o.finish_reason == "length" and sum(s) == max_tokens
            assert o.stats["num_tokens"] == max_tokens
        if method == "self":
            assert sizes[0] == [min(6, max_tokens)] + ([max_tokens - 6] if max_tokens > 6 else [])
    # all seven budgets as rows of one batch (rows finish at different steps)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in range(1, 8)]
    out = llms[method].generate([PROMPTS[0]] * 7, params, num_speculative_tokens=5)
    assert [o.token_ids for o in out] == [base[0].token_ids[:m] for m in range(1, 8)]


@pytest.mark.parametrize("method", DRAFTERS)
def test_prompt_near_context_limit(llms, method):
    llm = llms[method]
    context = llm.target.model.max_len
    assert context == 256
    rng = random.Random(0)
    ids = [rng.randrange(3, 290) for _ in range(250)]
    params = SamplingParams(max_tokens=context - len(ids), ignore_eos=True)
    base = plain(llms, [ids], params)[0]
    assert len(base.token_ids) == 6
    for k in (5, 8, 32):                            # k larger than the room left
        out = llm.generate([ids], params, num_speculative_tokens=k)[0]
        assert out.token_ids == base.token_ids, k
        assert out.finish_reason == "length"
    # the same row next to a short one (the batch context is set by the long row)
    short = SamplingParams(max_tokens=20, ignore_eos=True)
    out = llm.generate([ids, PROMPTS[1]], [params, short], num_speculative_tokens=8)
    assert out[0].token_ids == base.token_ids
    assert out[1].token_ids == plain(llms, [PROMPTS[1]], short)[0].token_ids
    too_long = SamplingParams(max_tokens=context - len(ids) + 1, ignore_eos=True)
    with pytest.raises(ParamError) as err:
        llm.generate([ids], too_long, num_speculative_tokens=5)
    assert "250" in str(err.value) and "7" in str(err.value) and "256" in str(err.value)


@pytest.mark.parametrize("method", DRAFTERS)
def test_rows_finishing_at_different_times(llms, eos_case, method):
    eos_ids, j, bias = eos_case
    prompts = PROMPTS + [eos_ids, PROMPTS[0]]
    params = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=17, ignore_eos=True),
              SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=9, ignore_eos=True),
              SamplingParams(max_tokens=30, logit_bias={EOS: bias}),            # stops on EOS
              SamplingParams(max_tokens=11, ignore_eos=True, **DIVERSE)]        # penalties in one row
    out = llms[method].generate(prompts, params, num_speculative_tokens=4)
    for prompt, p, o in zip(prompts, params, out):
        alone = llms[method].generate([prompt], p, num_speculative_tokens=4)[0]
        assert o.token_ids == alone.token_ids
        assert o.token_ids == plain(llms, [prompt], p)[0].token_ids
        assert o.finish_reason == alone.finish_reason
    assert [len(o.token_ids) for o in out] == [3, 17, 1, 9, j + 1, 11]
