"""The model interface every target and draft model implements (`Transformer`, `HFAdapter`).

A pass is described once (`ForwardBatch`, specdecode/forward.py) and run in two calls:

    hidden = model.run(fb, cache)                 # writes K/V at fb's slots; [B, T, D] states
    logits = model.logits(hidden, fb.logit_index)  # [B, n, vocab] float32, only the rows asked for

so a pass that needs no logits (prefill) computes none, and a drafter that reads the target's
features (EAGLE) gets them from the same pass that verification scores. `forward` is the two for
a chain. What the states are is the model's own business: the native decoder returns its last
hidden states before the final norm (what EAGLE heads read); the transformers adapter, whose head
may do more than a matmul, returns its output logits and declares `has_features = False`.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..forward import ForwardBatch

__all__ = ["CausalLM", "HeadRows"]


class HeadRows:
    """An LM head over some token ids only (a draft's reduced head, FR-Spec), made by the model it
    belongs to (`model.head_rows(ids)`): `logits(..., head_rows=h)[..., j]` is token `h.ids[j]`'s
    logit, bitwise the whole head's, computed from those rows of the head matrix alone."""

    def __init__(self, owner, ids: torch.Tensor,     # [n] int64 token ids, ascending, distinct
                 linear=None) -> None:                # the gathered rows as the model's own projection
        self.owner, self.ids, self.linear = owner, ids, linear

    def __len__(self) -> int:
        return int(self.ids.numel())

    @staticmethod
    def checked_ids(ids, vocab_size: int) -> torch.Tensor:   # -> [n] int64
        """`ids` as a head's rows: distinct, ascending, in the vocabulary, a multiple of 32 of them."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        n = ids.numel()
        if n < 32 or n % 32 or n > vocab_size:
            raise ValueError(f"a reduced LM head needs a multiple of 32 token ids in [32, {vocab_size}], got {n}")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError(f"a reduced LM head's token ids must be distinct, ascending and in [0, {vocab_size})")
        return ids


@runtime_checkable
class CausalLM(Protocol):
    vocab_size: int
    max_len: int                    # positions the model supports (RoPE tables)
    dtype: torch.dtype
    device: torch.device
    supports_trees: bool            # `run` takes tree passes (else chains only)
    has_features: bool              # `run` returns hidden states a drafter may read

    def new_cache(self, batch_size: int, max_len: int): ...

    def weight_bytes(self) -> int: ...

    def run(self, fb: ForwardBatch, cache) -> torch.Tensor: ...          # [B, T, D] states

    def logits(self, hidden: torch.Tensor,                               # [B, T, D] from run
               logit_index: torch.Tensor | None = None,                  # [B, n]; None = all
               head_rows: HeadRows | None = None,                        # those token ids only
               ) -> torch.Tensor: ...                                    # [B, n, vocab] float32

    def head_rows(self, ids: torch.Tensor) -> HeadRows: ...             # ids [n] int64

    def forward(self, tokens: torch.Tensor, cache, start, rows: torch.Tensor | None = None,
                logit_index: torch.Tensor | None = None, head_rows: HeadRows | None = None) -> torch.Tensor: ...
