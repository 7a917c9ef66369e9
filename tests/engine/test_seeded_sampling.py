"""Seeded sampling does not depend on speculation: with point-mass drafts the token at each position
is the target's own sample there (position-keyed uniforms, verify_tree.verify_point_mass), so the
same seed gives the same text with speculation on or off, any lookup drafter, any draft size, any
batch; and the verifier for point masses keeps the target's distribution."""
from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.sampling import position_uniforms
from specdecode.verify_tree import verify_point_mass

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["Write a short story about a robot who learns to paint.",
           "List the planets of the solar system, one per line, with a fact about each."]


def test_position_uniforms_are_a_counter_stream():
    a = position_uniforms(7, 0, 20)
    assert position_uniforms(7, 5, 3) == a[5:8] and all(0.0 <= x < 1.0 for x in a)
    assert position_uniforms(8, 0, 20) != a and len(set(a)) == 20
    many = torch.tensor(position_uniforms(123, 0, 20000))
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float((many < 0.1).double().mean()) - 0.1) < 0.01


@pytest.mark.parametrize("method", ["ngram", "suffix", "lookahead"])
def test_seeded_samples_equal_plain_decoding(method):
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=48, seed=s) for s in (1, 2)]
    plain = LLM(method="none", progress=False).generate(PROMPTS, params, chat=True)
    spec = LLM(method=method, progress=False)
    for k in (3, 8):
        out = spec.generate(PROMPTS, params, chat=True, num_speculative_tokens=k)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain], (method, k)
    alone = spec.generate(PROMPTS[1], params[1], chat=True)           # another batch
    assert alone[0].token_ids == plain[1].token_ids


def test_point_mass_verifier_keeps_the_target_distribution():
    """A 2-level tree of point-mass drafts over a 5-token vocabulary: the first emitted token
    follows the root distribution, the second the distribution after the first (total variation
    over 30k draws with position uniforms)."""
    gen = torch.Generator().manual_seed(0)
    root = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05], dtype=torch.float64)
    after = torch.softmax(torch.randn(5, 5, generator=gen, dtype=torch.float64), dim=-1)   # after token t
    tokens = torch.tensor([[1, 3, 0, 2]])            # root children 1, 3; node 0 (token 1): children 0, 2
    parents = torch.tensor([[-1, -1, 0, 0]])
    probs = torch.stack([root, after[1], after[3], after[0], after[2]]).unsqueeze(0)   # [1, 5, 5]
    draws = 30000
    firsts = torch.zeros(5, dtype=torch.float64)
    pairs = torch.zeros(5, 5, dtype=torch.float64)
    for i in range(draws):
        u = torch.tensor([position_uniforms(99, 3 * i, 5)], dtype=torch.float64)
        r = verify_point_mass(tokens, parents, torch.tensor([4]), probs, torch.tensor([False]), u)
        emitted = r.tokens[0, :int(r.num_emitted)].tolist()
        firsts[emitted[0]] += 1
        if len(emitted) > 1:
            pairs[emitted[0], emitted[1]] += 1
    assert float((firsts / draws - root).abs().sum()) / 2 < 0.015
    assert float(pairs.sum()) / draws == pytest.approx(float(root[1] + root[3]), abs=0.015)
    for t in (1, 3):                                  # the drafted first tokens: a second token always follows
        assert pairs[t].sum() == firsts[t]
        assert float((pairs[t] / pairs[t].sum() - after[t]).abs().sum()) / 2 < 0.03, (t, pairs[t], after[t])
