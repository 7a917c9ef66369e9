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

State: per request (keyed by the Sequence object in a WeakKeyDictionary, so it ends with the
request), window and pool; propose only catches the pool up with the text (idempotent: the server
may draft for a row it does not speculate on); observe_topk updates the window and the pool from
the proposal's own record of where each cell went.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np

from ..tree import MAX_TREE_NODES
from .base import DraftProposal, Drafter, DrafterCapabilities, DrafterError
from .registry import register

POOL_PER_KEY = 16          # n-grams kept per first token (least recently seen dropped)


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
        self.catch_up(token_ids)

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
    capabilities = DrafterCapabilities(drafts_trees=True, needs_target_topk=1, relative_cost=0.005)

    def __init__(self, target=None, lookahead_window: int = 5, lookahead_ngram: int = 4,
                 lookahead_candidates: int = 5, **_: object) -> None:
        for name, value, low, high in (("lookahead_window", lookahead_window, 1, 16),
                                       ("lookahead_ngram", lookahead_ngram, 2, 8),
                                       ("lookahead_candidates", lookahead_candidates, 0, 16)):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise DrafterError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
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

    def propose(self, seqs, max_tokens):
        trees, cells = [], {}
        for seq, budget in zip(seqs, max_tokens):
            tree, where = self._tree(self._state(seq), seq.token_ids[-1], min(int(budget), MAX_TREE_NODES))
            trees.append(tree)
            cells[id(seq)] = where
        proposal = DraftProposal.from_trees(trees)
        proposal.step_state = cells      # per sequence (by id) {(level, column): node}, read by observe_topk
        return proposal

    def _tree(self, state: _Request, root: int, budget: int) -> tuple[list[tuple[int, int]], dict]:
        """(token, parent) nodes of one row: the candidates' trie, then whole window columns."""
        nodes: list[tuple[int, int]] = []
        index: dict[tuple[int, int], int] = {}             # (parent, token) -> node

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
        where = {}
        window = state.window
        for column in range(self.columns):
            if len(nodes) + self.levels > budget:           # only whole columns (all levels) are drafted
                break
            base = [window[0][c] for c in range(column + 1)]
            for level in range(self.levels):
                node = insert(base + [window[lv][column] for lv in range(1, level + 1)])
                if node is None:
                    return nodes, where
                where[(level, column)] = node
        return nodes, where

    def observe_topk(self, seqs, proposal, topk_ids):
        """The Jacobi step: the target's top-1 after each verified column's last level."""
        cells = proposal.step_state
        if not cells:
            return
        top1 = topk_ids[..., 0].cpu().tolist()                                     # [B, n+1]
        last = self.levels - 1
        for seq, row in zip(seqs, top1):
            where, state = cells.get(id(seq)), self.requests.get(seq)
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
