"""Drafts of every size through the speculative loop, each checked against plain decoding (k = 0):
empty drafts, rows with and without drafts in one batch (ragged k), all drafts accepted (bonus
token), a fresh draft model with no room for drafts, and the target's top-k handed to a drafter that
asks for it."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import PROMPTS, plain, step_sizes

from specdecode import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def test_empty_draft_advances_one_token_per_step(tiny_models):
    """n-gram drafting that never finds a match: every step is a plain step (1 token)."""
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", ngram_min=16, ngram_max=16,
              dtype="fp32", progress=False)
    ids = list(range(3, 23))                       # 20 distinct tokens: no 16-gram can repeat
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    base = llm.generate([ids], params, num_speculative_tokens=0)[0]
    out, sizes = step_sizes(llm, [ids], params, k=5)
    assert out[0].token_ids == base.token_ids
    assert sizes[0] == [1] * 12
    assert out[0].stats["steps"] == 12 and out[0].stats["drafted_tokens"] == 0
    assert out[0].stats["mean_accepted_length"] == 1.0


def test_empty_and_full_drafts_in_one_batch(llms):
    """Rows with and without an n-gram match in the same step (ragged k) equal plain."""
    ids = [list(range(3, 23)), llms["ngram"].encode(PROMPTS[0], False)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    base = plain(llms, ids, params)
    out, sizes = step_sizes(llms["ngram"], ids, params, k=5)
    assert [o.token_ids for o in out] == [b.token_ids for b in base]
    assert sizes[0][0] == 1                        # no match for row 0 in the first step
    assert out[1].stats["drafted_tokens"] > 0


@pytest.mark.parametrize("k", [1, 5, 8])
def test_all_drafts_accepted_give_bonus_token(llms, k):
    """Self-draft: every draft is accepted, each step emits k drafts + 1 bonus token."""
    params = SamplingParams(max_tokens=3 * (k + 1), ignore_eos=True)
    base = plain(llms, PROMPTS, params)
    out, sizes = step_sizes(llms["self"], PROMPTS, params, k=k)
    for o, b, s in zip(out, base, sizes):
        assert o.token_ids == b.token_ids
        assert s == [k + 1] * 3
        assert o.stats["acceptance_rate"] == 1.0 and o.stats["steps"] == 3


def test_max_tokens_one_with_draft_model(tiny_models):
    """First call of a fresh drafter where no step has room for drafts (max_tokens = 1)."""
    llm = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama_draft"]), dtype="fp32", progress=False)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    out = llm.generate(PROMPTS, params, num_speculative_tokens=5)
    assert [len(o.token_ids) for o in out] == [1] * len(PROMPTS)
    assert math.isclose(out[0].stats["mean_accepted_length"], 1.0)


@pytest.mark.parametrize("top", [1, 3])
def test_a_drafter_reading_the_targets_top_k_gets_it_at_every_position(tiny_models, top):
    """A drafter that declares needs_target_topk gets, every step, the target's top-k token ids at
    each scored position, best first; for greedy rows the top-1 is the argmax the step already took
    (not scanned again: a scan cost lookahead ~20 us a step), and it is the token the step emits."""
    from specdecode.drafters.base import Drafter, DrafterCapabilities, DraftProposal
    from specdecode.drafters.registry import register, unregister

    class TopRecorder(Drafter):
        capabilities = DrafterCapabilities(needs_target_topk=top, relative_cost=0.01)
        seen: list[torch.Tensor] = []

        def __init__(self, target, **_) -> None:
            pass

        def propose(self, seqs, max_tokens):
            return DraftProposal.empty(len(seqs))

        def observe_topk(self, seqs, proposal, topk_ids):
            TopRecorder.seen.append(topk_ids.clone())

    register("top-recorder")(TopRecorder)
    try:
        llm = LLM(model=str(tiny_models["llama"]), method="top-recorder", num_speculative_tokens=2, dtype="fp32",
                  progress=False, adaptive=False)
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    finally:
        unregister("top-recorder")
    seen = TopRecorder.seen
    assert len(seen) == 6 and all(t.shape == (1, 1, top) for t in seen)
    assert [int(t[0, 0, 0]) for t in seen] == out.token_ids            # position 0's best: the emitted token
