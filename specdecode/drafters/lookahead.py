"""Lookahead decoding (Fu et al., ICML 2024, arXiv 2402.02057): draft-free, the target fills an
n-gram pool by Jacobi iterations that ride along in the verification pass.

Per request there is a 2-D window of guesses, `lookahead_ngram - 1` levels x `lookahead_window`
columns, and a pool of n-grams keyed by their first token. Each step proposes ONE tree:
  1. verification branch: up to `lookahead_candidates` pool n-grams that start after the last
     committed token (most recent first), merged as a trie from the root;
  2. lookahead branch: the window. Cell (level l, column i) sits at position root + 1 + i + l and,
     in the paper's attention mask, sees the level-0 cells of columns 0..i and the cells of
     levels 1..l of column i: one token per position, i.e. the cell's ancestor path in a tree
     where (0, i)'s parent is (0, i-1) ((0, 0)'s is the root) and (l, i)'s is (l-1, i). So the
     window is itself a tree and the engine's tree pass computes it exactly as the paper's
     mask does; it is inserted into the same trie (a path the candidates already hold is shared,
     which keeps siblings distinct).
The tree verifier accepts the longest path the target agrees with (window cells are point-mass
drafts too: accepting one is as lossless as any draft). The target's top-1 after each cell of the
last level, which every target pass computes anyway (`observe_topk`), is the Jacobi update: for
column i the n-gram (level 0..N-2 of column i, new token) goes into the pool, the levels shift
down and the new tokens become the last level. The pool also holds the n-grams of the request's
own text (the prompt's, then the output's as it grows: what plain steps still teach it).

Nodes come best-first (candidates, then window columns left to right), so a budget smaller than
the whole tree (the adaptive draft size, `k`) keeps a prefix: the candidates, then as many whole
window columns as fit; the columns that were not verified are not updated that step.

The window is drafted only while it pays: every verified row costs a fraction of a target step on a
CPU (benchmarks/RESULTS.md, "Verify-pass cost"), so each request counts the tokens accepted on
window nodes (nodes the candidates did not already hold) per window node drafted, and leaves the
window out while that yield is below `window_min_yield` (default 0.15 tokens per node; 0 = always
draft it), except on every WINDOW_PROBE-th step, which keeps the Jacobi iteration moving. Without
the window the drafter is a lookup over its pool.

State: per request (keyed by the Sequence object in a WeakKeyDictionary, so it ends with the
request), window and pool; propose only catches the pool up with the text (idempotent: the server
may draft for a row it does not speculate on); observe_topk updates the window and the pool from
the proposal's own record of where each cell went.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np

from ..tree import MAX_TREE_NODES, walk_path
from .base import Drafter, DrafterCapabilities, DrafterError, DraftProposal
from .registry import register

POOL_PER_KEY = 16          # n-grams kept per first token (least recently seen dropped)
WINDOW_PROBE = 16          # a request whose window does not pay still drafts it every 16th step
WINDOW_PRIOR = (1.0, 4.0)  # (accepted tokens, window nodes) a request starts with: yield 0.25


class _Request:
    """One request's window ([levels][columns] token guesses) and n-gram pool."""

    def __init__(self, token_ids: list[int], levels: int, columns: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        ids = np.asarray(token_ids, dtype=np.int64)
        # the paper starts from tokens of the prompt at random
        self.window = [[int(t) for t in rng.choice(ids, columns)] for _ in range(levels)]
        self.pool: dict[int, OrderedDict] = {}
        self.n = levels + 1
        self.seen = 0                                      # text tokens whose n-grams are in the pool
        self.window_accepted, self.window_nodes = WINDOW_PRIOR   # the window's yield so far
        self.steps = 0
        self.catch_up(token_ids)

    def window_pays(self, min_yield: float) -> bool:
        self.steps += 1
        return self.steps % WINDOW_PROBE == 0 or self.window_accepted >= min_yield * self.window_nodes

    def catch_up(self, token_ids: list[int]) -> None:
        """The n-grams of the text that end after the last call (the prompt's, then the output's)."""
        for end in range(max(self.seen, self.n), len(token_ids) + 1):
            self.add(token_ids[end - self.n:end])
        self.seen = max(self.seen, len(token_ids))

    def add(self, gram: list[int]) -> None:
        grams = self.pool.setdefault(int(gram[0]), OrderedDict())
        key = tuple(int(t) for t in gram[1:])
        grams.pop(key, None)
        grams[key] = None                                  # most recent last
        if len(grams) > POOL_PER_KEY:
            grams.popitem(last=False)

    def candidates(self, token: int, count: int) -> list[tuple[int, ...]]:
        grams = self.pool.get(int(token))
        return list(reversed(grams))[:count] if grams else []


@register("lookahead")
class LookaheadDrafter(Drafter):
    capabilities = DrafterCapabilities(drafts_trees=True, needs_target_topk=1, relative_cost=0.005,
                                       commit_reads_nodes=True)

    def __init__(self, target=None, lookahead_window: int = 5, lookahead_ngram: int = 4,
                 lookahead_candidates: int = 5, window_min_yield: float = 0.15, **_: object) -> None:
        for name, value, low, high in (("lookahead_window", lookahead_window, 1, 16),
                                       ("lookahead_ngram", lookahead_ngram, 2, 8),
                                       ("lookahead_candidates", lookahead_candidates, 0, 16)):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise DrafterError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        if isinstance(window_min_yield, bool) or not isinstance(window_min_yield, (int, float)) \
                or not 0.0 <= window_min_yield <= 1.0:
            raise DrafterError(f"window_min_yield must be a number in [0, 1] (accepted tokens per window node), "
                               f"got {window_min_yield!r}")
        self.window_min_yield = float(window_min_yield)
        self.columns, self.levels, self.num_candidates = lookahead_window, lookahead_ngram - 1, lookahead_candidates
        if (self.columns + self.num_candidates) * self.levels > MAX_TREE_NODES:
            raise DrafterError(f"(lookahead_window + lookahead_candidates) * (lookahead_ngram - 1) must be <= "
                               f"{MAX_TREE_NODES} tree nodes, got {(self.columns + self.num_candidates) * self.levels}")
        self.requests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _state(self, seq) -> _Request:
        state = self.requests.get(seq)
        if state is None:
            state = self.requests[seq] = _Request(seq.token_ids, self.levels, self.columns, len(seq.token_ids))
        state.catch_up(seq.token_ids)
        return state

    def propose(self, seqs, sizes):
        trees, cells = [], {}
        for seq, budget in zip(seqs, sizes):
            state = self._state(seq)
            window = state.window_pays(self.window_min_yield)
            tree, where, own = self._tree(state, seq.token_ids[-1], min(int(budget), MAX_TREE_NODES), window)
            trees.append(tree)
            cells[id(seq)] = (where, own, len(seq.token_ids))
        proposal = DraftProposal.from_trees(trees)
        # per sequence (by id): {(level, column): node} for observe_topk, the window's own nodes and
        # the text's length when drafted (where commit finds the accepted tokens)
        proposal.step_state = cells
        return proposal

    def _tree(self, state: _Request, root: int, budget: int,
              window_too: bool = True) -> tuple[list[tuple[int, int]], dict, set]:
        """(token, parent) nodes of one row: the candidates' trie, then (window_too) whole window
        columns; also where each window cell went and the nodes only the window added."""
        nodes: list[tuple[int, int]] = []
        index: dict[tuple[int, int], int] = {}             # (parent, token) -> node
        own: set[int] = set()

        def insert(path: list[int]) -> int | None:         # the path's last node, None past the budget
            parent = -1
            for token in path:
                node = index.get((parent, token))
                if node is None:
                    if len(nodes) >= budget:
                        return None
                    node = index[(parent, token)] = len(nodes)
                    nodes.append((token, parent))
                parent = node
            return parent

        for gram in state.candidates(root, self.num_candidates):
            if insert(list(gram)) is None:
                break
        where: dict = {}
        first_window_node = len(nodes)
        if not window_too:
            return nodes, where, own
        window = state.window
        for column in range(self.columns):
            if len(nodes) + self.levels > budget:           # only whole columns (all levels) are drafted
                break
            base = [window[0][c] for c in range(column + 1)]
            for level in range(self.levels):
                node = insert(base + [window[lv][column] for lv in range(1, level + 1)])
                if node is None:
                    return nodes, where, set(range(first_window_node, len(nodes)))
                where[(level, column)] = node
        return nodes, where, set(range(first_window_node, len(nodes)))

    def observe_topk(self, seqs, proposal, topk_ids):
        """The Jacobi step: the target's top-1 after each verified column's last level."""
        cells = proposal.step_state
        if not cells:
            return
        top1 = topk_ids[..., 0].cpu().tolist()                                     # [B, n+1]
        last = self.levels - 1
        for seq, row in zip(seqs, top1):
            where, state = cells.get(id(seq), ({},))[0], self.requests.get(seq)
            if state is None or not where:
                continue
            window = state.window
            for column in range(self.columns):
                node = where.get((last, column))
                if node is None:
                    break
                new = int(row[node + 1])
                state.add([window[level][column] for level in range(self.levels)] + [new])
                for level in range(last):
                    window[level][column] = window[level + 1][column]
                window[last][column] = new

    def commit(self, seqs, proposal, num_accepted):
        """The window's yield: tokens accepted on nodes only the window added, per such node."""
        cells = proposal.step_state
        if not cells:
            return
        parents = proposal.tree_parents().tolist()
        tokens = proposal.tokens.tolist()
        for b, seq in enumerate(seqs):
            if id(seq) not in cells or self.requests.get(seq) is None:
                continue
            _, own, start = cells[id(seq)]
            if not own:
                continue
            path = seq.token_ids[start:start + num_accepted[b]]
            nodes = walk_path(parents[b][:int(proposal.num_tokens[b])], tokens[b], path) or []
            state = self.requests[seq]
            state.window_accepted += sum(node in own for node in nodes)
            state.window_nodes += len(own)
