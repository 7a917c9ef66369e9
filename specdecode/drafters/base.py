"""The drafter interface, the proposal contract and the registry.

A drafter proposes up to k tokens per running sequence. It never touches the target's
KV cache; it gets the sequences (token ids, sampling params, generators) and keeps any
state of its own (a draft model's cache) keyed by the sequence's cache row.

`DraftProposal` is the whole contract between drafting and verification.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ..engine.sequence import Sequence


@dataclass
class DraftProposal:
    tokens: torch.Tensor          # [batch, k] int64 draft tokens; row b valid in [:num_tokens[b]], padding 0
    num_tokens: torch.Tensor      # [batch] int64, 0..k
    probs: torch.Tensor | None    # [batch, k, vocab] float32 distributions the drafts were sampled from
                                  # (after the shared logits transform); None = point mass (lookup drafts)

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def empty(batch: int) -> "DraftProposal":
        return DraftProposal(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long), None)

    def scatter(self, rows: list[int], batch: int, k: int | None = None) -> "DraftProposal":
        """This proposal (made for a subset of a batch) placed at `rows` of a batch of `batch`
        rows, k columns (default self.k); the other rows get no drafts."""
        k = self.k if k is None else k
        index = torch.tensor(rows, dtype=torch.long)
        tokens = torch.zeros(batch, k, dtype=torch.long)                              # [batch, k]
        tokens[index, :self.k] = self.tokens.cpu()
        num_tokens = torch.zeros(batch, dtype=torch.long)                             # [batch]
        num_tokens[index] = self.num_tokens.cpu()
        probs = None
        if self.probs is not None:
            probs = self.probs.new_zeros(batch, k, self.probs.shape[-1])             # [batch, k, vocab]
            probs[index.to(probs.device), :self.k] = self.probs
        return DraftProposal(tokens, num_tokens, probs)

    @staticmethod
    def from_lists(drafts: list[list[int]]) -> "DraftProposal":
        """Point-mass proposal from per-row token lists (ragged)."""
        k = max((len(d) for d in drafts), default=0)
        tokens = torch.zeros(len(drafts), k, dtype=torch.long)
        for row, draft in enumerate(drafts):
            tokens[row, :len(draft)] = torch.tensor(draft, dtype=torch.long)
        return DraftProposal(tokens, torch.tensor([len(d) for d in drafts], dtype=torch.long), None)


class Drafter(ABC):
    """Two required methods and a feedback hook, in the spirit of HF's CandidateGenerator."""

    name: ClassVar[str]
    uses_target_hidden: ClassVar[bool] = False   # True: the engine hands over the target's hidden states

    def prepare(self, batch_size: int, max_len: int) -> None:
        """Called once before a batch of sequences starts (allocate per-row state)."""

    @abstractmethod
    def propose(self, seqs: list["Sequence"], max_tokens: list[int]) -> DraftProposal:
        """Up to max_tokens[b] draft tokens for each sequence (0 allowed)."""

    def commit(self, seqs: list["Sequence"], proposal: DraftProposal, num_accepted: list[int]) -> None:
        """Feedback after verification: the first num_accepted[b] drafts were kept and
        seqs[b].token_ids already holds them plus one recovered/bonus token."""

    def observe(self, seqs: list["Sequence"], starts: list[int],
                hidden: torch.Tensor,      # [batch, T, hidden] target states before the final norm
                ) -> None:
        """Called (only when uses_target_hidden) after every target pass, prefill included:
        hidden[b, t] belongs to position starts[b] + t of seqs[b]. Positions past what the step
        commits (rejected drafts, padding) are overwritten by later passes."""

    def close(self) -> None:
        """Free per-batch state."""


class DrafterError(ValueError):
    """A drafter cannot be built with these options; the message says why."""
