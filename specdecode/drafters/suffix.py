"""SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975): a training-free tree drafter over the
request's own text and the outputs of earlier requests.

The paper keeps suffix trees; the same queries are answered here by position indexes, which
append in O(1) per token and take numpy for the rest:
  1. match: the longest suffix of the current text (up to `suffix_max_match` tokens) that
     occurred before -- candidates are the earlier ends of the last bigram (the last token when
     the bigram never occurred), each extended backwards in one vectorised compare; the
     occurrences are all candidates that reach the longest length (the suffix-tree node's
     subtree: every previous occurrence, not only the latest as in `ngram`);
  2. tree: the continuations of those occurrences ([occurrences, depth] tokens) are grown
     best-first into a tree: a child's probability is its parent's times the share of the
     parent's occurrences that continue with its token (the frequency ratio, conditional on the
     path); siblings by count, then recency; nodes below `suffix_min_prob` are pruned; depth
     <= ceil(`suffix_spec_factor` * match length) (the paper's MAX_SPEC = alpha * p; alpha 1 by
     default, the conservative end: never deeper than the matched context is long) and
     <= `suffix_max_depth` (24, as vLLM's default);
  3. global: the outputs of the last `suffix_global_requests` finished requests (at most
     `suffix_global_tokens` tokens) are one separator-joined array with sorted unigram / bigram
     keys (searchsorted lookup), rebuilt when an output is added. Their occurrences are matched
     against the same suffix and pooled with the request's own: the longer match wins, equal
     lengths add their counts -- so a short or missing per-request match falls back to the past.

Data per request (`LocalIndex`): ids np.int64 [capacity] (the text, grown by doubling) and two
dicts (unigram token / bigram key -> positions where it ends). Keyed by the Sequence object in
a WeakKeyDictionary and caught up with the new tokens at each propose, so propose needs no
commit: `has_state=False` (the server may draft for a row it does not speculate on). `prepare`
still returns a `DrafterState` for the server's accounting and its end-of-request hook: reset(row)
moves a finished request's output to the global index and drops its index. `commit` does the
same for sequences that finished (the engine commits finished ones too), once per sequence.
"""
from __future__ import annotations

import copy
import heapq
import itertools
import math
import weakref
from collections import deque

import numpy as np

from ..tree import MAX_TREE_NODES
from .base import Drafter, DrafterCapabilities, DrafterError, DraftProposal
from .ngram import predicted
from .registry import register

SMALL_OCCURRENCES = 16  # candidate occurrences up to which a draft is found element by element (_draft_small)


def bigram_key(a: int, b: int) -> int:
    return (a << 32) | b            # token ids < 2**31; a separator (-1) makes the key negative


class LocalIndex:
    """One request's text and where each unigram / bigram of it ends."""

    def __init__(self) -> None:
        self.ids = np.empty(256, dtype=np.int64)      # [capacity]; valid [:n]
        self.n = 0
        self.uni: dict[int, list[int]] = {}           # token -> positions p with ids[p] == token
        self.bi: dict[int, list[int]] = {}            # bigram_key(a, b) -> p with ids[p-1:p+1] == (a, b)

    def extend(self, token_ids: list[int]) -> None:
        """Index the tokens appended since the last call (a shorter text: start over)."""
        if len(token_ids) < self.n:
            self.__init__()
        need = len(token_ids)
        if need == self.n:
            return
        if need > len(self.ids):
            self.ids = np.concatenate([self.ids[:self.n], np.empty(max(need, 2 * len(self.ids)) - self.n, np.int64)])
        self.ids[self.n:need] = token_ids[self.n:need]
        uni, bi = self.uni, self.bi
        prev = int(self.ids[self.n - 1]) if self.n else -1
        for p, t in enumerate(self.ids[self.n:need].tolist(), self.n):
            uni.setdefault(t, []).append(p)
            if prev >= 0:
                bi.setdefault((prev << 32) | t, []).append(p)
            prev = t
        self.n = need

    def nbytes(self) -> int:
        """Estimate: the array, two list slots and a shared int per position, dict entries."""
        return int(self.ids.nbytes + 24 * self.n + 100 * (len(self.uni) + len(self.bi)))


class GlobalIndex:
    """Outputs of finished requests, joined by separators (-1), with sorted lookup keys."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.outputs: deque[np.ndarray] = deque()
        self.total = 0
        self.dirty = False
        self.hay = np.full(1, -1, dtype=np.int64)                  # [T] outputs between separators
        self.uni_keys = self.uni_pos = self.bi_keys = self.bi_pos = np.empty(0, dtype=np.int64)   # [T] / [T-1]

    def add(self, output: list[int]) -> None:
        if self.max_requests == 0 or not output:
            return
        self.outputs.append(np.asarray(output[-self.max_tokens:], dtype=np.int64))
        self.total += len(self.outputs[-1])
        while len(self.outputs) > self.max_requests or self.total > self.max_tokens:
            self.total -= len(self.outputs.popleft())
        self.dirty = True

    def build(self) -> None:
        parts = [np.full(1, -1, dtype=np.int64)]
        for out in self.outputs:
            parts += [out, np.full(1, -1, dtype=np.int64)]
        hay = np.concatenate(parts)
        self.uni_pos = np.argsort(hay, kind="stable")                # positions ascending within a token
        self.uni_keys = hay[self.uni_pos]
        keys = (hay[:-1] << 32) | hay[1:]                             # [T-1] key of the bigram ending at p + 1
        order = np.argsort(keys, kind="stable")
        self.bi_keys, self.bi_pos = keys[order], order + 1
        self.hay, self.dirty = hay, False

    def ends(self, key: int, bigram: bool) -> np.ndarray:
        if self.dirty:
            self.build()
        keys, pos = (self.bi_keys, self.bi_pos) if bigram else (self.uni_keys, self.uni_pos)
        return pos[np.searchsorted(keys, key, "left"):np.searchsorted(keys, key, "right")]

    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in (self.hay, self.uni_keys, self.uni_pos, self.bi_keys, self.bi_pos)))


def match_lengths(hay: np.ndarray,     # [T] text the occurrences are in
                  ends: np.ndarray,    # [E] positions where a candidate occurrence ends
                  query: np.ndarray,   # [M] the current text backwards: query[j] = j tokens before its end
                  ) -> np.ndarray:
    """[E] how many tokens back from each end agree with the query (0..M)."""
    idx = ends[:, None] - np.arange(len(query))[None, :]                  # [E, M]
    eq = (hay[np.maximum(idx, 0)] == query[None, :]) & (idx >= 0)         # [E, M]
    return np.where(eq.all(axis=1), len(query), eq.argmin(axis=1))


def continuations(hay: np.ndarray, ends: np.ndarray, depth: int, limit: int) -> np.ndarray:
    """[E, depth] the tokens after each end, -1 past `limit` or a separator."""
    idx = ends[:, None] + 1 + np.arange(depth)[None, :]                   # [E, depth]
    cont = np.where(idx < limit, hay[np.minimum(idx, limit - 1)], -1)
    cont[np.cumsum(cont < 0, axis=1) > 0] = -1
    return cont


def grow_tree(cont: np.ndarray,        # [E, D] continuations, rows oldest first, -1 = none
              budget: int, min_prob: float) -> list[tuple[int, int]]:
    """Best-first tree of at most `budget` (token, parent) nodes by estimated path probability."""
    def children(rows: np.ndarray, d: int) -> tuple[list, int]:
        col = cont[rows, d]
        rows, col = rows[col >= 0], col[col >= 0]
        if len(rows) and (len(rows) == 1 or (col == col[0]).all()):   # one continuation (the usual case)
            return [(int(col[0]), rows, len(rows))], len(rows)
        if not len(rows):
            return [], 0
        uniq, inv, counts = np.unique(col, return_inverse=True, return_counts=True)
        last = np.empty(len(uniq), dtype=np.int64)
        last[inv] = rows                                                 # rows ascend: the latest wins
        return [(int(uniq[g]), rows[inv == g], counts[g]) for g in np.lexsort((-last, -counts))], len(rows)

    return _best_first(children, np.arange(len(cont)), cont.shape[1], budget, min_prob)


def grow_tree_lists(cont: list[list[int]],   # [E][D] continuations, rows oldest first, -1 = none
                    depth_max: int, budget: int, min_prob: float) -> list[tuple[int, int]]:
    """grow_tree on Python lists (a few occurrences): the same nodes in the same order."""
    def children(rows: list[int], d: int) -> tuple[list, int]:
        rows = [r for r in rows if cont[r][d] >= 0]
        by_token: dict[int, list[int]] = {}
        for r in rows:
            by_token.setdefault(cont[r][d], []).append(r)
        # count descending, then the latest occurrence first (grow_tree's lexsort)
        ordered = sorted(by_token.items(), key=lambda kv: (-len(kv[1]), -kv[1][-1]))
        return [(token, sub, len(sub)) for token, sub in ordered], len(rows)

    return _best_first(children, list(range(len(cont))), depth_max, budget, min_prob)


def _best_first(children, rows, depth_max: int, budget: int, min_prob: float) -> list[tuple[int, int]]:
    """The tree both grow_trees build: `children(rows, d)` groups the occurrences `rows` by their
    token at depth d ((token, its rows, count) by count, then recency; and how many continue)."""
    nodes: list[tuple[int, int]] = []
    heap: list = []                    # (-probability, tiebreak, parent node, token, rows, depth)
    tiebreak = itertools.count()       # equal probabilities: first pushed (more frequent, more recent) first

    def push_children(rows, d: int, prob: float, parent: int) -> None:
        groups, total = children(rows, d)
        for token, sub, count in groups:
            p = prob * count / total
            if p < min_prob:
                break                                                    # counts descend
            heapq.heappush(heap, (-p, next(tiebreak), parent, token, sub, d + 1))

    if depth_max:
        push_children(rows, 0, 1.0, -1)
    while heap and len(nodes) < budget:
        neg, _, parent, token, rows, d = heapq.heappop(heap)
        nodes.append((token, parent))
        if d < depth_max:
            push_children(rows, d, -neg, len(nodes) - 1)
    return nodes


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise DrafterError(message)


def _int(name: str, value, lo: int, hi: int) -> int:
    _check(isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi,
           f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


class SuffixState:
    """`DrafterState` over the per-request indexes (and the global one, in the byte counts)."""

    def __init__(self, drafter: SuffixDrafter) -> None:
        self.drafter = drafter

    def nbytes(self) -> int:
        d = self.drafter
        return sum(loc.nbytes() for loc in list(d.local.values())) + d.glob.nbytes()

    def used_bytes(self) -> int:
        return self.nbytes()

    def reset(self, row: int) -> None:
        for seq in [s for s in list(self.drafter.local.keys()) if s.row == row]:
            if seq.finished:
                self.drafter.finish(seq)
            self.drafter.local.pop(seq, None)

    def truncate(self, row: int, length: int) -> None:
        for seq, loc in list(self.drafter.local.items()):
            if seq.row == row and loc.n > length:
                self.drafter.local.pop(seq, None)        # rebuilt from the text at the next propose


@register("suffix")
class SuffixDrafter(Drafter):
    capabilities = DrafterCapabilities(drafts_trees=True, relative_cost=0.01, copies=True, drafts_predictions=True)

    def __init__(self, target=None, suffix_max_match: int = 24, suffix_max_depth: int = 24,
                 suffix_spec_factor: float = 1.0, suffix_min_prob: float = 0.1,
                 suffix_max_occurrences: int = 256, suffix_global_requests: int = 64,
                 suffix_global_tokens: int = 1 << 17, **_: object) -> None:
        self.max_match = _int("suffix_max_match", suffix_max_match, 1, 64)
        self.max_depth = _int("suffix_max_depth", suffix_max_depth, 1, 64)
        self.max_occurrences = _int("suffix_max_occurrences", suffix_max_occurrences, 1, 1 << 16)
        _int("suffix_global_requests", suffix_global_requests, 0, 1 << 20)
        _int("suffix_global_tokens", suffix_global_tokens, 1, 1 << 26)
        for name, value, lo, hi in (("suffix_spec_factor", suffix_spec_factor, 0.0, 64.0),
                                    ("suffix_min_prob", suffix_min_prob, 0.0, 1.0)):
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                   and lo <= value <= hi and (name != "suffix_spec_factor" or value > 0),
                   f"{name} must be a number in {'(' if name == 'suffix_spec_factor' else '['}{lo}, {hi}], "
                   f"got {value!r}")
        self.spec_factor, self.min_prob = float(suffix_spec_factor), float(suffix_min_prob)
        self.glob = GlobalIndex(suffix_global_requests, suffix_global_tokens)
        self.local: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # Sequence -> LocalIndex
        self.done: weakref.WeakSet = weakref.WeakSet()                        # outputs already global

    def prepare(self, batch_size: int, max_len: int) -> SuffixState:
        return SuffixState(self)

    def memory(self) -> object:
        return copy.deepcopy(self.glob)

    def restore(self, memory: object) -> None:
        self.glob = copy.deepcopy(memory)

    def finish(self, seq) -> None:
        """A finished sequence: its output joins the global index (once), its own index goes."""
        if seq not in self.done:
            self.done.add(seq)
            self.glob.add(seq.output_ids)
        self.local.pop(seq, None)

    def prefill(self, seqs) -> None:
        """Index each prompt now (prefill time): the first draft would otherwise build it, and
        that one-time cost, many plain steps' worth on a small model, would be measured as the cost
        of drafting and price the drafter out for good."""
        for s in seqs:
            self._index(s)

    def _index(self, s) -> LocalIndex:
        """The sequence's index, caught up with its text."""
        loc = self.local.get(s)
        if loc is None or loc.n > len(s.token_ids):      # new, or its text was cut back: rebuilt
            loc = self.local[s] = LocalIndex()
        loc.extend(s.token_ids)
        return loc

    def propose(self, seqs, sizes):
        for seq in [s for s in list(self.local.keys()) if s.finished]:
            self.finish(seq)
        trees = []
        for s, k in zip(seqs, sizes):
            if k <= 0 or s.finished:
                trees.append([])
                continue
            loc = self._index(s)
            chain = predicted(s, min(int(k), MAX_TREE_NODES))  # a predicted output, where it aligns
            trees.append([(t, i - 1) for i, t in enumerate(chain)] if chain
                         else self.draft(loc, min(int(k), MAX_TREE_NODES)))
        return DraftProposal.from_trees(trees)

    def draft(self, loc: LocalIndex, budget: int) -> list[tuple[int, int]]:
        """The tree for one request's text (indexed in `loc`)."""
        ids, n = loc.ids, loc.n
        if n < 1:
            return []
        query = ids[max(n - self.max_match, 0):n][::-1]                           # [M] backwards
        glob = self.glob if self.glob.outputs else None
        found: list[tuple[np.ndarray, np.ndarray, int]] = []                  # (hay, ends, hay length)
        for bigram in (True, False):                                            # bigram ends, else unigram ends
            if bigram and n < 2:
                continue
            key = bigram_key(int(ids[n - 2]), int(ids[n - 1])) if bigram else int(ids[n - 1])
            if glob is not None:                                                 # older occurrences first
                ends = glob.ends(key, bigram)[-self.max_occurrences:]           # (builds a stale index)
                found.append((glob.hay, ends, len(glob.hay)))
            mine = np.asarray((loc.bi if bigram else loc.uni).get(key, ()), dtype=np.int64)   # [E]
            found.append((ids, mine[mine < n - 1][-self.max_occurrences:], n))  # not the suffix itself
            found = [f for f in found if len(f[1])]
            if found:
                break
        if not found:
            return []
        if sum(len(ends) for _, ends, _ in found) <= SMALL_OCCURRENCES:
            return self._draft_small(found, query.tolist(), budget)
        lengths = [match_lengths(hay, ends, query) for hay, ends, _ in found]   # [E] each
        best = max(int(m.max()) for m in lengths)
        depth = min(self.max_depth, math.ceil(self.spec_factor * best), budget)
        cont = np.concatenate([continuations(hay, ends[m == best], depth, limit)
                               for (hay, ends, limit), m in zip(found, lengths)])   # [occurrences, depth]
        return grow_tree(cont, budget, self.min_prob)

    def _draft_small(self, found: list[tuple[np.ndarray, np.ndarray, int]], query: list[int],
                     budget: int) -> list[tuple[int, int]]:
        """`draft`'s match, continuations and tree for a few occurrences, element by element in Python:
        right after a target pass the array path's numpy calls cost a visible share of a small model's
        step, at every drafting step and shadow draft, and this loop a fraction of that
        (specdecode/engine/README.md, "Rules the code keeps"). The same tree (match_lengths,
        continuations, grow_tree)."""
        lengths = []
        for hay, ends, _ in found:
            mine = []
            for end in ends.tolist():
                j = 0
                while j < len(query) and end - j >= 0 and hay.item(end - j) == query[j]:
                    j += 1
                mine.append(j)
            lengths.append(mine)
        best = max(max(m) for m in lengths)
        depth = min(self.max_depth, math.ceil(self.spec_factor * best), budget)
        cont = []                                                   # [occurrences][depth], -1 = none
        for (hay, ends, limit), mine in zip(found, lengths):
            for end, m in zip(ends.tolist(), mine):
                if m != best:
                    continue
                row = []
                for i in range(end + 1, min(end + 1 + depth, limit)):
                    t = hay.item(i)
                    if t < 0:
                        break
                    row.append(t)
                cont.append(row + [-1] * (depth - len(row)))
        return grow_tree_lists(cont, depth, budget, self.min_prob)

    def commit(self, seqs, proposal, num_accepted):
        for s in seqs:
            if s.finished:
                self.finish(s)
