"""The training-free tree drafters, standalone (no model): Token Recycling (`recycle`) and
SuffixDecoding (`suffix`). Every proposal must be a valid tree within its row's node budget with
distinct siblings; the recycle table must learn from the target's top-k and the next tree follow
it; the suffix drafter must follow repeated text, branch where earlier continuations differed
(the more frequent first) and reuse finished outputs for new requests."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from conftest import make_seq as new_seq

from specdecode.drafters.base import DrafterError, DraftProposal
from specdecode.drafters.recycle import RecycleDrafter, template
from specdecode.drafters.registry import build_drafter, method_names
from specdecode.drafters.suffix import LocalIndex, SuffixDrafter
from specdecode.params import SamplingParams
from specdecode.tree import depths, validate


class Stub:
    """A target as far as the drafters look: `.model.vocab_size`."""

    class model:
        vocab_size = 64


def make_seq(prompt, output=(), request_id=0, row=0):
    s = new_seq(request_id, list(prompt), SamplingParams(max_tokens=100_000, ignore_eos=True), (), row)
    s.token_ids += [int(t) for t in output]
    return s


def check(proposal: DraftProposal, budgets: list[int]) -> list[list[tuple[int, int]]]:
    """Assert a valid point-mass tree within budget (a chain where every row's is one), siblings
    distinct; return the rows' nodes."""
    assert proposal.probs is None
    parents = proposal.tree_parents()
    validate(parents, proposal.num_tokens)
    rows = []
    for b, budget in enumerate(budgets):
        n = int(proposal.num_tokens[b])
        assert 0 <= n <= budget
        nodes = list(zip(proposal.tokens[b, :n].tolist(), parents[b, :n].tolist()))
        assert len(set(nodes)) == len(nodes), f"row {b}: siblings repeat a token: {nodes}"
        rows.append(nodes)
    return rows


def children(nodes, parent: int) -> list[int]:
    return [t for t, p in nodes if p == parent]


def main_path(nodes) -> list[int]:
    """Tokens along the first child of every node from the root."""
    path, at = [], -1
    while True:
        first = next((i for i, (_, p) in enumerate(nodes) if p == at), None)
        if first is None:
            return path
        path.append(nodes[first][0])
        at = first


# ---------------------------------------------------------------------------------- registry
def test_both_are_registered_and_validate_options():
    assert {"recycle", "suffix"} <= set(method_names())
    r, s = build_drafter("recycle", None, recycle_topk=4), build_drafter("suffix", None, ngram_max=3)
    assert isinstance(r, RecycleDrafter) and isinstance(s, SuffixDrafter)
    assert r.capabilities.drafts_trees and r.capabilities.needs_target_topk == 4 and not r.capabilities.has_state
    assert s.capabilities.drafts_trees and s.capabilities.needs_target_topk == 0 and not s.capabilities.has_state
    for method, option, value in [("recycle", "recycle_topk", 0), ("recycle", "recycle_topk", 33),
                                  ("suffix", "suffix_max_match", 0), ("suffix", "suffix_min_prob", 1.5),
                                  ("suffix", "suffix_spec_factor", 0.0), ("suffix", "suffix_global_requests", -1)]:
        with pytest.raises(DrafterError, match=option):
            build_drafter(method, None, **{option: value})


# ---------------------------------------------------------------------------------- recycle
def test_recycle_template_is_best_first_deep_along_rank_zero():
    parent, rank, depth = template(8)
    assert len(parent) == 64 and all(-1 <= p < i for i, p in enumerate(parent))
    assert depth[:32].max() == 7 and rank[:32].max() < 8
    i = int(depth[:32].argmax())                                     # the deepest node: all rank 0
    while i >= 0:
        assert rank[i] == 0
        i = int(parent[i])
    assert (parent[:32] == -1).sum() == 4                            # wide near the root
    parent16, _, _ = template(8, 16)
    assert parent16.tolist() == parent[:16].tolist()                 # a budget's tree is a prefix


def test_recycle_warms_from_the_prompt_and_learns_from_topk():
    d = RecycleDrafter(Stub, recycle_topk=4)
    assert d.table.shape == (64, 4) and (d.table == -1).all()
    s = make_seq([1, 2, 3, 4, 1, 2, 3])
    nodes = check(d.propose([s], [8]), [8])[0]
    assert main_path(nodes) == [4, 1, 2, 3, 4, 1][:len(main_path(nodes))] and len(nodes) >= 4
    assert children(nodes, -1) == [4]                                # a warm row holds one successor

    # the target's top-4 after the root (3), and after each draft node (4, 1, 2)
    proposal = d.propose([s], [3])
    assert proposal.tokens.tolist() == [[4, 1, 2]]
    top = torch.tensor([[[10, 11, 12, 13], [20, 21, 22, 23], [50, 51, 52, 53], [54, 55, 56, 57]]])
    d.observe_topk([s], proposal, top)
    assert d.table[3].tolist() == [10, 11, 12, 13] and d.table[4].tolist() == [20, 21, 22, 23]
    assert d.table[2].tolist() == [54, 55, 56, 57]

    # an empty proposal still scores the root: the table learns that 10 is followed by 30, 31, ...
    s.token_ids.append(10)
    d.observe_topk([s], DraftProposal.empty(1), torch.tensor([[[30, 31, 32, 33]]]))
    nodes = check(d.propose([s], [16]), [16])[0]
    assert children(nodes, -1) == [30, 31, 32, 33]
    s.token_ids[-1] = 3
    nodes = check(d.propose([s], [16]), [16])[0]
    assert children(nodes, -1) == [10, 11, 12, 13]
    first = children(nodes, -1).index(10)
    assert children(nodes, first)[:3] == [30, 31, 32]                 # 10's row, as learned above
    # the most recent pass wins: the row of 3 is replaced as a whole
    d.observe_topk([s], DraftProposal.empty(1), torch.tensor([[[40, 41, 42, 43]]]))
    assert children(check(d.propose([s], [16]), [16])[0], -1) == [40, 41, 42, 43]


def test_recycle_trees_are_valid_within_budget_and_zero_is_empty():
    rng = np.random.default_rng(0)
    d = RecycleDrafter(Stub, recycle_topk=8)
    seqs = [make_seq(rng.integers(0, 64, 30).tolist(), request_id=i, row=i) for i in range(4)]
    every = DraftProposal(torch.arange(64)[None, :], torch.tensor([64]), None)      # a row for every token
    d.observe_topk(seqs[:1], every, torch.stack([torch.randperm(64)[:8] for _ in range(65)])[None])
    for _ in range(20):                                 # random top-8 lists for random tokens
        toks = torch.from_numpy(rng.integers(0, 64, (4, 3)))
        prop = DraftProposal(toks, torch.tensor([3, 2, 0, 1]), None)
        top = torch.stack([torch.stack([torch.randperm(64)[:8] for _ in range(4)]) for _ in range(4)])
        d.observe_topk(seqs, prop, top)
    for budgets in ([0, 5, 32, 64], [0, 0, 0, 0], [1, 2, 3, 4], [64, 64, 64, 64]):
        p = d.propose(seqs, budgets)
        rows = check(p, budgets)
        if max(budgets) == 0:
            assert p.k == 0 and p.num_tokens.tolist() == [0] * 4
        assert all(len(r) == b for r, b in zip(rows, budgets))    # a table full of top-8s fills the budget


def test_recycle_grows_its_table_without_a_vocabulary():
    d = RecycleDrafter(None)
    s = make_seq([5, 1000, 5, 7, 1000])
    assert main_path(check(d.propose([s], [4]), [4])[0]) == [5, 7, 1000]   # 5 -> 7: the later bigram
    s.token_ids.append(9)
    assert check(d.propose([s], [4]), [4])[0] == []                    # 9 -> nothing yet
    d.observe_topk([s], DraftProposal.empty(1), torch.tensor([[[2000, 1, 2, 3, 4, 5, 6, 8]]]))
    assert d.table.shape[0] > 2000 and children(check(d.propose([s], [4]), [4])[0], -1)[0] == 2000


# ---------------------------------------------------------------------------------- suffix
def test_suffix_follows_a_repeated_phrase():
    rng = np.random.default_rng(1)
    phrase = list(range(100, 120))
    prompt = rng.integers(0, 50, 30).tolist() + phrase + rng.integers(0, 50, 30).tolist()
    d = SuffixDrafter(None)
    s = make_seq(prompt, [60] + phrase[:10])              # the output restarts the phrase
    nodes = check(d.propose([s], [16]), [16])[0]
    assert main_path(nodes)[:10] == phrase[10:] and len(nodes) >= 10
    # growth is incremental: two more tokens, the next drafts start two later
    s.token_ids += phrase[10:12]
    assert main_path(check(d.propose([s], [8]), [8])[0])[:8] == phrase[12:20]


def test_suffix_branches_where_continuations_differed_more_frequent_first():
    x, y = 90, 91
    abcd = [10, 11, 12, 13]
    text = [1, 2, *abcd, x, 3, 4, 5, *abcd, y, 6, 7, 8, *abcd, x, 9, 20, 21, *abcd]
    d = SuffixDrafter(None, suffix_spec_factor=2.0)
    nodes = check(d.propose([make_seq(text)], [8]), [8])[0]
    assert children(nodes, -1) == [x, y]                  # x followed twice, y once
    first = [t for t, _ in nodes].index(x)
    assert set(children(nodes, first)) == {3, 9}          # the two continuations after x, 1/3 each
    assert max(depths(torch.tensor([[p for _, p in nodes]]))[0].tolist()) <= 8   # ceil(2.0 * 4)
    # a floor on the estimated probability prunes the rare branch
    strict = SuffixDrafter(None, suffix_min_prob=0.5)
    assert children(check(strict.propose([make_seq(text)], [8]), [8])[0], -1) == [x]


def test_suffix_global_index_helps_a_new_request():
    rng = np.random.default_rng(2)
    answer = rng.integers(200, 400, 40).tolist()
    d = SuffixDrafter(None, suffix_global_requests=2)
    state = d.prepare(4, 256)
    first = make_seq(rng.integers(0, 100, 20).tolist(), answer, request_id=0, row=0)
    d.propose([first], [8])
    fresh = make_seq(rng.integers(0, 100, 20).tolist(), answer[:6], request_id=1, row=1)
    assert check(SuffixDrafter(None).propose([fresh], [8]), [8])[0] == []   # nothing without the past
    first.finish_reason = "stop"
    d.commit([first], DraftProposal.empty(1), [0])
    d.commit([first], DraftProposal.empty(1), [0])        # added once
    assert len(d.glob.outputs) == 1 and d.glob.outputs[0].tolist() == answer
    assert main_path(check(d.propose([fresh], [8]), [8])[0]) == answer[6:12]   # depth: match length 6
    # the server's end-of-request hook moves a finished output too; the global index stays bounded
    for i in range(3):
        other = make_seq([1, 2, 3], [300 + i, 301 + i], request_id=2 + i, row=2)
        d.propose([other], [4])
        other.finish_reason = "length"
        state.reset(2)
    assert len(d.glob.outputs) == 2 and state.nbytes() > 0


def test_suffix_index_is_incremental_and_trees_are_valid():
    rng = np.random.default_rng(3)
    text = rng.integers(0, 12, 400).tolist()            # small alphabet: many repeats, many branches
    whole, grown = LocalIndex(), LocalIndex()
    whole.extend(text)
    for end in range(1, 401, 37):
        grown.extend(text[:end])
    grown.extend(text)
    assert grown.n == whole.n and grown.uni == whole.uni and grown.bi == whole.bi
    d = SuffixDrafter(None, suffix_spec_factor=4.0, suffix_min_prob=0.0)
    seqs = [make_seq(text[:100 + 50 * i], request_id=i, row=i) for i in range(4)]
    for budgets in ([0, 5, 32, 64], [0, 0, 0, 0], [64, 1, 0, 16]):
        rows = check(d.propose(seqs, budgets), budgets)
        assert all(rows[b] for b in range(4) if budgets[b]) and not any(rows[b] for b in range(4) if not budgets[b])
    assert SuffixDrafter(None).propose([make_seq([7])], [8]).num_tokens.tolist() == [0]


def test_propose_cost_for_32_nodes_on_a_2000_token_history():
    rng = np.random.default_rng(4)
    text = rng.integers(0, 500, 2000).tolist()
    text[-20:] = text[1000:1020]                          # a repeat so the suffix drafter has a match
    recycle, suffix = RecycleDrafter(None, recycle_topk=8), SuffixDrafter(None, suffix_spec_factor=4.0)
    s = make_seq(text)
    top = torch.from_numpy(rng.integers(0, 500, (1, 33, 8)))
    recycle.observe_topk([s], DraftProposal.from_trees([[(int(t), -1) for t in range(32)]]), top)
    for drafter in (recycle, suffix):
        drafter.propose([s], [32])                        # first call: warm-up / indexing of the prompt
        start = time.perf_counter()
        for i in range(50):
            s.token_ids.append(text[1020 + i])
            check(drafter.propose([s], [32]), [32])
        print(f"{drafter.name}: {(time.perf_counter() - start) / 50 * 1e3:.3f} ms per propose (32 nodes, "
              f"{len(s.token_ids)} tokens)")
        del s.token_ids[-50:]


def test_recycle_keeps_rows_distinct_when_given_repeats():
    d = RecycleDrafter(Stub, recycle_topk=4)
    s = make_seq([1, 2])
    d.observe_topk([s], DraftProposal.empty(1), torch.tensor([[[7, 7, 8, 7]]]))
    assert d.table[2].tolist() == [7, 8, -1, -1]
    assert children(check(d.propose([s], [8]), [8])[0], -1) == [7, 8]


def test_ngram_index_equals_the_scan():
    """The n-gram drafter's per-sequence index (extended by the tokens appended since the last
    step) finds exactly the match a scan of the whole text finds, also when the sequence it
    sees is cut back or another one."""
    import random

    import numpy as np

    from specdecode.drafters.ngram import NgramIndex, latest_match
    rng = random.Random(1)
    for trial in range(200):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        seq = [rng.randint(0, 4) for _ in range(rng.randint(1, 5))]
        index = NgramIndex(lo, hi)
        for step in range(30):
            assert index.match(seq) == latest_match(np.asarray(seq), lo, hi), (trial, step)
            seq = seq + [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
        for other in ([9] + seq[1:], seq[:5], seq):
            assert index.match(other) == latest_match(np.asarray(other), lo, hi)


def test_small_drafts_element_by_element_equal_the_array_paths(monkeypatch):
    """Suffix and recycle draft a few occurrences / nodes in plain Python (cheap right after a
    target pass); the trees are exactly those of their numpy paths."""
    import random

    from specdecode.drafters import recycle as recycle_mod
    from specdecode.drafters import suffix as suffix_mod

    rng = random.Random(1)
    suffix = suffix_mod.SuffixDrafter(None)
    for _ in range(3):
        suffix.glob.add([rng.randrange(12) for _ in range(150)])
    for _trial in range(60):
        loc = suffix_mod.LocalIndex()
        vocab = rng.choice([5, 20, 50])
        loc.extend([rng.randrange(vocab) for _ in range(rng.randrange(2, 200))])
        for budget in (1, 5, 32):
            monkeypatch.setattr(suffix_mod, "SMALL_OCCURRENCES", 0)
            arrays = suffix.draft(loc, budget)
            monkeypatch.setattr(suffix_mod, "SMALL_OCCURRENCES", 10 ** 9)
            assert suffix.draft(loc, budget) == arrays

    class Seq:
        def __init__(self, token: int) -> None:
            self.token_ids = [token]

    recycle = recycle_mod.RecycleDrafter(None)
    recycle._grow(300)
    for _ in range(2000):
        row = rng.sample(range(300), 8)
        cut = rng.randrange(9)
        recycle.table[rng.randrange(300)] = row[:cut] + [-1] * (8 - cut)
    seqs = [Seq(rng.randrange(300)) for _ in range(5)]
    recycle.warmed.update(seqs)
    for n in (1, 3, 8, 24):
        sizes = [rng.randrange(n + 1) for _ in seqs[1:]] + [n]
        monkeypatch.setattr(recycle_mod, "SMALL_FILL", 0)
        arrays = recycle.propose(seqs, sizes)
        monkeypatch.setattr(recycle_mod, "SMALL_FILL", 10 ** 9)
        small = recycle.propose(seqs, sizes)
        assert torch.equal(small.tokens, arrays.tokens) and torch.equal(small.tree_parents(), arrays.tree_parents())
        assert torch.equal(small.num_tokens, arrays.num_tokens)


def test_trees_that_are_all_chains_are_proposed_as_a_chain():
    """from_trees of rows whose every tree is a chain gives a chain proposal (no parents: the
    verifier's chain path, no tensor test in `simplified`); one real tree keeps the tree."""
    chains = DraftProposal.from_trees([[(5, -1), (6, 0), (7, 1)], [], [(9, -1)]])
    assert not chains.is_tree and chains.tokens.tolist() == [[5, 6, 7], [0, 0, 0], [9, 0, 0]]
    assert chains.num_tokens.tolist() == [3, 0, 1]
    tree = DraftProposal.from_trees([[(5, -1), (6, 0), (7, 0)], [(9, -1)]])
    assert tree.is_tree and tree.parents.tolist() == [[-1, 0, 0], [-1, 0, 1]]


def test_recycle_learns_the_same_table_on_both_paths():
    """observe_topk's list path (every step with distinct top-K rows) writes the table its array
    path writes: the roots' rows, then each drafted node's, a later row winning a repeated key."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(30):
        lists, arrays = RecycleDrafter(Stub, recycle_topk=4), RecycleDrafter(Stub, recycle_topk=4)
        arrays._observe_lists = lambda *a: False
        seqs = [make_seq([1, 2, 3, int(torch.randint(0, 60, (1,), generator=gen))]) for _ in range(2)]
        n = int(torch.randint(0, 4, (1,), generator=gen))
        drafts = [torch.randint(0, 60, (int(torch.randint(0, n + 1, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in seqs]
        proposal = DraftProposal.from_lists(drafts) if n else DraftProposal.empty(2)
        top = torch.stack([torch.stack([torch.randperm(60, generator=gen)[:4] for _ in range(proposal.k + 1)])
                           for _ in seqs])                                              # [2, k+1, 4] distinct
        for d in (lists, arrays):
            d.observe_topk(seqs, proposal, top)
        assert (lists.table == arrays.table).all(), trial
