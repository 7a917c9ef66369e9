"""Tests for specdecode.verify_tree: hand-built greedy trees, equivalence with the chain verifier,
the losslessness (distribution) test over several tree shapes, per-row generators, bad inputs."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

import specdecode.verify_tree as verify_tree_module
from specdecode.tree import chain_parents, depths
from specdecode.verify import PAD_TOKEN, verify
from specdecode.verify_tree import TreeVerifyResult, verify_tree

N_TRIALS = 100_000
P_VALUE_MIN = 1e-3
TV_MAX = 0.01
TV_NOISE_MAX = 0.004      # only assert TV < TV_MAX where an exact sampler's expected TV is below this
CHI2_MIN_SAMPLES = 1_000  # conditional cells with fewer samples are not checked


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Many small ops: one intra-op thread is faster on a shared CPU (see test_verify.py)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def one_hot(tokens, vocab):
    """[...] token ids -> [..., vocab] float32 one-hot (greedy target distributions)."""
    return torch.nn.functional.one_hot(torch.as_tensor(tokens), vocab).float()


def greedy_batch(rows, vocab=10):
    """Rows of (nodes [(token, parent)], argmaxes [len(nodes) + 1]: target argmax after the root,
    then after each node) -> draft_tokens [batch, n], parents [batch, n], num_draft [batch],
    one-hot target_probs [batch, n+1, vocab]; padding nodes are token 0 / chain parents."""
    n = max(len(nodes) for nodes, _ in rows)
    draft_tokens = torch.zeros(len(rows), n, dtype=torch.long)
    parents = chain_parents(len(rows), n)
    argmaxes = torch.zeros(len(rows), n + 1, dtype=torch.long)
    for b, (nodes, row_argmaxes) in enumerate(rows):
        assert len(row_argmaxes) == len(nodes) + 1
        for i, (token, parent) in enumerate(nodes):
            draft_tokens[b, i], parents[b, i] = token, parent
        argmaxes[b, :len(row_argmaxes)] = torch.tensor(row_argmaxes)
    num_draft = torch.tensor([len(nodes) for nodes, _ in rows])
    return draft_tokens, parents, num_draft, one_hot(argmaxes, vocab)


# ----------------------------------------------------------------------------- hand-built greedy

CHAIN = [(3, -1), (1, 0), (4, 1)]
STAR = [(5, -1), (6, -1), (7, -1), (8, -1)]
BINARY = [(1, -1), (2, -1), (3, 0), (4, 0), (5, 1), (6, 1)]   # root -> {0, 1}, 0 -> {2, 3}, 1 -> {4, 5}
GREEDY_CASES = [   # (nodes, target argmaxes, expected emitted tokens, expected accepted nodes)
    (CHAIN, [3, 1, 4, 9], [3, 1, 4, 9], [0, 1, 2]),           # all accepted + bonus
    (CHAIN, [3, 2, 4, 9], [3, 2], [0]),                       # second draft rejected -> recovered 2
    (STAR, [7, 0, 0, 2, 0], [7, 2], [2]),                     # third child, then its bonus
    (STAR, [9, 0, 0, 0, 0], [9], []),                         # no child matches -> recovered
    (BINARY, [2, 0, 6, 0, 0, 0, 7], [2, 6, 7], [1, 5]),       # right, right, bonus at a leaf
    (BINARY, [1, 9, 0, 0, 0, 0, 0], [1, 9], [0]),             # left, then no grandchild matches
    ([], [4], [4], []),                                       # a row without drafts
]


def check_greedy_cases(result, cases):
    for b, (_, _, expected_tokens, expected_nodes) in enumerate(cases):
        n = result.accepted_nodes.shape[1]
        assert result.num_accepted[b].item() == len(expected_nodes)
        assert result.num_emitted[b].item() == len(expected_tokens)
        assert result.tokens[b].tolist() == expected_tokens + [PAD_TOKEN] * (n + 1 - len(expected_tokens))
        assert result.accepted_nodes[b].tolist() == expected_nodes + [-1] * (n - len(expected_nodes))


@pytest.mark.parametrize("case", range(len(GREEDY_CASES)))
def test_greedy_single_tree(case):
    nodes, argmaxes, _, _ = GREEDY_CASES[case]
    draft_tokens, parents, num_draft, target_probs = greedy_batch([(nodes, argmaxes)])   # n = 0 for []
    result = verify_tree(draft_tokens, parents, num_draft, None, target_probs, torch.tensor([True]))
    assert isinstance(result, TreeVerifyResult)
    assert result.tokens.dtype == result.num_accepted.dtype == result.accepted_nodes.dtype == torch.int64
    check_greedy_cases(result, [GREEDY_CASES[case]])


def test_greedy_ragged_batch_and_sampled_rows_with_one_hot_targets():
    draft_tokens, parents, num_draft, target_probs = greedy_batch([(nodes, a) for nodes, a, _, _ in GREEDY_CASES])
    batch = len(GREEDY_CASES)
    result = verify_tree(draft_tokens, parents, num_draft, None, target_probs, torch.ones(batch, dtype=torch.bool))
    check_greedy_cases(result, GREEDY_CASES)
    # Sampled rows with one-hot targets and point-mass drafts accept with probability 0 or 1.
    sampled = verify_tree(draft_tokens, parents, num_draft, None, target_probs,
                          torch.zeros(batch, dtype=torch.bool), torch.Generator().manual_seed(0))
    check_greedy_cases(sampled, GREEDY_CASES)
    # Greedy rows ignore draft_probs and randomness; mixed with sampled rows they are unchanged.
    draft_probs = torch.rand(batch, draft_tokens.shape[1], 10)
    mixed = verify_tree(draft_tokens, parents, num_draft, draft_probs, target_probs,
                        torch.arange(batch) % 2 == 0, [torch.Generator().manual_seed(b) for b in range(batch)])
    check_greedy_cases(TreeVerifyResult(mixed.tokens[::2], mixed.num_accepted[::2], mixed.num_emitted[::2],
                                        mixed.accepted_nodes[::2]), GREEDY_CASES[::2])


def test_verify_greedy_lists_equals_verify_tree_on_argmaxes():
    """The all-greedy fast path reads only the target's argmax: the hand-built cases, and random
    trees and chains (ragged, with padding) give exactly verify_tree's result, as the lists the
    engine reads."""
    from specdecode.verify_tree import verify_greedy_lists
    draft_tokens, parents, num_draft, target_probs = greedy_batch([(nodes, a) for nodes, a, _, _ in GREEDY_CASES])
    paths, emitted = verify_greedy_lists(draft_tokens.tolist(), parents.tolist(), num_draft.tolist(),
                                         target_probs.argmax(-1).tolist())
    assert [(e, p) for e, p in zip(emitted, paths)] == [(t, n) for _, _, t, n in GREEDY_CASES]
    gen = torch.Generator().manual_seed(7)
    for trial in range(200):
        batch, n, vocab = 3, int(torch.randint(0, 9, (1,), generator=gen)), 4
        tokens = torch.randint(0, vocab, (batch, n), generator=gen)
        parents = torch.stack([torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)],
                                            dtype=torch.long) for _ in range(batch)]) if n else chain_parents(batch, 0)
        for b in range(batch):                    # siblings distinct: keep the first of equal tokens
            for i in range(n):
                if any(parents[b, j] == parents[b, i] and tokens[b, j] == tokens[b, i] for j in range(i)):
                    tokens[b, i] = -1
        keep = [[(int(t), int(p)) for t, p in zip(tokens[b], parents[b])] for b in range(batch)]
        rows = []
        for nodes in keep:                          # drop nodes marked -1 and their subtrees, renumber
            where, kept = {}, []
            for i, (t, p) in enumerate(nodes):
                if t >= 0 and (p < 0 or p in where):
                    where[i] = len(kept)
                    kept.append((t, where[p] if p >= 0 else -1))
            rows.append(kept)
        argmaxes = [torch.randint(0, vocab, (len(r) + 1,), generator=gen).tolist() for r in rows]
        d, par, num, probs = greedy_batch(list(zip(rows, argmaxes)), vocab)
        expected = verify_tree(d, par, num, None, probs, torch.ones(batch, dtype=torch.bool))
        for links in (par, None) if all(all(p == i - 1 for i, (_, p) in enumerate(r)) for r in rows) else (par,):
            paths, emitted = verify_greedy_lists(d.tolist(), None if links is None else links.tolist(), num.tolist(),
                                                 probs.argmax(-1).tolist())      # what the engine reads
            for b, (path, out) in enumerate(zip(paths, emitted)):
                n = int(expected.num_accepted[b])
                assert path == expected.accepted_nodes[b, :n].tolist(), (trial, b)
                assert out == expected.tokens[b, :n + 1].tolist(), (trial, b)


def test_verify_drafts_chooses_the_verifier_by_its_input():
    """The engine's one entry point: greedy rows from the argmax alone; point masses at each row's
    position uniforms (a sampled row's token is plain decoding's with that seed); draft
    distributions by rejection sampling, where a sampled row without drafts takes plain decoding's
    token and leaves its generator alone."""
    from specdecode.sampling import position_uniforms, sample_at
    from specdecode.verify_tree import verify_drafts, verify_greedy_lists
    cases = GREEDY_CASES[:3]
    d, par, num, probs = greedy_batch([(nodes, a) for nodes, a, _, _ in cases])
    gens = [torch.Generator().manual_seed(b) for b in range(len(cases))]
    greedy = verify_drafts(d, par, num, None, None, probs.argmax(-1), [True] * len(cases), gens, [0] * 3, [0] * 3)
    assert greedy == verify_greedy_lists(d.tolist(), par.tolist(), num.tolist(), probs.argmax(-1).tolist())
    flat = torch.full((2, 3, 10), 0.1)                                  # a sampled row's uniform target
    tokens = torch.tensor([[4, 4], [0, 0]])
    seeds, positions = [7, 9], [20, 30]
    paths, emitted = verify_drafts(tokens, None, torch.tensor([2, 0]), None, flat, None, [False, False],
                                   gens[:2], seeds, positions)
    for b in range(2):                   # each emitted token is plain decoding's at its position (then padding)
        out = emitted[b][:len(paths[b]) + 1]
        u = position_uniforms(seeds[b], positions[b], len(out))
        plain = [int(sample_at(flat[b, :1], torch.tensor([[x]], dtype=torch.float64))[0]) for x in u]
        assert out == plain and paths[b] == list(range(len(paths[b])))
    before = gens[1].get_state()
    draft_probs = torch.full((2, 2, 10), 0.1)
    paths, emitted = verify_drafts(tokens, None, torch.tensor([2, 0]), draft_probs, flat, None, [False, False],
                                   gens[:2], seeds, positions)
    u = torch.tensor([position_uniforms(seeds[1], positions[1], 1)], dtype=torch.float64)
    assert emitted[1][:1] == [int(sample_at(flat[1, :1], u)[0])] and paths[1] == []
    assert torch.equal(gens[1].get_state(), before)


# ----------------------------------------------------------------------------- chain equivalence


def random_chain_inputs(seed, batch=24, k=5, vocab=12):
    gen = torch.Generator().manual_seed(seed)
    target_probs = torch.randn(batch, k + 1, vocab, generator=gen).mul(1.5).softmax(-1)
    draft_probs = torch.randn(batch, k, vocab, generator=gen).mul(1.5).softmax(-1)
    draft_probs = 0.5 * draft_probs + 0.5 * target_probs[:, :k]          # accept often, reject sometimes
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    greedy = torch.rand(batch, generator=gen) < 0.3
    return draft_tokens, num_draft, draft_probs, target_probs, greedy


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_probs", "point_mass"])
@pytest.mark.parametrize("generator_kind", ["per_row", "single"])
@pytest.mark.parametrize("all_sampled", [False, True])
def test_chain_parents_equal_verify(point_mass, generator_kind, all_sampled):
    draft_tokens, num_draft, draft_probs, target_probs, greedy = random_chain_inputs(seed=20 + point_mass)
    batch, k = draft_tokens.shape
    if all_sampled:
        greedy = torch.zeros(batch, dtype=torch.bool)
    if point_mass:
        draft_probs = None

    def generators():
        if generator_kind == "single":
            return torch.Generator().manual_seed(7)
        return [torch.Generator().manual_seed(100 + b) for b in range(batch)]

    expected = verify(draft_tokens, num_draft, draft_probs, target_probs, greedy, generators())
    for parents in (chain_parents(batch, k), None):
        result = verify_tree(draft_tokens, parents, num_draft, draft_probs, target_probs, greedy, generators())
        assert torch.equal(result.tokens, expected.tokens)
        assert torch.equal(result.num_accepted, expected.num_accepted)
        assert torch.equal(result.num_emitted, expected.num_emitted)
        depth = torch.arange(k)
        assert torch.equal(result.accepted_nodes, torch.where(depth < expected.num_accepted[:, None], depth, -1))
    assert 0 < expected.num_accepted.float().mean() < k                   # both accepts and rejects happen


# ----------------------------------------------------------------------------- distribution

TREE_SHAPES = {
    "star3": [-1, -1, -1],
    "depth2": [-1, -1, 0, 0, 1],     # root -> {0, 1}, 0 -> {2, 3}, 1 -> {4}
    "chain3": [-1, 0, 1],
}


def random_distributions(shape, vocab, gen, zeros=True):
    """[*shape, vocab] random distributions; with zeros, one random token of each has probability 0."""
    probs = torch.randn(*shape, vocab, generator=gen).mul(1.5).softmax(-1)
    if zeros:
        zero = torch.randint(0, vocab, (*shape, 1), generator=gen)
        probs = probs.scatter(-1, zero, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def run_trees(parents_list, vocab, point_mass, seed, trials=N_TRIALS):
    """`trials` independent verifications of one tree shape, batched as rows, one Generator.

    The target is a depth-dependent Markov chain: after the root it is `tables[0][0]`, after a
    node of depth d carrying token x it is `tables[d][x]` (every node's distribution differs).
    Point-mass drafts: the same tokens in every trial, each sibling group the most likely tokens
    of its parent's target. Sampled drafts: per trial and
    sibling group a random draft distribution and the children drawn from it without replacement.
    Returns (result, draft_tokens, parents, tables)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(parents_list)
    parents = torch.tensor(parents_list).expand(trials, n)                      # [trials, n]
    node_depths = depths(parents[:1])[0]                                        # [n]
    tables = random_distributions((int(node_depths.max()) + 1, vocab), vocab, gen)   # [depth+1, vocab, vocab]
    draft_tokens = torch.zeros(trials, n, dtype=torch.long)                     # [trials, n]
    draft_probs = None if point_mass else torch.zeros(trials, n, vocab)        # [trials, n, vocab]
    for parent in sorted(set(parents_list)):
        group = [i for i, p in enumerate(parents_list) if p == parent]         # siblings
        if point_mass:   # the parent's most likely tokens (the parent's token is fixed too)
            parent_probs = tables[0, 0] if parent < 0 else tables[node_depths[parent], draft_tokens[0, parent]]
            draft_tokens[:, group] = parent_probs.topk(len(group)).indices
        else:
            sibling_probs = random_distributions((trials,), vocab, gen, zeros=False)   # [trials, vocab]
            draft_tokens[:, group] = torch.multinomial(sibling_probs, len(group), replacement=False, generator=gen)
            draft_probs[:, group] = sibling_probs.unsqueeze(1)
    target_probs = torch.empty(trials, n + 1, vocab)                            # [trials, n+1, vocab]
    target_probs[:, 0] = tables[0, 0]
    target_probs[:, 1:] = tables[node_depths, draft_tokens]
    result = verify_tree(draft_tokens, parents, torch.full((trials,), n), draft_probs, target_probs,
                         torch.zeros(trials, dtype=torch.bool), gen)
    return result, draft_tokens, parents, tables


def expected_tv_noise(probs: torch.Tensor, n: int) -> float:
    """E[TV(empirical, probs)] of an exact sampler with n draws (normal approximation)."""
    p = probs.double()
    return (p * (1 - p) / (2 * math.pi * n)).sqrt().sum().item()


def distribution_check(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """(chi-square p-value, total variation, samples outside the support) of tokens [m] ~ probs."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    probs = probs.double() / probs.double().sum()
    m = counts.sum().item()
    outside = int(counts[probs == 0].sum().item())
    tv = 0.5 * (counts / m - probs).abs().sum().item()
    expected = probs * m
    big = expected >= 5                                   # merge the small cells into one
    observed_cells = counts[big].tolist() + [counts[~big & (probs > 0)].sum().item()]
    expected_cells = expected[big].tolist() + [expected[~big].sum().item()]
    if expected_cells[-1] < 5:                            # too small even merged: drop it
        observed_cells, expected_cells = observed_cells[:-1], expected_cells[:-1]
    if len(observed_cells) < 2:
        return 1.0, tv, outside
    scale = sum(observed_cells) / sum(expected_cells)
    return float(chisquare(observed_cells, [e * scale for e in expected_cells]).pvalue), tv, outside


def check_lossless(result, draft_tokens, parents, tables):
    """First emitted token ~ target after the root; the token at position j (j >= 1, the token
    before it accepted) given that token x ~ tables[j][x]. Returns the number of checked cells."""
    trials, n = draft_tokens.shape
    tokens, num_emitted, accepted_nodes = result.tokens, result.num_emitted, result.accepted_nodes
    # Structure: the accepted nodes form a root path and carry the emitted tokens.
    previous = torch.full((trials,), -1)
    for depth in range(n):
        on_path = accepted_nodes[:, depth] >= 0
        assert torch.equal(on_path, result.num_accepted > depth)
        node = accepted_nodes[on_path, depth]
        assert torch.equal(parents[on_path, node], previous[on_path])
        assert torch.equal(draft_tokens[on_path, node], tokens[on_path, depth])
        previous = torch.where(on_path, accepted_nodes[:, depth], previous)
    checked = 0
    cells = [(tokens[:, 0], tables[0, 0])]
    for position in range(1, tables.shape[0]):               # deeper positions never exist
        emitted = num_emitted > position
        for token in range(tables.shape[-1]):
            after = emitted & (tokens[:, position - 1] == token)
            cells.append((tokens[after, position], tables[position, token]))
    for samples, probs in cells:
        if samples.numel() < CHI2_MIN_SAMPLES:
            continue
        p_value, tv, outside = distribution_check(samples, probs)
        assert outside == 0, f"{outside} tokens outside the target's support"
        assert p_value > P_VALUE_MIN, f"chi-square p={p_value:.2e} (n={samples.numel()}, tv={tv:.4f})"
        if expected_tv_noise(probs, samples.numel()) <= TV_NOISE_MAX:
            assert tv < TV_MAX, f"TV={tv:.4f} (n={samples.numel()})"
        checked += 1
    return checked


@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled", "point_mass"])
@pytest.mark.parametrize("shape", list(TREE_SHAPES))
def test_output_distribution_equals_target(shape, point_mass):
    seed = 1000 + 10 * list(TREE_SHAPES).index(shape) + point_mass
    result, draft_tokens, parents, tables = run_trees(TREE_SHAPES[shape], 7, point_mass, seed)
    assert expected_tv_noise(tables[0, 0], N_TRIALS) <= TV_NOISE_MAX        # position 0's TV is asserted
    checked = check_lossless(result, draft_tokens, parents, tables)
    assert checked >= (3 if point_mass else 6)                              # later positions were checked too
    assert 0 < result.num_accepted.float().mean() < depths(parents[:1]).max()


def test_draft_equal_to_target_accepts_first_child_without_nan():
    gen = torch.Generator().manual_seed(30)
    trials, vocab, parents_list = 2_000, 7, TREE_SHAPES["depth2"]
    target_probs = random_distributions((1, len(parents_list) + 1), vocab, gen).expand(trials, -1, -1)
    parents = torch.tensor(parents_list).expand(trials, -1)
    draft_probs = target_probs[:, (parents[0] + 1).tolist()]                # each node drawn from its parent's target
    draft_tokens = torch.zeros(trials, len(parents_list), dtype=torch.long)
    for parent in sorted(set(parents_list)):
        group = [i for i, p in enumerate(parents_list) if p == parent]
        draft_tokens[:, group] = torch.multinomial(target_probs[:, parent + 1], len(group), generator=gen)
    result = verify_tree(draft_tokens, parents, torch.full((trials,), 5), draft_probs, target_probs,
                         torch.zeros(trials, dtype=torch.bool), gen)
    assert (result.accepted_nodes[:, :2] == torch.tensor([0, 2])).all()    # first child at every level
    assert (result.tokens[:, 2] >= 0).all() and target_probs[0, 3][result.tokens[:, 2]].min() > 0


@pytest.mark.parametrize("broken, point_mass", [("_residual_probs", True), ("_remove_tried", False)])
def test_negative_control_broken_verifier_is_detected(broken, point_mass, monkeypatch):
    """Without the residual (point masses), or treating siblings as drawn with replacement
    (sampled drafts), the first emitted token over-weights drafted tokens: the test catches it."""
    seed = 1000 + point_mass                                                 # star3 of the test above
    monkeypatch.setattr(verify_tree_module, broken, lambda probs, _: probs)
    result, _, _, tables = run_trees(TREE_SHAPES["star3"], 7, point_mass, seed)
    p_value, tv, _ = distribution_check(result.tokens[:, 0], tables[0, 0])
    assert p_value < P_VALUE_MIN and tv > TV_MAX


# ----------------------------------------------------------------------------- generators, inputs


def test_per_row_generators_row_depends_only_on_its_inputs():
    gen = torch.Generator().manual_seed(40)
    vocab = 9
    shapes = [TREE_SHAPES["depth2"], TREE_SHAPES["star3"], [], TREE_SHAPES["chain3"], [-1, 0, 0, -1]]

    def row(parents_list):
        n = len(parents_list)
        target = random_distributions((n + 1,), vocab, gen)
        draft = random_distributions((n,), vocab, gen, zeros=False)
        tokens = torch.randperm(vocab, generator=gen)[:n]                    # distinct: fine for siblings
        return parents_list, target, draft, tokens

    rows = [row(shape) for shape in shapes]

    def run(order, n_pad, greedy_rows=()):
        batch = len(order)
        target_probs = one_hot(torch.zeros(batch, n_pad + 1, dtype=torch.long), vocab)
        draft_probs = torch.full((batch, n_pad, vocab), 1.0 / vocab)
        draft_tokens = torch.full((batch, n_pad), -1)
        parents = chain_parents(batch, n_pad)
        for b, r in enumerate(order):
            parents_list, target, draft, tokens = rows[r]
            n = len(parents_list)
            target_probs[b, :n + 1], draft_probs[b, :n], draft_tokens[b, :n] = target, draft, tokens
            parents[b, :n] = torch.tensor(parents_list, dtype=torch.long)
        num_draft = torch.tensor([len(rows[r][0]) for r in order])
        greedy = torch.tensor([r in greedy_rows for r in order])
        generators = [torch.Generator().manual_seed(500 + r) for r in order]
        result = verify_tree(draft_tokens, parents, num_draft, draft_probs, target_probs, greedy, generators)
        return {r: (result.tokens[b, :result.num_emitted[b]].tolist(),
                    result.accepted_nodes[b, :len(rows[r][0])].tolist())
                for b, r in enumerate(order) if r not in greedy_rows}

    full = run([0, 1, 2, 3, 4], 5)
    assert full == run([0, 1, 2, 3, 4], 5)                                   # reproducible
    assert run([4, 3, 2, 1, 0], 8) == full                                   # order and padding independent
    assert run([0, 1, 2, 3, 4], 5, greedy_rows=(1, 3)) == {r: full[r] for r in (0, 2, 4)}
    for r in range(len(rows)):
        assert run([r], max(1, len(rows[r][0])))[r] == full[r]               # alone == in a batch


BAD_INPUTS = {   # name -> (keyword overrides, parameter the message must name)
    "tokens_1d": (dict(draft_tokens=torch.zeros(3, dtype=torch.long)), "draft_tokens"),
    "token_out_of_vocab": (dict(draft_tokens=torch.tensor([[1, 2, 9]])), "draft_tokens"),
    "parents_shape": (dict(parents=torch.tensor([[-1, 0]])), "parents"),
    "parent_not_earlier": (dict(parents=torch.tensor([[-1, 2, 0]])), "parents"),
    "parent_below_root": (dict(parents=torch.tensor([[-1, -3, 0]])), "parents"),
    "num_draft_too_big": (dict(num_draft=torch.tensor([4])), "num_draft"),
    "num_draft_batch": (dict(num_draft=torch.tensor([3, 3])), "num_draft"),
    "target_positions": (dict(target_probs=torch.rand(1, 3, 5)), "target_probs"),
    "draft_probs_vocab": (dict(draft_probs=torch.rand(1, 3, 6)), "draft_probs"),
    "greedy_batch": (dict(greedy=torch.tensor([False, True])), "greedy"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_naming_the_parameter(case):
    inputs = dict(draft_tokens=torch.tensor([[1, 2, 3]]), parents=torch.tensor([[-1, -1, 0]]),
                  num_draft=torch.tensor([3]), draft_probs=None, target_probs=torch.rand(1, 4, 5),
                  greedy=torch.tensor([False]))
    verify_tree(**inputs)                                                    # the unmodified inputs are fine
    overrides, parameter = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=parameter):
        verify_tree(**{**inputs, **overrides})


def test_padding_nodes_are_ignored():
    # Node 2 is padding: its token is out of the vocabulary and its parent is invalid.
    result = verify_tree(torch.tensor([[1, 2, 99]]), torch.tensor([[-1, -1, 5]]), torch.tensor([2]), None,
                         one_hot([[2, 3, 4, 0]], 5), torch.tensor([True]))
    assert result.tokens.tolist() == [[2, 4, PAD_TOKEN, PAD_TOKEN]]
    assert result.accepted_nodes.tolist() == [[1, -1, -1]]
