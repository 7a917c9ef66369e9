"""Lookahead decoding (`lookahead`): the window is a tree whose ancestor paths are the paper's
attention pattern, the Jacobi step updates it from the target's top-1, the pool learns, the
proposal respects its budget, and greedy output through the engine equals plain decoding
(native and eager). Its sampled distribution is tested in test_e2e_sampling.py."""
import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.drafters.base import DrafterError
from specdecode.drafters.registry import build_drafter, method_names


class Seq:                       # the drafter keys its state by the sequence object (weakly)
    def __init__(self, ids):
        self.token_ids = list(ids)


def seq(ids):
    return Seq(ids)


def path_tokens(proposal, row, node):
    """Tokens on the path root -> node (node included)."""
    parents = proposal.tree_parents()[row].tolist()
    out = []
    while node >= 0:
        out.append(int(proposal.tokens[row, node]))
        node = parents[node]
    return out[::-1]


def test_window_is_a_tree_with_the_papers_visibility():
    drafter = build_drafter("lookahead", None, lookahead_window=4, lookahead_ngram=3, lookahead_candidates=0)
    s = seq(range(100, 140))
    proposal = drafter.propose([s], [64])
    cells = proposal.step_state[id(s)]
    window = drafter.requests[s].window                      # [levels][columns]
    assert len(cells) == 4 * 2 and int(proposal.num_tokens[0]) <= 8
    for (level, column), node in cells.items():
        # (l, i) sees level 0 of columns 0..i, then levels 1..l of column i: one token per position
        expected = [window[0][c] for c in range(column + 1)] + [window[lv][column] for lv in range(1, level + 1)]
        assert path_tokens(proposal, 0, node) == expected


def test_jacobi_step_fills_the_pool_and_shifts_the_window():
    drafter = build_drafter("lookahead", None, lookahead_window=3, lookahead_ngram=3, lookahead_candidates=2)
    s = seq([5, 6, 7, 8, 5, 6])
    proposal = drafter.propose([s], [64])
    state = drafter.requests[s]
    before = [list(level) for level in state.window]
    n = int(proposal.num_tokens[0])
    top = torch.full((1, n + 1, 1), 0, dtype=torch.long)
    cells = proposal.step_state[id(s)]
    for column in range(3):
        top[0, cells[(1, column)] + 1, 0] = 900 + column            # the target's token after the cell
    drafter.observe_topk([s], proposal, top)
    for column in range(3):
        assert state.window[0][column] == before[1][column] and state.window[1][column] == 900 + column
        assert (before[1][column], 900 + column) in state.pool[before[0][column]]
    # the prompt's 3-grams are candidates after their first token; the pool then follows the text
    assert (6, 7) in state.pool[5] and (7, 8) in state.pool[6]
    s.token_ids += [7, 8]
    nxt = drafter.propose([s], [64])
    assert [int(t) for t in nxt.tokens[0, :2]] == [5, 6]             # after 8: the 3-gram (8, 5, 6)


def test_budget_keeps_candidates_then_whole_columns():
    drafter = build_drafter("lookahead", None, lookahead_window=5, lookahead_ngram=4, lookahead_candidates=5)
    s = seq([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3, 7, 3])
    for budget in (0, 1, 2, 4, 7, 12, 64):
        proposal = drafter.propose([s], [budget])
        n = int(proposal.num_tokens[0])
        assert n <= budget
        cells = proposal.step_state[id(s)]
        columns = {c for _, c in cells}
        assert all((lv, c) in cells for c in columns for lv in range(3))   # whole columns only
    assert "lookahead" in method_names()


@pytest.mark.parametrize("options", [dict(lookahead_window=0), dict(lookahead_ngram=1), dict(lookahead_ngram=9),
                                     dict(lookahead_candidates=-1), dict(lookahead_window=16, lookahead_ngram=8),
                                     dict(lookahead_window="5")])
def test_bad_options(options):
    with pytest.raises(DrafterError, match="lookahead_"):
        build_drafter("lookahead", None, **options)


@pytest.mark.parametrize("fast", [True, False])
def test_greedy_output_equals_plain(tiny_models, fast):
    llm = LLM(model=str(tiny_models["llama"]), method="lookahead", num_speculative_tokens=30, adaptive=False,
              dtype="fp32", progress=False, fast=fast)
    prompts = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "1 2 3 4 5 6 7 8"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    spec = llm.generate(prompts, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert max(s.stats["mean_accepted_length"] for s in spec) > 1.0     # something was accepted
    assert all(s.stats["tree_nodes_mean"] > 5 for s in spec)
