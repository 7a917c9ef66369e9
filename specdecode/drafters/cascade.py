"""Cascade drafting: prompt lookup where the text repeats itself, a model drafter elsewhere: the
trained EAGLE head, or with a draft model (`--draft`) that model.

Per row and step: if the row's last `ngram_min`..`ngram_max` tokens occur earlier in its text,
the lookup continuation is the draft (free, and long when the answer copies the prompt, as in
summarization or RAG); otherwise the second drafter drafts (the EAGLE head: about one target layer
per token; a draft model: its own step per token). A row it skipped catches up on the next step it
drafts: its cache is position-addressed and the catch-up pass covers every token the target has
committed since (eagle.py, model.py).

`lookup="suffix"` (the default over a draft model; n-gram lookup is the default over an EAGLE head)
looks the text up in a suffix index instead (suffix.py: the request's own text and the last
finished outputs; its tree's main path is the draft), and only when that path is at least
`lookup_min_tokens` long (default: the step's draft size), i.e. where the text has a long repeat;
shorter matches are left to the second drafter.

Lookup drafts are point masses. When the head samples (probs given) in the same step, a lookup
row gets one-hot distributions, which is the exact distribution its draft came from, so
verification stays lossless.
"""
from __future__ import annotations

import dataclasses

import torch

from .base import DraftProposal, Drafter, DrafterCapabilities, DrafterError, DrafterState
from .registry import register
from .eagle import EagleDrafter
from .model import DRAFT_CONTEXT, ModelDrafter
from .ngram import NgramDrafter, predicted
from .suffix import SuffixDrafter

LOOKUPS = ("ngram", "suffix")


@register("cascade")
class CascadeDrafter(Drafter):
    capabilities = DrafterCapabilities(needs_target_hidden=True, has_state=True)   # the EAGLE head's

    def __init__(self, target, draft=None, drafter_path=None, fast: bool = True, ngram_min: int = 3,
                 ngram_max: int = 5, min_confidence: float | None = None, draft_confidence: float = 0.4,
                 draft_context: int = DRAFT_CONTEXT, head_vocab: int = 0, head_rank: str = "freq",
                 lookup: str | None = None, lookup_min_tokens: int = 0, **_: object) -> None:
        self.ngram = NgramDrafter(target, ngram_min, ngram_max)      # validates the sizes
        lookup = lookup if lookup is not None else ("suffix" if draft is not None else "ngram")
        if lookup not in LOOKUPS:
            raise DrafterError(f"lookup must be one of {', '.join(LOOKUPS)}, got {lookup!r}")
        if isinstance(lookup_min_tokens, bool) or not isinstance(lookup_min_tokens, int) \
                or not 0 <= lookup_min_tokens <= 64:
            raise DrafterError(f"lookup_min_tokens must be an integer in [0, 64] (0: the step's draft size), "
                               f"got {lookup_min_tokens!r}")
        self.suffix = SuffixDrafter(target) if lookup == "suffix" else None
        self.lookup_min_tokens = lookup_min_tokens
        if draft is not None:                                        # a draft model behind the lookup
            self.head = ModelDrafter(target, draft, draft_confidence=draft_confidence,
                                     draft_context=draft_context, head_vocab=head_vocab,
                                     head_rank=head_rank)
            self.matches_target = True
        else:
            self.head = EagleDrafter(target, drafter_path, fast,
                                     **({} if min_confidence is None else {"min_confidence": min_confidence}))
            self.matches_target = self.head.matches_target
        # the head's cost and needs (a lookup row costs ~nothing); predicted outputs are looked up first
        self.capabilities = dataclasses.replace(self.head.capabilities, drafts_predictions=True)
        self.lookup_steps = self.head_steps = 0          # row-steps drafted by each (for reports)

    def draft_model(self):
        return self.head.draft_model()

    def memory(self) -> object:
        return None if self.suffix is None else self.suffix.memory()

    def restore(self, memory: object) -> None:
        if self.suffix is not None:
            self.suffix.restore(memory)

    def prepare(self, batch_size: int, max_len: int) -> DrafterState:
        return self.head.prepare(batch_size, max_len)     # all per-row state lives in the second drafter

    def use_draft_cache(self, cache) -> DrafterState:
        return self.head.use_draft_cache(cache)

    def prefill(self, seqs) -> None:
        self.head.prefill(seqs)

    def close(self) -> None:
        self.head.close()

    def observe(self, seqs, starts, hidden):
        self.head.observe(seqs, starts, hidden)

    def propose(self, seqs, max_tokens):
        drafts: list[list[int] | None] = []
        for s, k in zip(seqs, max_tokens):
            found = predicted(s, k)              # a predicted output, where it aligns
            if found:
                pass
            elif self.suffix is not None:
                found = self.suffix.propose([s], [k]).main_path(0) if k else []
                if len(found) < min(self.lookup_min_tokens or k, k):
                    found = []                   # a short match: the second drafter does better
            else:
                found = self.ngram.draft_one(s.token_ids, k, self.ngram.index(s)) if k else []
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
        if self.suffix is not None:              # finished outputs join its global index
            self.suffix.commit(seqs, proposal, num_accepted)
        if proposal.step_state is None:          # lookup rows only (or no propose): the head drafted nothing
            return
        rows, sub = proposal.step_state
        self.head.commit([seqs[b] for b in rows], sub, [num_accepted[b] for b in rows])
