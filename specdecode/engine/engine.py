"""The speculative decoding loop over a batch of sequences.

One `step` is four calls: draft, score + verify, commit, stats. Plain decoding is the
same loop with an empty draft (k = 0), so both paths share every line of sampling code.

Cache bookkeeping: the target cache of a row holds entries for `token_ids[:length]`.
The tokens after that ("pending": normally just the last emitted token) are fed in
the next pass together with the drafts, so every step is one target forward pass.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..drafters.base import DraftProposal, Drafter
from ..params import ParamError, SamplingParams
from ..sampling import probs_from_logits, transform_logits
from ..verify import verify
from .sequence import Sequence

StreamCallback = Callable[[Sequence, list[int]], None]


class SpecEngine:
    def __init__(self, target, drafter: Drafter | None = None, num_speculative_tokens: int = 5) -> None:
        if not isinstance(num_speculative_tokens, int) or not 0 <= num_speculative_tokens <= 32:
            raise ParamError(f"num_speculative_tokens must be an integer in [0, 32], got {num_speculative_tokens!r}")
        self.target = target                      # LoadedModel
        self.model = target.model
        self.drafter = drafter if num_speculative_tokens > 0 else None
        self.k = num_speculative_tokens if drafter is not None else 0
        self.slack = self.k + 2                   # cache room for padded writes past a row's end

    @property
    def _wants_hidden(self) -> bool:
        return self.drafter is not None and self.drafter.uses_target_hidden

    # ------------------------------------------------------------------ public
    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 on_tokens: StreamCallback | None = None) -> list[Sequence]:
        """Run every prompt to completion as one batch; returns the finished sequences."""
        context = self.model.max_len
        vocab = self.model.vocab_size
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not prompt:
                raise ParamError(f"prompt {i} is empty: at least one token is required")
            if len(prompt) + p.max_tokens > context:
                raise ParamError(f"prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) exceeds the "
                                 f"model's context of {context} tokens")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ParamError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            p.validate_vocab(vocab)
        started = time.perf_counter()
        device = self.model.device
        seqs = [Sequence(i, prompt, p, self.target.eos_token_ids, row=i, device=device)
                for i, (prompt, p) in enumerate(zip(prompts, params))]
        max_len = max(len(s.prompt_ids) + s.params.max_tokens for s in seqs) + self.slack
        self.cache = self.model.new_cache(len(seqs), max_len)
        self.context = max_len - self.slack
        if self.drafter is not None:
            self.drafter.prepare(len(seqs), max_len)
        self._prefill(seqs)
        prefill_done = time.perf_counter()
        for s in seqs:
            s.stats.prefill_seconds = prefill_done - started
        try:
            running = list(seqs)
            while running:
                self.step(running, on_tokens)
                running = [s for s in running if not s.finished]
        finally:
            if self.drafter is not None:
                self.drafter.close()
        total = time.perf_counter() - started
        for s in seqs:
            s.stats.total_seconds = total
        return seqs

    # ------------------------------------------------------------------ steps
    def _prefill(self, seqs: list[Sequence]) -> None:
        """Write all prompt tokens but the last into the target cache (the last one is
        pending and goes into the first step with the first drafts)."""
        lengths = [len(s.prompt_ids) - 1 for s in seqs]
        width = max(lengths)
        if width == 0:
            return
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, s in enumerate(seqs):
            tokens[row, :lengths[row]] = torch.tensor(s.prompt_ids[:-1])
        out = self.model.forward(tokens.to(self.model.device), self.cache, 0, return_hidden=self._wants_hidden,
                                 logit_index=torch.zeros(len(seqs), 0, dtype=torch.long, device=self.model.device))
        if self._wants_hidden:
            self.drafter.observe(seqs, [0] * len(seqs), out[1])
        for s, n in zip(seqs, lengths):
            self.cache.truncate(s.row, n)

    def _room(self, s: Sequence) -> int:
        """Drafts this row may carry: k, capped so the output never passes max_tokens
        (the step always adds one token of its own) and the cache never overflows."""
        left_in_budget = s.params.max_tokens - s.num_output - 1
        left_in_context = self.context - len(s.token_ids)
        return max(0, min(self.k, left_in_budget, left_in_context))

    def step(self, seqs: list[Sequence], on_tokens: StreamCallback | None = None) -> None:
        # 1. draft
        t0 = time.perf_counter()
        room = [self._room(s) for s in seqs]
        if self.drafter is not None and max(room) > 0:
            proposal = self.drafter.propose(seqs, room)
        else:
            proposal = DraftProposal.empty(len(seqs))
        t1 = time.perf_counter()
        # 2. score all drafts in one target pass, then verify
        target_probs = self._score(seqs, proposal)                      # [B, k+1, vocab]
        device = target_probs.device            # drafts may come from the host (n-gram lookup)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=device)
        generators = [s.generator for s in seqs]
        result = verify(proposal.tokens.to(device), proposal.num_tokens.to(device), proposal.probs,
                        target_probs, greedy, generators)
        t2 = time.perf_counter()
        # 3. commit: append tokens, roll the target cache back to the accepted prefix
        num_accepted = result.num_accepted.tolist()
        emitted_rows = result.tokens.tolist()
        num_drafted = proposal.num_tokens.tolist()
        for row, s in enumerate(seqs):
            emitted = emitted_rows[row][:num_accepted[row] + 1]
            old_len = len(s.token_ids)
            appended = s.append(emitted, self.target.tokenizer.decode if s.params.stop else None)
            self.cache.truncate(s.row, old_len + num_accepted[row])
            # 4. stats
            s.stats.record_step(num_drafted[row], min(num_accepted[row], appended), appended)
            s.stats.draft_seconds += t1 - t0
            s.stats.verify_seconds += t2 - t1
            if on_tokens is not None:
                on_tokens(s, emitted[:appended])
        if self.drafter is not None:
            self.drafter.commit(seqs, proposal, num_accepted)

    def _score(self, seqs: list[Sequence], proposal: DraftProposal) -> torch.Tensor:
        """One target forward over each row's pending tokens + drafts; returns the
        transformed target probabilities at the k+1 positions that verify needs."""
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
        same_start = all(x == starts[0] for x in starts) and len(seqs) == self.cache.batch_size
        if same_start and [s.row for s in seqs] == list(range(len(seqs))):
            out = self.model.forward(tokens, self.cache, starts[0], logit_index=logit_index,
                                     return_hidden=self._wants_hidden)
        else:
            row_ids = torch.tensor([s.row for s in seqs], device=device)
            out = self.model.forward(tokens, self.cache, torch.tensor(starts, device=device),
                                     rows=row_ids, logit_index=logit_index, return_hidden=self._wants_hidden)
        logits = out
        if self._wants_hidden:
            logits, hidden = out
            self.drafter.observe(seqs, starts, hidden)
        needs_history = any(s.params.uses_penalties for s in seqs)
        transformed = transform_logits(
            logits, [s.params for s in seqs],
            [s.token_ids for s in seqs] if needs_history else None,
            [s.prompt_len for s in seqs] if needs_history else None,
            proposal.tokens.to(device) if k > 0 else None)
        return probs_from_logits(transformed, [s.params for s in seqs])
