"""Token Recycling (Luo et al. 2024, arXiv 2408.08696): a training-free tree drafter that reuses
the target's own top-k predictions.

Every target pass scores the root token and every draft node; the target's top-K successors at
each of those positions are "recycled" into an adjacency table: row t holds the K tokens the
target most recently ranked best after token t (best first). Each row is overwritten as a whole,
the most recent pass wins (the paper's update rule). Drafting is a gather: a static tree template
is grown breadth-first from the root token, a template node of rank r taking the r-th entry of its
parent token's row. A branch stops where the table has nothing (-1).

Data:
  * `table` -- np.int32 [vocab, K], -1 = empty; ~vocab * K * 4 bytes (49152 x 8: 1.5 MB, Qwen's
    151936 x 8: 4.9 MB). Grown on demand when the vocabulary is unknown (target=None, tests).
  * the template -- `template(K)`: parent / rank / depth arrays of MAX_TREE_NODES nodes, built once,
    best-first by the product of static rank priors (RANK_PRIOR: 0.6, 0.2, 0.1, 0.05, ...). The
    tree of a budget of n nodes is the template's first n nodes (a best-first order is
    prefix-closed and topological), so one template serves every budget; it comes out deep along
    rank 0 and wide near the root (32 nodes: depth 7, four children of the root).
  * a warm start -- at a sequence's first propose, every bigram (a, b) of its text fills the empty
    row of a with [b, -1, ...] (a point where the paper's table is still cold).

State: the table is shared by all requests -- learning the target's habits across requests is
the point of the method -- so it is not per-request state: `has_state=False`, propose needs no
commit (the server may draft for a row it does not speculate on), and the only per-sequence
record is a weak set of the sequences already used for a warm start. `prepare` returns a
`DrafterState` that only reports the table's bytes (reset / truncate leave the table alone).
Rows keep distinct tokens (a top-K is distinct; a warm row holds one token), so siblings drawn
from one row are distinct.
"""
from __future__ import annotations

import heapq
import weakref

import numpy as np
import torch

from ..tree import MAX_TREE_NODES
from .base import Drafter, DrafterCapabilities, DrafterError, DraftProposal
from .registry import register

SMALL_FILL = 256        # batch x nodes up to which a draft is filled node by node (_propose_small)
RANK_PRIOR = (0.6, 0.2, 0.1, 0.05, 0.025, 0.0125, 0.00625, 0.003125)   # rank r's assumed acceptance


def rank_prior(rank: int) -> float:
    return RANK_PRIOR[rank] if rank < len(RANK_PRIOR) else RANK_PRIOR[-1] * 0.5 ** (rank - len(RANK_PRIOR) + 1)


def template(k: int, n: int = MAX_TREE_NODES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Static tree of n nodes with up to k children per node, best-first by the product of rank
    priors along the path: (parent [n] (-1 = root), rank [n], depth [n] (1 = child of the root))."""
    parent, rank, depth, score = [], [], [], []
    heap = [(-rank_prior(0), 0, -1, 0)]          # (-score, tiebreak, parent node, rank)
    tie = 1
    while heap and len(parent) < n:
        neg, _, p, r = heapq.heappop(heap)
        i = len(parent)
        parent.append(p), rank.append(r), depth.append(1 if p < 0 else depth[p] + 1), score.append(-neg)
        nxt = [(-score[i] * rank_prior(0), i, 0)]                                # first child
        if r + 1 < k:
            nxt.append((-(score[p] if p >= 0 else 1.0) * rank_prior(r + 1), p, r + 1))   # next sibling
        for s, pp, rr in nxt:
            heapq.heappush(heap, (s, tie, pp, rr))
            tie += 1
    return (np.array(parent, dtype=np.int64), np.array(rank, dtype=np.int64), np.array(depth, dtype=np.int64))


class TableState:
    """`DrafterState` view of the shared table: bytes only (nothing per row to reset or cut)."""

    def __init__(self, drafter: RecycleDrafter) -> None:
        self.drafter = drafter

    def nbytes(self) -> int:
        return int(self.drafter.table.nbytes)

    def used_bytes(self) -> int:
        return self.nbytes()

    def reset(self, row: int) -> None:
        pass

    def truncate(self, row: int, length: int) -> None:
        pass


@register("recycle")
class RecycleDrafter(Drafter):
    capabilities = DrafterCapabilities(drafts_trees=True, needs_target_topk=8, relative_cost=0.005)

    def __init__(self, target=None, recycle_topk: int = 8, **_: object) -> None:
        if not isinstance(recycle_topk, int) or isinstance(recycle_topk, bool) or not 1 <= recycle_topk <= 32:
            raise DrafterError(f"recycle_topk must be an integer in [1, 32], got {recycle_topk!r}")
        self.k = recycle_topk
        self.capabilities = DrafterCapabilities(drafts_trees=True, needs_target_topk=recycle_topk,
                                                relative_cost=0.005)
        model = getattr(target, "model", None)
        vocab = int(getattr(model, "vocab_size", 0) or 0)
        self.table = np.full((vocab, self.k), -1, dtype=np.int32)          # [vocab, K]
        self.parent, self.rank, self.depth = template(self.k)               # [64] each
        self.parent_list, self.rank_list = self.parent.tolist(), self.rank.tolist()
        # template node indices grouped by depth: the fill goes level by level
        self.levels = [np.flatnonzero(self.depth == d) for d in range(1, int(self.depth.max()) + 1)]
        self.warmed: weakref.WeakSet = weakref.WeakSet()

    def memory(self) -> object:
        return self.table.copy()

    def restore(self, memory: object) -> None:
        self.table = memory.copy()

    def prepare(self, batch_size: int, max_len: int) -> TableState:
        return TableState(self)

    def _grow(self, max_id: int) -> None:
        if max_id >= self.table.shape[0]:
            extra = np.full((max(max_id + 1, 2 * self.table.shape[0]) - self.table.shape[0], self.k), -1, np.int32)
            self.table = np.concatenate([self.table, extra])

    def warm(self, token_ids: list[int]) -> None:
        """Bigrams (a, b) of a text fill empty rows: table[a] = [b, -1, ...] (the last b wins)."""
        ids = np.asarray(token_ids, dtype=np.int64)                                 # [L]
        if ids.size < 2:
            return
        self._grow(int(ids.max()))
        a, b = ids[:-1], ids[1:]                                                    # [L-1] each
        empty = self.table[a, 0] < 0
        self.table[a[empty], 0] = b[empty]

    def prefill(self, seqs) -> None:
        """The warm start now (prefill time), not in the first draft: a one-time cost there would
        make drafting look dear to the draft budget."""
        self._warm_new(seqs)

    def _warm_new(self, seqs) -> None:
        for s in seqs:
            if s not in self.warmed:
                self.warm(s.token_ids)
                self.warmed.add(s)

    def propose(self, seqs, sizes):
        batch = len(seqs)
        self._warm_new(seqs)
        sizes = [min(int(k), MAX_TREE_NODES) for k in sizes]
        n = max(sizes, default=0)
        if n <= 0:
            return DraftProposal.from_trees([[] for _ in range(batch)])   # empty, still a tree
        roots = [s.token_ids[-1] for s in seqs]
        self._grow(max(roots))
        if batch * n <= SMALL_FILL:
            return self._propose_small(roots, sizes)
        budget = np.array(sizes, dtype=np.int64)                                   # [B]
        root = np.array(roots, dtype=np.int64)                                     # [B]
        vocab = self.table.shape[0]
        tok = np.full((batch, n), -1, dtype=np.int64)                              # [B, n] template fill
        for idx in self.levels:
            idx = idx[idx < n]
            if idx.size == 0:
                break
            p = self.parent[idx]                                                   # [m]
            ptok = np.where(p[None, :] < 0, root[:, None], tok[:, np.maximum(p, 0)])   # [B, m]
            cand = self.table[np.clip(ptok, 0, vocab - 1), self.rank[idx][None, :]].astype(np.int64)   # [B, m]
            cand[(ptok < 0) | (idx[None, :] >= budget[:, None])] = -1
            tok[:, idx] = cand
        return compact(tok, self.parent[:n])

    def _propose_small(self, roots: list[int], budget: list[int]) -> DraftProposal:
        """The template fill and compaction of `propose` node by node in Python, for a few nodes: right
        after a target pass each of the array path's numpy calls is dear, and together they cost a
        visible share of a small model's step, at every drafting step and every shadow draft
        (specdecode/engine/README.md, "Rules the code keeps"); this loop costs a fraction of that. Same
        trees (the template is topological: a node's parent comes before it)."""
        parent, rank = self.parent_list, self.rank_list
        rows = []
        for root, m in zip(roots, budget):
            toks, where, nodes = [-1] * m, [-1] * m, []        # template fill; node -> index kept
            for i in range(m):
                p = parent[i]
                above = root if p < 0 else toks[p]
                if above < 0:
                    continue
                t = int(self.table[above, rank[i]])
                if t >= 0:
                    toks[i], where[i] = t, len(nodes)
                    nodes.append((t, -1 if p < 0 else where[p]))
            rows.append(nodes)
        return DraftProposal.from_trees(rows)

    def observe_topk(self, seqs, proposal, topk_ids):
        """Overwrite the rows of the root and of every drafted node with the target's top-K."""
        if self._observe_lists(seqs, proposal, topk_ids):
            return
        top = topk_ids.detach().cpu().numpy().astype(np.int32)                    # [B, n+1, K']
        k = min(self.k, top.shape[2])
        root = np.array([s.token_ids[-1] for s in seqs], dtype=np.int64)          # [B]
        if proposal.k == 0:         # a plain step (most steps where recycling does not pay): the roots only
            keys, rows = root, top[:, 0, :k].copy()                                # [B], [B, k]
        else:
            tokens = proposal.tokens.cpu().numpy().astype(np.int64)[:, :top.shape[1] - 1]   # [B, n]
            live = np.arange(tokens.shape[1])[None, :] < proposal.num_tokens.cpu().numpy()[:, None]   # [B, n]
            keys = np.concatenate([root, tokens[live]])                            # [B + nodes]
            rows = np.concatenate([top[:, 0, :k], top[:, 1:tokens.shape[1] + 1, :k][live]])   # [B + nodes, k]
        if keys.size == 0:
            return
        srt = np.sort(rows, axis=1)
        for i in np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1)):        # keep rows distinct (a real
            first = np.unique(rows[i], return_index=True)[1]                     # top-k always is)
            rows[i] = np.pad(rows[i][np.sort(first)], (0, k - len(first)), constant_values=-1)
        self._grow(int(max(keys.max(), rows.max())))
        self.table[keys, :k] = rows
        self.table[keys, k:] = -1

    def _observe_lists(self, seqs, proposal, topk_ids) -> bool:   # topk_ids: [B, n+1, K']
        """observe_topk in a few Python operations: it runs at every step, right after a target pass
        that left the caches cold, where each numpy call of its array path is dear
        (specdecode/engine/README.md, "Rules the code keeps"). False (nothing written) where a row
        is not a distinct top-K, which the array path mends."""
        k = min(self.k, topk_ids.shape[2])
        top = topk_ids.tolist()                    # one conversion (torch slicing costs more)
        drafts = proposal.tokens.tolist() if proposal.k else None
        counts = proposal.num_tokens.tolist() if proposal.k else [0] * len(seqs)
        keys = [s.token_ids[-1] for s in seqs]     # the roots' rows, then each drafted node's (the array path's order)
        rows = [top[b][0][:k] for b in range(len(seqs))]
        for b in range(len(seqs)):
            for i in range(min(counts[b], len(top[b]) - 1)):
                keys.append(drafts[b][i])
                rows.append(top[b][i + 1][:k])
        if any(len(set(row)) != len(row) for row in rows):
            return False
        self._grow(max(max(keys), max(max(row) for row in rows)))
        pad = [-1] * (self.k - k)
        for key, row in zip(keys, rows):           # a later node's row wins, as the array path's
            self.table[key] = row + pad
        return True


def compact(tok: np.ndarray,        # [B, n] template tokens, -1 = missing
            parent: np.ndarray,     # [n] template parents
            ) -> DraftProposal:
    """Drop the missing template nodes (and so their subtrees) of each row, renumber parents,
    and pack the rows into a tree proposal (padding: token 0, chain parents, as `from_trees`)."""
    batch, n = tok.shape
    valid = tok >= 0                                                              # [B, n]
    # a node is valid only when its parent is: a missing parent leaves -1 in its children's fill
    new_index = np.cumsum(valid, axis=1) - 1                                      # [B, n] index after packing
    par = np.broadcast_to(parent, (batch, n))
    new_parent = np.where(par < 0, -1, np.take_along_axis(new_index, np.maximum(par, 0), axis=1))   # [B, n]
    order = np.argsort(~valid, axis=1, kind="stable")                             # valid nodes first, in order
    counts = valid.sum(axis=1)                                                    # [B]
    width = int(counts.max()) if batch else 0
    live = np.arange(width)[None, :] < counts[:, None]                            # [B, width]
    tokens = np.where(live, np.take_along_axis(tok, order[:, :width], axis=1), 0)
    parents = np.where(live, np.take_along_axis(new_parent, order[:, :width], axis=1),
                       np.arange(width)[None, :] - 1)
    return DraftProposal(torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(counts.astype(np.int64)),
                         None, parents=torch.from_numpy(parents.astype(np.int64)))
