"""Cascade drafting: prompt lookup where the text repeats itself, the trained EAGLE head elsewhere.

Per row and step: if the row's last `ngram_min`..`ngram_max` tokens occur earlier in its text,
the lookup continuation is the draft (free, and long when the answer copies the prompt, as in
summarization or RAG); otherwise the EAGLE head drafts (about one target layer per token). A row
the head skipped catches up on the next step it drafts: the head's cache is position-addressed
and its catch-up pass recomputes every slot the target has seen since (see eagle.py).

Lookup drafts are point masses. When the head samples (probs given) in the same step, a lookup
row gets one-hot distributions, which is the exact distribution its draft came from, so
verification stays lossless.
"""
from __future__ import annotations

import numpy as np
import torch

from .base import DraftProposal, Drafter, DrafterCapabilities, DrafterState
from .registry import register
from .eagle import EagleDrafter
from .ngram import NgramDrafter, lookup


@register("cascade")
class CascadeDrafter(Drafter):
    capabilities = DrafterCapabilities(needs_target_hidden=True, has_state=True)   # the head's

    def __init__(self, target, drafter_path=None, fast: bool = True, ngram_min: int = 3, ngram_max: int = 5,
                 min_confidence: float | None = None, **_: object) -> None:
        self.ngram = NgramDrafter(target, ngram_min, ngram_max)      # validates the sizes
        self.head = EagleDrafter(target, drafter_path, fast,
                                 **({} if min_confidence is None else {"min_confidence": min_confidence}))
        self.matches_target = self.head.matches_target
        self.lookup_steps = self.head_steps = 0          # row-steps drafted by each (for reports)

    def prepare(self, batch_size: int, max_len: int) -> DrafterState:
        return self.head.prepare(batch_size, max_len)     # all per-row state lives in the head

    def close(self) -> None:
        self.head.close()

    def observe(self, seqs, starts, hidden):
        self.head.observe(seqs, starts, hidden)

    def propose(self, seqs, max_tokens):
        drafts: list[list[int] | None] = []
        for s, k in zip(seqs, max_tokens):
            ids = np.asarray(s.token_ids, dtype=np.int64)
            found = lookup(ids, k, self.ngram.ngram_min, self.ngram.ngram_max) if k else []
            drafts.append(found or None)
        head_rows = [b for b, d in enumerate(drafts) if d is None and max_tokens[b] > 0]
        self.lookup_steps += sum(d is not None for d in drafts)
        self.head_steps += len(head_rows)
        if not head_rows:
            return DraftProposal.from_lists([d or [] for d in drafts])
        sub = self.head.propose([seqs[b] for b in head_rows], [max_tokens[b] for b in head_rows])
        step_state = (head_rows, sub)            # commit hands the head its own rows and proposal
        if len(head_rows) == len(seqs):
            return DraftProposal(sub.tokens, sub.num_tokens, sub.probs, step_state)
        out = sub.scatter(head_rows, len(seqs), max(sub.k, max((len(d) for d in drafts if d), default=0)))
        for b, d in enumerate(drafts):
            if d:
                out.tokens[b, :len(d)] = torch.tensor(d, dtype=torch.long)
                out.num_tokens[b] = len(d)
                if out.probs is not None:        # a point mass as a distribution
                    out.probs[b, torch.arange(len(d)), out.tokens[b, :len(d)].to(out.probs.device)] = 1.0
        out.step_state = step_state
        return out

    def commit(self, seqs, proposal, num_accepted):
        if proposal.step_state is None:          # lookup rows only (or no propose): the head drafted nothing
            return
        rows, sub = proposal.step_state
        self.head.commit([seqs[b] for b in rows], sub, [num_accepted[b] for b in rows])
