"""Cascade drafting: prompt lookup where the text repeats itself, a model drafter elsewhere: the
trained EAGLE head, or with a draft model (`--draft`) that model (through text when its tokenizer
is not the target's: cross_tokenizer.py).

Per row and step: if the row's last `ngram_min`..`ngram_max` tokens occur earlier in its text,
the lookup continuation is the draft (free, and long when the answer copies the prompt, as in
summarization or RAG); otherwise the second drafter drafts (the EAGLE head: about one target layer
per token; a draft model: its own step per token). A row it skipped catches up on the next step it
drafts: its cache is position-addressed and the catch-up pass covers every token the target has
committed since (eagle.py, model.py).

`lookup="suffix"` (the default over a draft model; n-gram lookup is the default over an EAGLE head)
looks the text up in a suffix index instead (suffix.py: the request's own text and the last
finished outputs; its tree's main path is the draft). A row takes that path where it is predicted
to give more than the second drafter: the expected accepted tokens of each (1 + a + ... + a^n less
the bonus token, with a the acceptance per token each source has had so far: the second drafter's,
and lookup paths' of about that length, from priors), the second drafter's less its drafting time in
target steps (`relative_cost` per token). So a short path is taken over a longer chain of a draft
model whose tokens each cost a good share of a step, and one-token matches, often coincidences, are
not. `lookup_min_tokens=N` (1-64) sets a fixed length threshold instead (docs/drafters.md, "What
was tried").

Where the controller plans a row plain (the second drafter's drafts do not pay there), the engine
still asks for its lookups (`free_drafts`: they cost nothing to make) and verifies one where the
controller predicts that its expected accepted tokens outgrow the larger pass; such steps leave the
row's measured gains alone, so a copy in a summary is drafted while the draft model stays off.

Lookup drafts are point masses. When the head samples (probs given) in the same step, a lookup
row gets one-hot distributions, which is the exact distribution its draft came from, so
verification stays lossless.
"""
from __future__ import annotations

import dataclasses

from ..engine.controller import expected_tokens
from .base import Drafter, DrafterCapabilities, DrafterError, DrafterState, DraftProposal
from .cross_tokenizer import DRAFT_CONTEXT, TextModelDrafter
from .eagle import EagleDrafter
from .model import ModelDrafter, same_tokenizer
from .ngram import NgramDrafter, predicted
from .registry import register
from .suffix import SuffixDrafter

LOOKUPS = ("ngram", "suffix")
# acceptance per token of each source before it is measured: the draft model's, and lookup paths' by
# their length (a long match is a copy, one of a token or two often a coincidence; where the values
# come from: docs/drafters.md, "The methods")
PRIORS = {"head": 0.6, "lookup1": 0.4, "lookup2": 0.55, "lookup3": 0.7, "lookup4": 0.8, "lookup8": 0.85}
LENGTHS = (1, 2, 3, 4, 8)               # the lookup length buckets above
PRIOR_WEIGHT = 4.0                      # ... worth this many observed tokens
DECAY = 0.95                            # weight of the past in the measured acceptance (per step)


@register("cascade")
class CascadeDrafter(Drafter):
    capabilities = DrafterCapabilities(needs_target_hidden=True, has_state=True)   # the EAGLE head's

    def __init__(self, target, draft=None, drafter_path=None, fast: bool = True, ngram_min: int = 3,
                 ngram_max: int = 5, min_confidence: float | None = None, draft_confidence: float = 0.4,
                 head_vocab: int = 0, head_rank: str = "freq",
                 lookup: str | None = None, lookup_min_tokens: int = 0, draft_context: int = DRAFT_CONTEXT,
                 **_: object) -> None:
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
        if draft is not None and not same_tokenizer(target, draft):   # another vocabulary: drafts via text
            self.head = TextModelDrafter(target, draft, draft_confidence=draft_confidence, draft_context=draft_context,
                                         head_vocab=head_vocab, head_rank=head_rank)
            self.matches_target = True
        elif draft is not None:                                      # a draft model behind the lookup
            self.head = ModelDrafter(target, draft, draft_confidence=draft_confidence, head_vocab=head_vocab,
                                     head_rank=head_rank)
            self.matches_target = True
        else:
            self.head = EagleDrafter(target, drafter_path, fast,
                                     **({} if min_confidence is None else {"min_confidence": min_confidence}))
            self.matches_target = self.head.matches_target
        # the head's cost and needs (a lookup row costs ~nothing); predicted outputs are looked up first;
        # lookups are offered for rows the controller planned plain too
        self.capabilities = dataclasses.replace(self.head.capabilities, drafts_predictions=True, free_drafts=True)
        self.lookup_steps = self.head_steps = 0          # row-steps drafted by each (for reports)
        # accepted and (accepted + rejections) per source, decayed: a geometric estimate of the
        # acceptance per token (the serving policy's), which predicts what each source's draft gives
        sources = ["head"] + [f"lookup{n}" for n in LENGTHS]
        self.hits = {src: PRIORS[src] * PRIOR_WEIGHT for src in sources}
        self.tries = {src: PRIOR_WEIGHT for src in sources}

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
        if self.suffix is not None:
            self.suffix.prefill(seqs)
        self.head.prefill(seqs)

    def close(self) -> None:
        self.head.close()

    def observe(self, seqs, starts, hidden):
        self.head.observe(seqs, starts, hidden)

    def propose(self, seqs, sizes):
        drafts: list[list[int] | None] = []
        for s, k in zip(seqs, sizes):
            found = predicted(s, k)              # a predicted output, where it aligns
            if found:
                pass
            elif self.suffix is not None:
                found = self.suffix.propose([s], [k]).main_path(0) if k else []
                if found and not self.lookup_pays(len(found), k):
                    found = []                   # the second drafter is predicted to give more
            else:
                found = self.ngram.draft_one(s.token_ids, k, self.ngram.index(s)) if k else []
            drafts.append(found or None)
        head_rows = [b for b, d in enumerate(drafts) if d is None and sizes[b] > 0]
        self.lookup_steps += sum(d is not None for d in drafts)
        self.head_steps += len(head_rows)
        if not head_rows:
            return DraftProposal.from_lists([d or [] for d in drafts])
        sub = self.head.propose([seqs[b] for b in head_rows], [sizes[b] for b in head_rows])
        step_state = (head_rows, sub)            # commit hands the head its own rows and proposal
        if len(head_rows) == len(seqs):
            return DraftProposal(sub.tokens, sub.num_tokens, sub.probs, step_state)
        out = sub.scatter(head_rows, len(seqs), max(sub.k, max((len(d) for d in drafts if d), default=0)))
        out.put_chains({b: d for b, d in enumerate(drafts) if d})
        out.step_state = step_state
        return out

    def free_drafts(self, seqs, rooms, pays):
        """Lookups for rows the controller planned plain (the head's drafts did not pay there, a
        copy still may): each row's predicted output or lookup path, cut to the length that pays most."""
        out = []
        for s, room in zip(seqs, rooms):
            found = predicted(s, room)
            if not found and room:
                found = (self.suffix.propose([s], [room]).main_path(0) if self.suffix is not None
                         else self.ngram.draft_one(s.token_ids, room, self.ngram.index(s)))
            while found and not pays(len(found), self.acceptance("lookup", len(found))):
                found = found[:len(found) // 2]      # a shorter cut of it may still pay (a copy's first tokens)
            out.append(found)
        return out

    @staticmethod
    def _source(source: str, length: int) -> str:
        """The key of `head`, or of a `lookup` path of `length` tokens (its length bucket)."""
        return source if source != "lookup" else f"lookup{max(n for n in LENGTHS if n <= max(length, 1))}"

    def acceptance(self, source: str, length: int = 1) -> float:
        """Measured acceptance per token of `head` drafts, or of `lookup` paths of about `length`
        tokens (from the priors at first)."""
        source = self._source(source, length)
        return self.hits[source] / self.tries[source]

    def lookup_pays(self, length: int, k: int) -> bool:
        """Is a lookup path of `length` tokens predicted to give more than k tokens of the second
        drafter? With lookup_min_tokens set: is it at least that long (or k)?"""
        if self.lookup_min_tokens:
            return length >= min(self.lookup_min_tokens, k)
        lookup = expected_tokens(self.acceptance("lookup", length), min(length, k)) - 1.0
        head = expected_tokens(self.acceptance("head"), k) - 1.0 - k * self.head.capabilities.relative_cost
        return lookup >= head

    def _record(self, source: str, drafted: int, accepted: int) -> None:
        source = self._source(source, drafted)
        self.hits[source] = DECAY * self.hits[source] + accepted
        self.tries[source] = DECAY * self.tries[source] + accepted + (1 if accepted < drafted else 0)

    def commit(self, seqs, proposal, num_accepted):
        if self.suffix is not None:              # finished outputs join its global index
            self.suffix.commit(seqs, proposal, num_accepted)
        head_rows = set(proposal.step_state[0]) if proposal.step_state is not None else set()
        for b, n in enumerate(proposal.num_tokens.tolist()):
            if n > 0:
                self._record("head" if b in head_rows else "lookup", n, int(num_accepted[b]))
        if proposal.step_state is None:          # lookup rows only (or no propose): the head drafted nothing
            return
        rows, sub = proposal.step_state
        self.head.commit([seqs[b] for b in rows], sub, [num_accepted[b] for b in rows])
