"""Forced tokens as drafts (jump-forward): where a constrained row's grammar allows exactly one
continuation (specdecode/structured.py `Constraint.forced`), those tokens replace the row's drafts
for this step, as point masses; they are verified like any draft, so the output is unchanged."""
from __future__ import annotations

import torch

from ..drafters.base import DraftProposal
from ..structured import FORCED_MAX

__all__ = ["merge_forced", "FORCED_MAX"]


def merge_forced(seqs, proposal, room: list[int]):
    """(the proposal with each constrained row's forced tokens, if any, as its draft: a chain of
    point masses; the rows so replaced). Rows keep their own drafts otherwise."""
    forced = {b: s.constraint.forced(min(FORCED_MAX, room[b])) for b, s in enumerate(seqs)
              if getattr(s, "constraint", None) is not None}
    forced = {b: f for b, f in forced.items() if f}
    if not forced:
        return proposal, set()
    parents = proposal.tree_parents().tolist() if proposal.k else [[] for _ in seqs]
    rows = []
    for b in range(len(seqs)):
        if b in forced:
            rows.append([(t, i - 1) for i, t in enumerate(forced[b])])
        else:
            count = int(proposal.num_tokens[b])
            rows.append([(int(proposal.tokens[b, i]), parents[b][i]) for i in range(count)])
    merged = DraftProposal.from_trees(rows)
    if proposal.probs is not None:                  # keep the drafter's distributions; forced: one-hot
        probs = torch.zeros(len(seqs), merged.k, proposal.probs.shape[-1], dtype=proposal.probs.dtype,
                            device=proposal.probs.device)
        for b, nodes in enumerate(rows):
            if b in forced:
                probs[b, torch.arange(len(nodes)), torch.tensor([t for t, _ in nodes])] = 1.0
            elif nodes:
                probs[b, :len(nodes)] = proposal.probs[b, :len(nodes)]
        merged.probs = probs
    return (merged.simplified() if proposal.parents is None else merged), set(forced)
