"""EAGLE-2 dynamic draft trees (Li et al. 2024, arXiv 2406.16858), as pure functions of tensors.

A drafter that can score any prefix (an EAGLE head) grows its tree in two phases:

* **expand**: at depth 1 the root's top-K tokens are the candidates. At each further depth the
  K candidates of the previous depth with the best *score* (the cumulative draft log-probability
  of the path from the root: the drafter's estimate of the chance that the whole path is
  accepted) form the frontier; one batched drafter pass scores all K frontier nodes, and each
  contributes its own top-K children as candidates of the next depth. `Candidates` collects
  every candidate with its score, parent and depth.
* **rerank**: the tree is the `budget` candidates of best score over all depths
  (`select_nodes`). A child's score is below its parent's (a log-probability is <= 0, and a tiny
  depth penalty breaks ties), so the selection is closed under taking ancestors and, in score
  order, topological: it is a valid tree (specdecode/tree.py) whatever the budget.

Siblings are distinct (one node's top-K), as trees require. The tree is proposed as point masses
(`DraftProposal.probs` None): the tree verifier's point-mass rule keeps any target distribution
exactly, however the candidates were chosen (SpecInfer-style), so the same tree serves greedy and
sampled rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

DEPTH_PENALTY = 1e-4      # subtracted per depth from a candidate's score: a child ranks strictly below its parent


@dataclass
class Candidates:
    """Every candidate node of a batch so far, in the order they were added (depth by depth)."""

    tokens: list[torch.Tensor] = field(default_factory=list)    # per depth [B, C_d] int64 draft-vocab ids
    scores: list[torch.Tensor] = field(default_factory=list)    # per depth [B, C_d] float32 path log-prob
    parents: list[torch.Tensor] = field(default_factory=list)   # per depth [B, C_d] int64 global index, -1 root
    count: int = 0                                              # candidates added (the next global index)

    def add(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor) -> int:
        """Append one depth's candidates ([B, C] each); returns the global index of the first."""
        first = self.count
        self.tokens.append(tokens)
        self.scores.append(scores - DEPTH_PENALTY * len(self.scores))
        self.parents.append(parents)
        self.count += tokens.shape[1]
        return first


def expand(log_probs: torch.Tensor,        # [B, F, V] float32 next-token log-probs after each frontier node
           frontier_scores: torch.Tensor,  # [B, F] float32 the frontier nodes' path scores
           topk: int,
           ) -> tuple[torch.Tensor, torch.Tensor]:   # ([B, F*topk] tokens, [B, F*topk] scores)
    """Each frontier node's top-K children with their path scores (frontier node f's children at
    columns f*topk .. f*topk+topk-1)."""
    child_scores, child_tokens = log_probs.topk(topk, dim=-1)                    # [B, F, topk]
    child_scores = child_scores + frontier_scores[:, :, None]
    batch = log_probs.shape[0]
    return child_tokens.reshape(batch, -1), child_scores.reshape(batch, -1)


def select_nodes(candidates: Candidates,
                 budgets: list[int],       # nodes per row (0..)
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best `budgets[b]` candidates of each row as a tree: (tokens [B, n] draft-vocab ids,
    parents [B, n] (-1 = root; node order is score order, hence topological), num_nodes [B])
    with n = min(max(budgets), candidates)."""
    tokens = torch.cat(candidates.tokens, dim=1)                                  # [B, C]
    scores = torch.cat(candidates.scores, dim=1)                                  # [B, C]
    parents = torch.cat(candidates.parents, dim=1)                                # [B, C]
    batch, total = tokens.shape
    n = min(max(budgets, default=0), total)
    num_nodes = torch.tensor([min(b, n) for b in budgets], dtype=torch.long)
    if n == 0:
        empty = torch.zeros(batch, 0, dtype=torch.long)
        return empty, empty.clone(), num_nodes
    chosen = scores.topk(n, dim=1).indices                                        # [B, n] best first
    node_of = torch.full((batch, total), -1, dtype=torch.long)                   # candidate -> node
    node_of.scatter_(1, chosen, torch.arange(n).expand(batch, n).contiguous())
    parent_candidate = parents.gather(1, chosen)                                  # [B, n]
    node_parents = torch.where(parent_candidate < 0, -1, node_of.gather(1, parent_candidate.clamp(min=0)))
    live = torch.arange(n)[None, :] < num_nodes[:, None]
    # a live node's parent is live (it ranks higher); padding nodes point at the root
    node_parents = torch.where(live, node_parents, -1)
    if bool((live & (node_parents >= torch.arange(n)[None, :])).any()):
        raise AssertionError("dynamic tree selection is not topological")       # cannot happen (DEPTH_PENALTY)
    return tokens.gather(1, chosen), node_parents, num_nodes
