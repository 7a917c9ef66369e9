"""Shadow drafts: a stateless drafter's drafts made while plain decoding runs, never verified,
scored against the tokens the sequence then emits (the draft budget's free measurement of every
size, engine/budget.py), and how often they may be made."""
from __future__ import annotations

import math
import time

SHADOW_SHARE = 0.01     # at most this share of plain decoding's time goes to shadow drafts (looking up
                        # drafts that are only scored, and scoring them): a costly lookup shadows every few
                        # steps (the embedded model's ngram shadows cost ~50 us of a 2.4 ms step: every third)


def shadow_period(shadow_seconds: float, step_seconds: float) -> int:
    """Steps between shadow drafts that cost `shadow_seconds` each (drafts and scoring), so that
    they take at most SHADOW_SHARE of steps of `step_seconds` (1: every step; the offline budget
    and the server's scheduler)."""
    return max(1, math.ceil(shadow_seconds / (SHADOW_SHARE * step_seconds))) if step_seconds > 0 else 1


class ShadowDrafts:
    """Drafts of a stateless drafter made while plain decoding runs, scored against what follows.
    What a shadow costs, its draft and its scoring (`spent`), is reported to the budget when it is
    scored (DraftBudget.observe_shadow_cost), which spaces shadows by it; with it the drafter's own
    time and nodes, a measurement of the drafting cost per node like a step's."""

    def __init__(self) -> None:
        # row -> (length when drafted, main path tokens, their node indices, nodes proposed)
        self.pending: dict[int, tuple[int, list[int], list[int], int]] = {}
        self.spent = 0.0         # seconds drafting and scoring the shadows since the last one was scored
        self.drafting = [0.0, 0, 0]     # of that, the drafter's own seconds, the rows and the nodes it drafted

    def propose(self, drafter, seqs, k: int) -> None:
        """Draft for the sequences with no shadow pending (scored along their main path)."""
        fresh = [s for s in seqs if s.row not in self.pending]
        if not fresh or k <= 0:
            return
        started = time.perf_counter()
        proposal = drafter.propose(fresh, [k] * len(fresh))
        drafted = time.perf_counter()
        counts = proposal.num_tokens.tolist()
        self.drafting = [self.drafting[0] + drafted - started, self.drafting[1] + len(fresh),
                         self.drafting[2] + sum(counts)]
        for s, (nodes, path), count in zip(fresh, proposal.main_paths(), counts):
            if nodes:
                self.pending[s.row] = (len(s.token_ids), path, nodes, count)
        self.spent += time.perf_counter() - started

    def score(self, seqs, budget) -> None:
        """Score every shadow whose outcome is known: a mismatch, its whole length emitted, or
        the sequence finished; `budget` (a DraftBudget, engine/budget.py) learns each one's outcome and cost."""
        if not self.pending:
            return
        started, scored = time.perf_counter(), 0
        for s in seqs:
            if s.row not in self.pending:
                continue
            start, path, nodes, proposed = self.pending[s.row]
            out = s.token_ids[start:]
            matched = next((i for i, (a, b) in enumerate(zip(path, out)) if a != b), min(len(path), len(out)))
            if matched < len(out) or len(out) >= len(path) or s.finished:
                budget.observe_shadow(proposed, matched, nodes)
                del self.pending[s.row]
                scored += 1
        self.spent += time.perf_counter() - started
        if scored:
            budget.observe_shadow_cost(self.spent / scored, *self.drafting)
            self.spent, self.drafting = 0.0, [0.0, 0, 0]
