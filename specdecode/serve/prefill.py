"""How many prompt tokens the server prefills between two decode steps.

A prefill chunk runs while every decoding request waits for its next token, so a fixed chunk
that costs 30 ms on one machine stalls the streams for a second on another (256 tokens of a 1.5B
model on two AVX2 cores). With requests decoding, the chunk is sized from the measured seconds
per prefilled token so that it stalls them about `stall_s`, within [`floor`, `chunk`]; with
nothing decoding, nobody waits and the chunk is `chunk` (the fewest passes to the first token).
`stall_s` 0 keeps the fixed `chunk` always.
"""
from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.3          # weight of the newest measurement in the running estimate


@dataclass
class PrefillBudget:
    chunk: int                         # most tokens per pass (--prefill-chunk)
    stall_s: float                     # target stall of the decoding requests per pass; 0 = fixed chunk
    floor: int = 16                    # fewest tokens per pass while requests decode (prefill must progress)
    per_token_s: float | None = None   # measured seconds per prefilled token (running estimate)

    def tokens(self, decoding: bool) -> int:
        """Tokens for the next prefill pass; `decoding`: some request waits for its next token."""
        if not decoding or self.stall_s <= 0 or not self.per_token_s:
            return self.chunk
        fit = int(self.stall_s / self.per_token_s)
        return max(min(self.floor, self.chunk), min(self.chunk, fit))

    def observe(self, tokens: int, seconds: float) -> None:
        """One prefill pass of `tokens` prompt tokens took `seconds` (drafter prefill included)."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = seconds / tokens
        self.per_token_s = rate if self.per_token_s is None else (1 - SMOOTHING) * self.per_token_s + SMOOTHING * rate
