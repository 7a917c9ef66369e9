"""Lookahead decoding (`lookahead`): the window is a tree whose ancestor paths are the paper's
attention pattern, the Jacobi step updates it from the target's top-1, the pool learns, the
proposal respects its budget, and greedy output through the engine equals plain decoding
(native and eager). Its sampled distribution is tested in tests/engine/test_e2e_sampling.py."""
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
    cells = proposal.step_state[id(s)][0]
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
    cells = proposal.step_state[id(s)][0]
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
        cells = proposal.step_state[id(s)][0]
        columns = {c for _, c in cells}
        assert all((lv, c) in cells for c in columns for lv in range(3))   # whole columns only
    assert "lookahead" in method_names()


def test_window_left_out_while_it_does_not_pay():
    """A request whose window nodes are never accepted stops drafting them (yield below
    window_min_yield), except every WINDOW_PROBE-th step; window_min_yield=0 always drafts them."""
    from specdecode.drafters.lookahead import WINDOW_PROBE
    for min_yield, always in ((0.15, False), (0.0, True)):
        drafter = build_drafter("lookahead", None, lookahead_window=3, lookahead_ngram=3, lookahead_candidates=0,
                                window_min_yield=min_yield)
        s = seq(range(100, 140))
        with_window = []
        for _ in range(2 * WINDOW_PROBE):
            proposal = drafter.propose([s], [64])
            where, own, _ = proposal.step_state[id(s)]
            with_window.append(bool(where))
            assert own == set(range(int(proposal.num_tokens[0]))) if where else not own
            s.token_ids.append(1)                    # nothing drafted is accepted: one target token
            drafter.commit([s], proposal, [0])
        if always:
            assert all(with_window)
        else:
            assert with_window[0] and with_window.count(True) <= 4 and with_window[-1]   # probes go on
        state = drafter.requests[s]
        assert state.window_accepted == 1.0           # the prior only: nothing was accepted


def test_window_yield_counts_accepted_window_nodes():
    drafter = build_drafter("lookahead", None, lookahead_window=2, lookahead_ngram=3, lookahead_candidates=0)
    s = seq(range(100, 140))
    proposal = drafter.propose([s], [64])
    where, own, _ = proposal.step_state[id(s)]
    state = drafter.requests[s]
    nodes_before, accepted_before = state.window_nodes, state.window_accepted
    path = path_tokens(proposal, 0, where[(1, 0)])              # column 0's two cells, both accepted
    s.token_ids += path + [7]
    drafter.commit([s], proposal, [2])
    assert state.window_accepted == accepted_before + 2 and state.window_nodes == nodes_before + len(own)


@pytest.mark.parametrize("options", [dict(lookahead_window=0), dict(lookahead_ngram=1), dict(lookahead_ngram=9),
                                     dict(lookahead_candidates=-1), dict(lookahead_window=16, lookahead_ngram=8),
                                     dict(lookahead_window="5"), dict(window_min_yield=1.5),
                                     dict(window_min_yield="0.1")])
def test_bad_options(options):
    with pytest.raises(DrafterError, match="lookahead_|window_min_yield"):
        build_drafter("lookahead", None, **options)


@pytest.mark.parametrize("fast", [True, False])
def test_greedy_output_equals_plain(tiny_models, fast):
    llm = LLM(model=str(tiny_models["llama"]), method="lookahead", num_speculative_tokens=30, adaptive=False,
              dtype="fp32", progress=False, fast=fast, window_min_yield=0.0)     # the window every step
    prompts = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "1 2 3 4 5 6 7 8"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    spec = llm.generate(prompts, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert max(s.stats["mean_accepted_length"] for s in spec) > 1.0     # something was accepted
    assert all(s.stats["tree_nodes_mean"] > 5 for s in spec)
