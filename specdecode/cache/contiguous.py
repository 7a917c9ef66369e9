"""Position-addressed, preallocated KV cache.

Entry `p` of a row holds the keys/values of the token at position `p` of that sequence.
A forward pass writes its tokens at positions `start .. start+T-1`; attention reads
positions `< start + t + 1`. Rejected draft tokens therefore need no undo: rolling back
is setting the row's length (`truncate`), and the stale entries are masked until they
are overwritten. Nothing is ever copied on rollback.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def per_layer(value: int | Sequence[int], num_layers: int, name: str) -> list[int]:
    """A cache's kv heads or head dim for each layer: one int for all, or one per layer (Gemma 4's
    global layers have wider heads than its windowed ones)."""
    if isinstance(value, int):
        return [value] * num_layers
    if len(value) != num_layers:
        raise ValueError(f"{name} gives {len(value)} layers, the cache has {num_layers}")
    return [int(v) for v in value]


def check_committed(lengths: list[int], rows: list[int], positions: torch.Tensor) -> None:
    """ValueError unless every position of row b in `positions` [B, L] is one its row holds (< its
    length): a reader of a cache sees committed entries only."""
    top = positions.max(dim=1).values.tolist() if positions.numel() else []
    for row, last in zip(rows, top):
        if not 0 <= last < lengths[row]:
            raise ValueError(f"position {last} of cache row {row} is not committed (the row holds {lengths[row]})")
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"cache positions must be >= 0, got {int(positions.min())}")


@dataclass
class CacheLayout:
    """Where a cache keeps key/value `j` of kv head `h` for batch row `b` of a pass, in elements
    from a layer's base tensor: tables[b, j // block] * block_stride + (j % block) * key_stride
    + h * head_stride. A contiguous cache has one block per row; a paged cache a block table."""
    keys: list[torch.Tensor]         # [layers] base tensors
    values: list[torch.Tensor]
    tables: torch.Tensor             # [B, blocks] int32
    block: int
    block_stride: int
    key_stride: int
    head_stride: int


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int | Sequence[int],
                 head_dim: int | Sequence[int], max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        shapes = [(batch_size, h, max_len, d) for h, d in zip(per_layer(num_kv_heads, num_layers, "num_kv_heads"),
                                                              per_layer(head_dim, num_layers, "head_dim"))]
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.max_len = max_len
        self.batch_size = batch_size
        # Committed length of each row (python ints: read on the host every step anyway).
        self.lengths = [0] * batch_size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def truncate(self, row: int, length: int) -> None:
        """Roll a row back (or forward after a write) to `length` valid positions."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cache length must be in [0, {self.max_len}], got {length}")
        self.lengths[row] = length

    def move(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy the entries at slots `src` of a row to slots `dst` (tree compaction: the accepted
        path moves to consecutive slots; src[i] >= dst[i], all sources read before any write)."""
        if src != dst:
            src_t, dst_t = torch.tensor(src), torch.tensor(dst)
            for cache in self.keys + self.values:
                cache[row, :, dst_t] = cache[row, :, src_t]

    def reset(self, row: int | None = None) -> None:
        rows = range(self.batch_size) if row is None else [row]
        for r in rows:
            self.lengths[r] = 0

    def read(self, layer: int, rows: list[int], positions: torch.Tensor,   # [B, L] int64
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer `layer`'s keys and values of `rows` at committed `positions` (each below its
        row's length), [B, kv_heads, L, head_dim]; nothing is written. A drafter that reads the target's
        keys gets them this way (drafters/base.TargetCacheView)."""
        check_committed(self.lengths, rows, positions)
        index = torch.tensor(rows, device=self.keys[layer].device)[:, None], positions.to(self.keys[layer].device)
        return (self.keys[layer][index[0], :, index[1]].transpose(1, 2),
                self.values[layer][index[0], :, index[1]].transpose(1, 2))

    def layout(self, rows: list[int], starts: list[int], num_tokens: int) -> CacheLayout:
        """Addresses of the entries a pass writes and reads, for native kernels (see CacheLayout)."""
        if max(starts) + num_tokens > self.max_len:
            raise ValueError(f"positions up to {max(starts) + num_tokens - 1} exceed the cache ({self.max_len})")
        _, heads, max_len, head_dim = self.keys[0].shape
        return CacheLayout(self.keys, self.values, torch.tensor(rows, dtype=torch.int32)[:, None], max_len,
                           heads * max_len * head_dim, head_dim, max_len * head_dim)

    def write(self, layer: int, rows: torch.Tensor | None, start: int | torch.Tensor,
              keys: torch.Tensor,     # [B, kv_heads, T, head_dim]
              values: torch.Tensor,   # [B, kv_heads, T, head_dim]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values at positions start..start+T-1 and return this layer's cache
        for the rows, cut to the longest position needed: [B, kv_heads, L, head_dim].

        `start` is an int when every row starts at the same position and rows is None
        (the fast path: one slice assignment), else a [B] tensor of per-row starts."""
        cache_k, cache_v = self.keys[layer], self.values[layer]
        num_tokens = keys.shape[2]
        if isinstance(start, int) and rows is None:
            end = start + num_tokens
            cache_k[:, :, start:end] = keys
            cache_v[:, :, start:end] = values
            return cache_k[:, :, :end], cache_v[:, :, :end]
        start_t = torch.as_tensor(start, device=keys.device).reshape(-1)
        positions = start_t[:, None] + torch.arange(num_tokens, device=keys.device)  # [B, T]
        row_ids = rows if rows is not None else torch.arange(keys.shape[0], device=keys.device)
        end = int(positions.max()) + 1
        # Advanced indexing puts the indexed dims first: cache[row, :, pos] -> [B, T, kv_heads, hd].
        cache_k[row_ids[:, None], :, positions] = keys.transpose(1, 2)
        cache_v[row_ids[:, None], :, positions] = values.transpose(1, 2)
        if rows is None:
            return cache_k[:, :, :end], cache_v[:, :, :end]
        return cache_k[row_ids, :, :end], cache_v[row_ids, :, :end]
