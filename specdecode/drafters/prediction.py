"""Drafts from a prediction of the answer (OpenAI's Predicted Outputs; a file being edited):
speculative edits. The answer is expected to repeat most of the prediction, with changes here
and there. Each step the answer's last tokens are looked up in the prediction and the tokens
that follow there are drafted, so after an edited line the drafts re-align to the prediction as
soon as the answer's last few tokens occur in it again.

Which occurrence: the last `n` tokens (n from MAX_N down to MIN_N) may occur several times in a
prediction (code repeats `return x`); the occurrence closest to where the answer is expected to
be (as far into the prediction as the answer is long, shifted by the last alignment's drift) is
taken; the drift of the last alignment is kept as that hint, nothing else (point masses, no
per-request state a drafter must commit).
"""
from __future__ import annotations

import difflib

MIN_N, MAX_N = 1, 8


class PredictionIndex:
    """A prediction's n-grams -> the positions right after each occurrence."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = list(ids)
        self.after: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(MIN_N, MAX_N + 1)}
        for n in range(MIN_N, MAX_N + 1):
            table = self.after[n]
            for end in range(n, len(self.ids) + 1):
                table.setdefault(tuple(self.ids[end - n:end]), []).append(end)
        self.drift = 0                 # where the last alignment put the answer, minus its length

    def draft(self, output: list[int], k: int) -> list[int]:
        """Up to k tokens of the prediction that should follow `output` (the answer so far)."""
        if k <= 0 or not self.ids:
            return []
        if not output:
            return self.ids[:k]
        for n in range(min(MAX_N, len(output)), MIN_N - 1, -1):
            ends = self.after[n].get(tuple(output[-n:]))
            if ends:
                expected = len(output) + self.drift
                end = min(ends, key=lambda e: (abs(e - expected), e))
                if end >= len(self.ids):
                    continue                 # the prediction ends there: nothing to draft
                self.drift = end - len(output)
                return self.ids[end:end + k]
        return []


def prediction_usage(prediction: list[int], output: list[int]) -> dict:
    """OpenAI's `accepted_prediction_tokens` (tokens of the prediction that appear in the
    answer, in order) and `rejected_prediction_tokens` (the others)."""
    matcher = difflib.SequenceMatcher(a=prediction, b=output, autojunk=False)
    kept = sum(block.size for block in matcher.get_matching_blocks())
    return {"accepted_prediction_tokens": kept, "rejected_prediction_tokens": len(prediction) - kept}
