"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the sequence's
last n tokens (n from `ngram_max` down to `ngram_min`) in the prompt and the text
generated so far, and propose the tokens that followed it (Saxena 2023, "prompt lookup
decoding"; HF `prompt_lookup_num_tokens`). Drafts are point masses: no probabilities.
"""
from __future__ import annotations

import numpy as np

from .base import DraftProposal, Drafter, DrafterCapabilities, DrafterError
from .registry import register


def occurrences(token_ids: np.ndarray, n: int) -> np.ndarray:
    """Start positions of earlier occurrences of the last n tokens (the suffix itself excluded)."""
    # windows[i] = token_ids[i:i+n] for i in 0..length-n-1
    windows = np.lib.stride_tricks.sliding_window_view(token_ids[:len(token_ids) - 1], n)
    return np.flatnonzero((windows == token_ids[len(token_ids) - n:]).all(axis=1))


def latest_match(token_ids: np.ndarray, ngram_min: int, ngram_max: int) -> tuple[int, int]:
    """(where the continuation starts, n) for the latest earlier occurrence of the longest
    suffix n-gram, n from ngram_max down to ngram_min; (0, 0) when there is none."""
    for n in range(min(ngram_max, len(token_ids) - 1), ngram_min - 1, -1):
        hits = occurrences(token_ids, n)
        if hits.size:
            return int(hits[-1]) + n, n
    return 0, 0


def lookup(token_ids: np.ndarray, max_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Draft for one sequence: continuation of the latest earlier match of its suffix."""
    start, n = latest_match(token_ids, ngram_min, ngram_max)
    return token_ids[start:start + max_tokens].tolist() if n else []


@register("ngram")
class NgramDrafter(Drafter):
    capabilities = DrafterCapabilities()     # stateless and free: propose is a pure function of the text

    def __init__(self, target=None, ngram_min: int = 1, ngram_max: int = 4, **_: object) -> None:
        if not 1 <= ngram_min <= ngram_max <= 16:
            raise DrafterError(f"ngram sizes must satisfy 1 <= ngram_min <= ngram_max <= 16, "
                               f"got ngram_min={ngram_min}, ngram_max={ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, seqs, max_tokens):
        drafts = []
        for s, k in zip(seqs, max_tokens):
            ids = np.asarray(s.token_ids, dtype=np.int64)
            drafts.append(lookup(ids, k, self.ngram_min, self.ngram_max) if k > 0 else [])
        return DraftProposal.from_lists(drafts)
