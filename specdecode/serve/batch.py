"""The engine side of serving: `SpecEngine.step` over a changing set of rows in paged caches.

* `ServeSequence` -- a `Sequence` plus what serving needs (its request, speculation state,
  prefill progress, timings).
* `RowDrafter` -- wraps the drafter so only rows that speculate this step draft (rows with
  speculation off never touch the draft model; their draft cache lags and catches up by the
  drafter's own catch-up rule when they speculate again).
* `BatchEngine` -- `SpecEngine` on paged target/draft caches, with a per-row k (`_room`) and
  chunked prefill of new rows (`prefill`), so the running rows are stalled by at most one
  chunk between two steps.
"""
from __future__ import annotations

import time

import torch

from ..drafters.base import DraftProposal, Drafter
from ..engine.engine import SpecEngine
from ..engine.sequence import Sequence
from ..params import SamplingParams
from .paged_cache import PagedKVCache
from .policy import OFF, RowPolicy


class ServeSequence(Sequence):
    def __init__(self, request, prompt_ids: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...],
                 row: int, policy: RowPolicy, device) -> None:
        super().__init__(request.id, prompt_ids, params, eos_token_ids, row, device)
        self.request = request
        self.policy = policy
        self.k_now = 0                     # drafts allowed in the coming step (set by the scheduler)
        self.prefilled = 0                 # prompt tokens already in the target cache
        self.admitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    @property
    def prefill_target(self) -> int:
        """Tokens prefill writes: the prompt but its last token (which is pending, see engine.py)."""
        return len(self.prompt_ids) - 1

    @property
    def drafts_ever(self) -> bool:
        return self.policy.mode != OFF and self.policy.k > 0


class RowDrafter(Drafter):
    """Drafts only for rows with room > 0 and scatters the proposal back to the full batch.
    Any other attribute (hooks a drafter may grow) is looked up on the wrapped drafter."""

    name = "rows"

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self._active: list[int] = []
        self._sub: DraftProposal | None = None

    def __getattr__(self, attr):
        return getattr(self.__dict__["inner"], attr)

    @property
    def uses_target_hidden(self) -> bool:
        return getattr(self.inner, "uses_target_hidden", False)

    def observe(self, seqs, starts, hidden):
        """Target hidden states reach the drafter for every row (speculating or not), so a row
        whose speculation comes back on can catch up from them."""
        self.inner.observe(seqs, starts, hidden)

    def propose(self, seqs, max_tokens):
        active = [i for i, n in enumerate(max_tokens) if n > 0]
        sub = self.inner.propose([seqs[i] for i in active], [max_tokens[i] for i in active])
        self._active, self._sub = active, sub
        if len(active) == len(seqs):
            return sub
        return sub.scatter(active, len(seqs))

    def commit(self, seqs, proposal, num_accepted):
        if proposal.k == 0 or self._sub is None:      # the engine did not call propose this step
            return
        active, sub = self._active, self._sub
        self._active, self._sub = [], None
        self.inner.commit([seqs[i] for i in active], sub, [num_accepted[i] for i in active])


def draft_model_of(drafter: Drafter | None):
    """The draft model of a drafter that keeps a KV cache (`drafter.model` + `drafter.cache`), else None."""
    model = getattr(drafter, "model", None)
    return model if model is not None and hasattr(model, "config") and hasattr(drafter, "cache") else None


def paged_cache_for(model, num_rows: int, max_len: int, num_blocks: int, block_size: int) -> PagedKVCache:
    c = model.config
    return PagedKVCache(c.num_layers, num_rows, c.num_kv_heads, c.head_dim, max_len, num_blocks, block_size,
                        model.dtype, model.device)


class OwnStateView:
    """Memory accounting of a drafter's own contiguous per-row state (its `cache` and, for an
    EAGLE head, its `features`): capacity = bytes held, used = the share of positions in use."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def nbytes(self) -> int:
        cache, features = self.drafter.cache, getattr(self.drafter, "features", None)
        held = cache.nbytes() if cache is not None else 0
        return held + (features.numel() * features.element_size() if features is not None else 0)

    def used_bytes(self) -> int:
        cache = self.drafter.cache
        if cache is None:
            return 0
        return int(self.nbytes() * sum(cache.lengths) / (cache.batch_size * cache.max_len))


class BatchEngine(SpecEngine):
    def __init__(self, target, drafter: Drafter | None, max_k: int, context: int, num_rows: int,
                 num_blocks: int, block_size: int) -> None:
        wrapped = RowDrafter(drafter) if drafter is not None else None
        super().__init__(target, wrapped, max_k if drafter is not None else 0)
        self.context = context
        max_len = context + max_k + 2
        self.cache = paged_cache_for(self.model, num_rows, max_len, num_blocks, block_size)
        self.inner_drafter = drafter
        self.draft_model = draft_model_of(drafter)
        self.draft_cache = None
        if self.draft_model is not None:
            # the drafter's own contiguous cache is replaced by a paged one (same interface)
            self.draft_cache = paged_cache_for(self.draft_model, num_rows, max_len, num_blocks, block_size)
            drafter.cache = self.draft_cache
        elif drafter is not None:
            drafter.prepare(num_rows, max_len)      # per-row state of other drafters (e.g. an EAGLE head)
        self.draft_accounting = self.draft_cache
        if self.draft_cache is None and getattr(drafter, "cache", None) is not None:
            self.draft_accounting = OwnStateView(drafter)
        self.caches = [c for c in (self.cache, self.draft_cache) if c is not None]

    def _room(self, s: ServeSequence) -> int:
        if self.drafter is None:
            return 0
        left_in_budget = s.params.max_tokens - s.num_output - 1
        left_in_context = self.context - len(s.token_ids)
        return max(0, min(s.k_now, left_in_budget, left_in_context))

    # ------------------------------------------------------------ rows
    def fits(self, tokens: int) -> bool:
        """Whether a request of `tokens` (prompt + max_tokens) can ever be admitted."""
        return all(c.blocks_for(tokens) <= c.usable_blocks for c in self.caches)

    def can_admit(self, tokens: int) -> bool:
        return all(c.can_reserve(tokens) for c in self.caches)

    def admit(self, row: int, tokens: int) -> None:
        for c in self.caches:
            c.reserve(row, tokens)

    def release(self, row: int) -> None:
        for c in self.caches:
            c.release(row)
        own = getattr(self.inner_drafter, "cache", None)
        if own is not None and own is not self.draft_cache:
            own.truncate(row, 0)                    # a drafter's own per-row cache: the row starts anew

    # ------------------------------------------------------------ chunked prefill
    def prefill(self, chunks: list[tuple[ServeSequence, int]]) -> None:
        """Write the next `n` prompt tokens of each sequence into the target cache (and the
        draft cache of rows that may speculate), all rows in one ragged forward pass."""
        self._prefill_into(self.model, self.cache, chunks)
        drafting = [(s, n) for s, n in chunks if s.drafts_ever]
        if self.draft_cache is not None and drafting:
            self._prefill_into(self.draft_model, self.draft_cache, drafting)
        for s, n in chunks:
            s.prefilled += n

    def _prefill_into(self, model, cache: PagedKVCache, chunks: list[tuple[ServeSequence, int]]) -> None:
        width = max(n for _, n in chunks)
        tokens = torch.zeros(len(chunks), width, dtype=torch.long)                  # [B, width]
        for b, (s, n) in enumerate(chunks):
            start = cache.lengths[s.row]
            tokens[b, :n] = torch.tensor(s.prompt_ids[start:start + n])
        tokens = tokens.clamp(max=model.vocab_size - 1)     # a draft may embed fewer (padding) ids
        device = model.device
        starts = [cache.lengths[s.row] for s, _ in chunks]
        rows = torch.tensor([s.row for s, _ in chunks], device=device)
        hidden = model is self.model and self.drafter is not None and self.drafter.uses_target_hidden
        out = model.forward(tokens.to(device), cache, torch.tensor(starts, device=device), rows=rows,
                            logit_index=torch.zeros(len(chunks), 0, dtype=torch.long, device=device),
                            **({"return_hidden": True} if hidden else {}))
        if hidden:          # e.g. an EAGLE head reads the target's features of the prompt
            self.drafter.observe([s for s, _ in chunks], starts, out[1])
        for (s, n), start in zip(chunks, starts):
            cache.truncate(s.row, start + n)
