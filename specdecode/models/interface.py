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

__all__ = ["CausalLM"]


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
               vocab: int | None = None,                                 # ids 0..vocab-1 only
               ) -> torch.Tensor: ...                                    # [B, n, vocab] float32

    def forward(self, tokens: torch.Tensor, cache, start, rows: torch.Tensor | None = None,
                logit_index: torch.Tensor | None = None, vocab: int | None = None) -> torch.Tensor: ...
