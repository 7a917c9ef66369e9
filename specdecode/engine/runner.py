"""The model runner: owns the KV caches and runs the target's forward passes.

* `allocate` makes the target's cache and the drafter's per-row state for a batch of rows:
  contiguous caches by default; a caller that pages (the server) passes `new_cache`, and a
  drafter that declares a draft model then gets its KV cache made the same way.
* `prefill` (a fresh batch: every prompt but its last token, from position 0) and
  `prefill_chunks` (the next tokens of some rows, each from its own cache length) write prompts.
* `score` is the one target pass of a step: each row's pending tokens + drafts, returning the
  transformed target probabilities verification needs.

A drafter that declares `needs_target_hidden` gets the target's hidden states after every
target pass (`observe`). Cache rule: a row of the target cache holds `token_ids[:length]`; the
tokens after that ("pending": normally just the last emitted token) go into the next pass with
the drafts, so every step is one target forward pass.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..drafters.base import DraftProposal, Drafter, DrafterState
from ..fast import argmax_last, top_k_indices
from ..forward import ForwardBatch
from ..sampling import probs_from_logits, transform_logits
from ..structured import allowed_masks, lazy_rows, mask_greedy
from ..tree import ancestors
from .sequence import Sequence

CacheFactory = Callable[[object, int, int], object]     # (model, num_rows, max_len) -> KV cache


class ModelRunner:
    def __init__(self, target, drafter: Drafter | None = None) -> None:
        self.target = target                      # LoadedModel
        self.model = target.model
        self.drafter = drafter
        self.wants_hidden = drafter is not None and drafter.capabilities.needs_target_hidden
        draft = drafter.draft_model() if drafter is not None else None
        self.draft_model = draft.model if draft is not None else None    # a draft model whose cache we make
        self.cache = None                         # the target's KV cache (allocate)
        self.draft_cache = None                   # the draft model's KV cache when made here (new_cache given)
        self.drafter_state: DrafterState | None = None

    # ------------------------------------------------------------------ caches
    def allocate(self, num_rows: int, max_len: int, new_cache: CacheFactory | None = None) -> None:
        """Caches for rows 0..num_rows-1 of up to max_len positions: the target's, and the
        drafter's state (its `prepare`, or with `new_cache` and a draft model, a cache made
        here and handed over with `use_draft_cache`)."""
        self.cache = new_cache(self.model, num_rows, max_len) if new_cache else self.model.new_cache(num_rows, max_len)
        self.draft_cache = None
        if self.drafter is None:
            self.drafter_state = None
        elif new_cache is not None and self.draft_model is not None:
            self.draft_cache = new_cache(self.draft_model, num_rows, max_len)
            self.drafter_state = self.drafter.use_draft_cache(self.draft_cache)
        else:
            self.drafter_state = self.drafter.prepare(num_rows, max_len)

    @property
    def caches(self) -> list:
        """The KV caches made here (target, then draft when paged by the caller)."""
        return [c for c in (self.cache, self.draft_cache) if c is not None]

    def keep(self, row: int, length: int) -> None:
        """Roll the target cache of `row` back (or forward) to `length` committed positions."""
        self.cache.truncate(row, length)

    # ------------------------------------------------------------------ prompts
    def prefill(self, seqs: list[Sequence]) -> None:
        """Write all prompt tokens but the last into a fresh target cache (the last one is
        pending and goes into the first step with the first drafts). A row whose cache already
        holds its prompt's start (a prefix store's blocks) is prefilled from there, in a pass of
        its own (a shared pass would pad it past its cache row)."""
        held = [s for s in seqs if self.cache.lengths[s.row] > 0]
        for s in held:
            start, end = self.cache.lengths[s.row], len(s.prompt_ids) - 1
            if end > start:
                tokens = torch.tensor([s.prompt_ids[start:end]], device=self.model.device)
                self.model.run(ForwardBatch.chain(tokens, torch.tensor([start]), torch.tensor([s.row])), self.cache)
                self.cache.truncate(s.row, end)
        seqs = [s for s in seqs if self.cache.lengths[s.row] == 0]
        lengths = [len(s.prompt_ids) - 1 for s in seqs]
        width = max(lengths, default=0)
        if width == 0:
            return
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for b, s in enumerate(seqs):
            tokens[b, :lengths[b]] = torch.tensor(s.prompt_ids[:-1])
        rows = [s.row for s in seqs]
        fb = (ForwardBatch.chain(tokens.to(self.model.device), 0) if rows == list(range(self.cache.batch_size))
              else ForwardBatch.chain(tokens.to(self.model.device), torch.zeros(len(rows), dtype=torch.long),
                                      torch.tensor(rows)))
        hidden = self.model.run(fb, self.cache)                                      # no logits
        if self.wants_hidden:
            self.drafter.observe(seqs, [0] * len(seqs), hidden)
        for s, n in zip(seqs, lengths):
            self.cache.truncate(s.row, n)

    def prefill_chunks(self, chunks: list[tuple[Sequence, int]], draft: bool = False) -> None:
        """Write the next `n` prompt tokens of each (sequence, n) into the target cache (or, with
        draft, the draft model's cache made here), all rows in one ragged forward pass."""
        model, cache = (self.draft_model, self.draft_cache) if draft else (self.model, self.cache)
        width = max(n for _, n in chunks)
        tokens = torch.zeros(len(chunks), width, dtype=torch.long)                  # [B, width]
        for b, (s, n) in enumerate(chunks):
            start = cache.lengths[s.row]
            tokens[b, :n] = torch.tensor(s.prompt_ids[start:start + n])
        tokens = tokens.clamp(max=model.vocab_size - 1)     # a draft may embed fewer (padding) ids
        device = model.device
        starts = [cache.lengths[s.row] for s, _ in chunks]
        rows = torch.tensor([s.row for s, _ in chunks], device=device)
        hidden = model.run(ForwardBatch.chain(tokens.to(device), torch.tensor(starts, device=device), rows),
                           cache)                                                    # no logits
        if not draft and self.wants_hidden:   # e.g. an EAGLE head reads the target's features of the prompt
            self.drafter.observe([s for s, _ in chunks], starts, hidden)
        for (s, n), start in zip(chunks, starts):
            cache.truncate(s.row, start + n)

    # ------------------------------------------------------------------ the step's target pass
    def score(self, seqs: list[Sequence], proposal: DraftProposal
              ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """One target forward over each row's pending tokens + drafts (a chain or a tree); returns,
        at the n+1 positions verification needs (position 0 after the last pending token, position
        i+1 after draft node i), either the transformed target probabilities [B, n+1, vocab] or, when
        every row is greedy, only their argmax [B, n+1] (all greedy verification reads); and the
        log-probabilities [B, n+1, vocab] when some row reports them."""
        k = proposal.k
        starts = [self.cache.lengths[s.row] for s in seqs]
        pending = [s.token_ids[start:] for s, start in zip(seqs, starts)]
        drafts = proposal.tokens.tolist()
        num_drafted = proposal.num_tokens.tolist()
        widths = [len(p) + n for p, n in zip(pending, num_drafted)]
        width = max(len(p) for p in pending) + k
        device = self.model.device
        rows = [p + d[:n] + [0] * (width - len(p) - n) for p, d, n in zip(pending, drafts, num_drafted)]
        tokens = torch.tensor(rows, dtype=torch.long, device=device)
        # logits at the last pending token and after each draft: positions len(p)-1 .. len(p)-1+k
        # (rows with fewer drafts repeat their last real position; verify ignores those)
        logit_index = torch.tensor([[min(len(p) - 1 + i, w - 1) for i in range(k + 1)]
                                    for p, w in zip(pending, widths)], device=device)
        in_order = [s.row for s in seqs] == list(range(len(seqs))) and len(seqs) == self.cache.batch_size
        row_ids = None if in_order else torch.tensor([s.row for s in seqs], device=device)
        if proposal.is_tree and k > 0:
            fb = ForwardBatch.tree(tokens, torch.tensor(starts), row_ids, [len(p) for p in pending],
                                   proposal.parents, logit_index)
        else:
            same_start = all(x == starts[0] for x in starts)
            start = starts[0] if same_start and in_order else torch.tensor(starts, device=device)
            fb = ForwardBatch.chain(tokens, start, row_ids, logit_index)
        hidden = self.model.run(fb, self.cache)                                      # [B, T, D]
        logits = self.model.logits(hidden, fb.logit_index)                           # [B, k+1, vocab]
        if self.wants_hidden:
            self.drafter.observe(seqs, starts, hidden)
        needs_history = any(s.params.uses_penalties for s in seqs)
        lazy = lazy_rows(seqs)           # greedy constrained rows: masks only where the argmax is forbidden
        transformed = transform_logits(
            logits, [s.params for s in seqs],
            [s.token_ids for s in seqs] if needs_history else None,
            [s.prompt_len for s in seqs] if needs_history else None,
            proposal.tokens.to(device) if k > 0 else None,
            ancestors(proposal.parents, proposal.num_tokens) if needs_history and proposal.is_tree else None,
            allowed_masks(seqs, proposal, logits.shape[-1], skip=lazy))
        all_greedy = all(s.params.greedy for s in seqs)
        target_tokens = argmax_last(transformed) if all_greedy else None              # [B, k+1] argmax
        if any(lazy):
            if transformed is logits:     # an inference tensor: not writable here
                transformed = transformed.clone()
            mask_greedy(seqs, proposal, lazy, transformed, target_tokens)
        wanted = self.drafter.capabilities.needs_target_topk if self.drafter is not None else 0
        if wanted:      # the top-1 of greedy rows is their argmax, already taken (a scan cost lookahead ~20 us a step)
            top = target_tokens[..., None] if wanted == 1 and target_tokens is not None \
                else top_k_indices(transformed, wanted)                                     # [B, k+1, wanted]
            self.drafter.observe_topk(seqs, proposal, top)
        probs = None if all_greedy else probs_from_logits(transformed, [s.params for s in seqs])   # [B, k+1, vocab]
        # log-probabilities as reported to users: log-softmax of the transformed logits (greedy
        # rows at temperature 1), only when some row asked for them
        wants = any(s.params.logprobs is not None for s in seqs)
        return probs, target_tokens, (transformed.float().log_softmax(dim=-1) if wants else None)

    def compact(self, row: int, first_node_slot: int, accepted_nodes: list[int]) -> None:
        """After a tree step: move the accepted path (node indices, by depth) of `row` from its
        nodes' slots (first_node_slot + node) to consecutive slots from first_node_slot, where a
        chain would have written it. The rest is dropped by the following `keep`."""
        src = [first_node_slot + node for node in accepted_nodes]
        dst = [first_node_slot + depth for depth in range(len(accepted_nodes))]
        if src != dst:
            self.cache.move(row, src, dst)
