"""One description of a forward pass, read by every path that runs one.

A pass writes token t of batch row b at cache slot `starts[b] + t` of cache row `rows[b]` and
gives it a RoPE position and an attention visibility. In a **chain** (prefill, plain decoding,
chain drafts) the position is the slot and a token sees every key at a slot <= its own. In a
**tree** pass the row's pending tokens form a chain and the draft nodes follow it in slot order;
node i sits at position root + depth(i) and sees the committed keys, the pending tokens and the
nodes on its own path (specdecode/tree.py). One rule covers both, per token:

    key slot j is visible  <=>  j < tree_base  or  bit (j - tree_base) of tree_mask is set

with (tree_base, tree_mask) = (own slot, 1) for a chain token and (first node slot, ancestor bits)
for a node; the visible keys, in slot order, are the token's logical keys 0..position. A sliding
window W (Mistral) keeps logical keys position-W+1..position: along a node's own path, as a chain
of the same tokens would. The eager
torch path builds its attention mask from this (`visible`), the fused C decoder reads the same
arrays (`sd_decoder_rows`), and the paged cache sees only slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import ancestor_masks, depths

__all__ = ["ForwardBatch"]


@dataclass
class ForwardBatch:
    tokens: torch.Tensor                  # [B, T] int64
    start: int | torch.Tensor             # slot of tokens[:, 0]: int (every row) or [B] int64
    rows: torch.Tensor | None = None      # [B] cache rows; None = rows 0..B-1
    logit_index: torch.Tensor | None = None   # [B, n] token indices 0..T-1 that need logits; None = all
    positions: torch.Tensor | None = None     # [B, T] int64 RoPE positions; None = chain (start + t)
    tree_base: torch.Tensor | None = None     # [B, T] int64 first slot of the token's tree part (chain: own slot)
    tree_mask: torch.Tensor | None = None     # [B, T] int64 visible tree slots, bit i = slot tree_base + i
    lengths: list[int] | None = None          # real tokens per row (the rest is padding, never read); None: T

    @staticmethod
    def chain(tokens: torch.Tensor, start: int | torch.Tensor, rows: torch.Tensor | None = None,
              logit_index: torch.Tensor | None = None, lengths: list[int] | None = None) -> ForwardBatch:
        return ForwardBatch(tokens, start, rows, logit_index, lengths=lengths)

    @staticmethod
    def tree(tokens: torch.Tensor,        # [B, T]: row b = pending[b] chain tokens, then its nodes, then padding
             start: torch.Tensor,         # [B] int64 slot of each row's first token
             rows: torch.Tensor | None,   # [B]
             pending: list[int],          # chain tokens per row (>= 1: the last one is the tree's root)
             parents: torch.Tensor,       # [B, n] int64 node parents (-1 = root), specdecode/tree.py
             logit_index: torch.Tensor | None = None, lengths: list[int] | None = None) -> ForwardBatch:
        batch, width = tokens.shape
        n = parents.shape[1]
        start = torch.as_tensor(start, dtype=torch.long).reshape(batch).cpu()
        slots = start[:, None] + torch.arange(width)                             # [B, T]
        positions, base, mask = slots.clone(), slots.clone(), torch.ones(batch, width, dtype=torch.long)
        node_depths, node_masks = depths(parents), ancestor_masks(parents)      # [B, n]
        for b, m in enumerate(pending):
            if m < 1 or m + n > width:
                raise ValueError(f"row {b}: {m} pending tokens + {n} nodes do not fit a pass of {width}")
            root = int(start[b]) + m - 1
            positions[b, m:m + n] = root + node_depths[b]
            base[b, m:m + n] = root + 1
            mask[b, m:m + n] = node_masks[b]
        return ForwardBatch(tokens, start, rows, logit_index, positions, base, mask, lengths)

    @property
    def is_chain(self) -> bool:
        return self.tree_base is None

    @property
    def uniform(self) -> bool:
        """Every row starts at the same slot of cache rows 0..B-1, as a chain (the cheapest path)."""
        return self.is_chain and self.rows is None and isinstance(self.start, int)

    def starts(self) -> list[int]:
        """First slot of each row."""
        if isinstance(self.start, int):
            return [self.start] * self.tokens.shape[0]
        return [int(x) for x in torch.as_tensor(self.start).reshape(-1).tolist()]

    def slots(self) -> torch.Tensor:
        """[B, T] int64 cache slot of every token."""
        start = torch.as_tensor(self.starts(), dtype=torch.long)
        return start[:, None] + torch.arange(self.tokens.shape[1])

    def rope_positions(self) -> torch.Tensor:
        """[B, T] int64 RoPE positions."""
        return self.slots() if self.positions is None else self.positions

    def visibility(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tree_base, tree_mask), [B, T] int64 each, for chains too."""
        if self.tree_base is not None:
            return self.tree_base, self.tree_mask
        slots = self.slots()
        return slots, torch.ones_like(slots)

    def visible(self, key_len: int, window: int | None = None) -> torch.Tensor:
        """[B, T, key_len] bool: which cache slots each token attends to; with a sliding `window`,
        only its last `window` logical keys (the visible slots counted in slot order)."""
        base, mask = self.visibility()
        keys = torch.arange(key_len)[None, None, :]                              # [1, 1, L]
        offset = keys - base[:, :, None]                                         # [B, T, L]
        in_tree = (offset >= 0) & (offset < 64)
        bits = (mask[:, :, None] >> offset.clamp(0, 63)) & 1
        seen = (offset < 0) | (in_tree & bits.bool())
        if window is None:
            return seen
        logical = seen.long().cumsum(-1) - 1                                     # [B, T, L] key index on the path
        return seen & (logical > self.rope_positions()[:, :, None] - window)
