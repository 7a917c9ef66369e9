"""Scheduling for offline generation: which rows run in a step and how many drafts each may carry.

`draft_room` is the rule every scheduler applies (the server's too, with a per-row k): a row
carries at most k drafts, capped so its output never passes max_tokens (the step always adds
one token of its own) and its cache never overflows the context.
"""
from __future__ import annotations

from .sequence import Sequence


def draft_room(s: Sequence, k: int, context: int) -> int:
    left_in_budget = s.params.max_tokens - s.num_output - 1
    left_in_context = context - len(s.token_ids)
    return max(0, min(k, left_in_budget, left_in_context))


class StaticBatch:
    """A fixed batch run to completion: every unfinished row runs each step with up to k drafts."""

    def __init__(self, seqs: list[Sequence], k: int, context: int) -> None:
        self.seqs = seqs
        self.k = k
        self.context = context            # positions a row may hold (its cache has `slack` more)

    def running(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    def room(self, seqs: list[Sequence]) -> list[int]:
        return [draft_room(s, self.k, self.context) for s in seqs]
