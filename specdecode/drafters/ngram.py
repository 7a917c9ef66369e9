"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the sequence's
last n tokens (n from `ngram_max` down to `ngram_min`) in the prompt and the text
generated so far, and propose the tokens that followed it (Saxena 2023, "prompt lookup
decoding"; HF `prompt_lookup_num_tokens`). Drafts are point masses: no probabilities.

Text matching (`text_match`, default off): the same lookup on characters. A word is not always
the same tokens: after a quote or a bracket (`Maria` in `{"name": "Maria`) it loses the leading
space it has in the prompt (` Maria`), so token lookup finds nothing where the text plainly
repeats -- most of every value of structured output copied from its prompt. When the longest
earlier occurrence of the text's last characters is longer than the token match, the characters
that followed it are tokenized and drafted instead. On a CPU it raises the accepted length but not
the speed: its extra drafts cost rows of the pass about as much as they save, hence off by default
(docs/structured-output.md, "What was tried"). Where a row is nearly free (a GPU) it should pay.
"""
from __future__ import annotations

import weakref

import numpy as np

from .base import Drafter, DrafterCapabilities, DrafterError, DraftProposal
from .registry import register

TEXT_MIN_CHARS = 3          # characters of a text match per token of ngram_min (shorter: no draft)
TEXT_MAX_CHARS = 256        # longest suffix of the text looked for
CHARS_PER_TOKEN = 8         # characters of continuation tokenized per draft token wanted


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


class NgramIndex:
    """One sequence's n-grams (n in ngram_min..ngram_max) -> the latest start of each among the
    windows that end before the sequence's last token: `latest_match` in O(1) per step instead
    of a scan of the whole text, extended by the tokens appended since the last call (a sequence
    only grows; a shorter or different one is indexed anew)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.sizes = range(ngram_min, ngram_max + 1)
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0                 # windows inside token_ids[:indexed] are in the tables
        self.head: tuple[int, ...] = ()  # the first tokens, to notice a different sequence

    def match(self, token_ids: list[int]) -> tuple[int, int]:
        """`latest_match(token_ids, ngram_min, ngram_max)`."""
        length = len(token_ids)
        if length - 1 < self.indexed or tuple(token_ids[:8]) != self.head:
            self.__init__(self.sizes.start, self.sizes.stop - 1)
            self.head = tuple(token_ids[:8])
        for end in range(self.indexed + 1, length):      # windows ending at end-1 < length-1
            for n in self.sizes:
                if end >= n:
                    self.tables[n][tuple(token_ids[end - n:end])] = end - n
        self.indexed = max(self.indexed, length - 1)
        for n in reversed(self.sizes):
            if n > length - 1:
                continue
            start = self.tables[n].get(tuple(token_ids[length - n:]))
            if start is not None:
                return start + n, n
        return 0, 0


def longest_text_match(text: str, min_chars: int = TEXT_MIN_CHARS, max_chars: int = TEXT_MAX_CHARS) -> tuple[int, int]:
    """(where the continuation starts, length) of the latest earlier occurrence of the longest
    suffix of `text` (min_chars..max_chars characters; an occurrence ends before the text's last
    character); (0, 0) when there is none. If a suffix occurs earlier so does every shorter one,
    so the length is found by bisection."""
    end = len(text) - 1
    lo, hi = 0, min(max_chars, end)
    while lo < hi:                     # the longest length whose suffix occurs before `end`
        mid = (lo + hi + 1) // 2
        if text.rfind(text[-mid:], 0, end) >= 0:
            lo = mid
        else:
            hi = mid - 1
    if lo < min_chars:
        return 0, 0
    return text.rfind(text[-lo:], 0, end) + lo, lo


class TokenTexts:
    """Each vocabulary entry's text (as it reads inside a longer text), and the tokenizer to
    tokenize a continuation; built once per tokenizer."""
    _built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer) -> None:
        backend = tokenizer.backend
        size = backend.get_vocab_size(with_added_tokens=True)
        texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        for i, t in enumerate(texts):       # SentencePiece: a word-initial piece keeps its space
            raw = backend.id_to_token(i) or ""
            if raw.startswith("\u2581") and not t.startswith(" "):
                texts[i] = " " + t
        self.texts, self.tokenizer = texts, tokenizer

    @classmethod
    def of(cls, tokenizer) -> TokenTexts:
        found = cls._built.get(tokenizer)
        if found is None:
            found = cls._built[tokenizer] = cls(tokenizer)
        return found

    def text(self, token_ids) -> str:
        texts, n = self.texts, len(self.texts)
        return "".join(texts[t] if 0 <= t < n else "" for t in token_ids)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=False)


def text_lookup(texts: TokenTexts, token_ids: list[int], max_tokens: int, token_match_chars: int,
                min_chars: int = TEXT_MIN_CHARS) -> list[int]:
    """Draft from a text match of at least `min_chars` characters and longer than
    `token_match_chars` (the token match's length in characters); [] when there is none. The
    continuation is tokenized as a text of its own; a token cut by the end of the characters
    taken is dropped."""
    text = texts.text(token_ids)
    start, length = longest_text_match(text, min_chars)
    if length <= token_match_chars:
        return []
    want = CHARS_PER_TOKEN * max_tokens + 16
    tail = text[start:start + want]
    tokens = texts.encode(tail)
    if start + want < len(text) and tokens:
        tokens = tokens[:-1]
    return tokens[:max_tokens]


@register("ngram")
class NgramDrafter(Drafter):
    capabilities = DrafterCapabilities(copies=True, drafts_predictions=True)   # stateless and free

    def __init__(self, target=None, ngram_min: int = 1, ngram_max: int = 4, text_match: bool = False,
                 **_: object) -> None:
        for name, value in (("ngram_min", ngram_min), ("ngram_max", ngram_max)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise DrafterError(f"{name} must be an integer in [1, 16], got {value!r}")
        if not 1 <= ngram_min <= ngram_max <= 16:
            raise DrafterError(f"ngram sizes must satisfy 1 <= ngram_min <= ngram_max <= 16, "
                               f"got ngram_min={ngram_min}, ngram_max={ngram_max}")
        if not isinstance(text_match, bool):
            raise DrafterError(f"text_match must be true or false, got {text_match!r}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # sequence -> NgramIndex
        tokenizer = getattr(target, "tokenizer", None)
        self.texts = TokenTexts.of(tokenizer) if text_match and tokenizer is not None else None

    def draft_one(self, token_ids: list[int], k: int, index: NgramIndex | None = None) -> list[int]:
        """Draft up to k tokens for one sequence's text (`index`: that sequence's n-gram index)."""
        if k <= 0:
            return []
        if index is not None:
            start, n = index.match(token_ids)
        else:
            start, n = latest_match(np.asarray(token_ids, dtype=np.int64), self.ngram_min, self.ngram_max)
        if self.texts is not None:
            matched = len(self.texts.text(token_ids[len(token_ids) - n:])) if n else 0
            found = text_lookup(self.texts, token_ids, k, matched, TEXT_MIN_CHARS * self.ngram_min)
            if found:
                return found
        return list(token_ids[start:start + k]) if n else []

    def prefill(self, seqs) -> None:
        """Index each prompt now (prefill time), not in the first draft (a one-time cost there
        would make drafting look dear to the draft budget)."""
        for s in seqs:
            self.index(s).match(s.token_ids)

    def index(self, seq) -> NgramIndex:
        """The sequence's n-gram index (kept while the sequence lives)."""
        found = self.indexes.get(seq)
        if found is None:
            found = self.indexes[seq] = NgramIndex(self.ngram_min, self.ngram_max)
        return found

    def propose(self, seqs, sizes):
        return DraftProposal.from_lists([predicted(s, k)
                                         or self.draft_one(s.token_ids, k, self.index(s) if k > 0 else None)
                                         for s, k in zip(seqs, sizes)])


def predicted(s, k: int) -> list[int]:
    """The draft a sequence's predicted output gives (prediction.py), [] without one."""
    if s.prediction is None or k <= 0:
        return []
    return s.prediction.draft(s.token_ids[len(s.prompt_ids):], k)
