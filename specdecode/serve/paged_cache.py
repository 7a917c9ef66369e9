"""Paged KV cache: fixed-size blocks shared by all requests, with the `KVCache` interface.

Keys and values of every layer live in one pool of blocks, `[num_blocks, block_size,
kv_heads, head_dim]`; each cache row (one running request) owns a block table. Blocks are
allocated as a row grows (by the writes of a forward pass) and freed when the row rolls back
past a block boundary (`truncate`) or ends (`release`), so memory follows the tokens actually
held, not a worst-case `[batch, max_len]` slab.

Admission is by reservation: a request reserves the blocks its prompt + max_tokens can ever
need before it is admitted (`reserve`), so the pool can never run dry in the middle of a step
(no preemption). Writes past a row's reservation are padding of a ragged batch (slots after a
row's own drafts, drafts past its token budget); they go to a scratch block that is never a
real position of any row, are masked by attention and never read back.

`write` has the contract of `KVCache.write`: it stores the keys/values of one layer and
returns this layer's keys/values for the rows, `[B, kv_heads, L, head_dim]`, gathered from
the blocks. The forward pass calls `write` for layers 0..N-1 in order with the same rows and
positions, so the position -> slot plan is built once per pass, at layer 0.
"""
from __future__ import annotations

import math

import torch

from ..kv_cache import CacheLayout

SCRATCH = 0          # block 0: target of padding writes, never owned by a row


def _pool(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed pool tensor, on the CPU on 2 MB pages where the kernel grants them (madvise, as packed
    weights get: fast/linear.weight_empty). A decode step reads each row's blocks, scattered over the
    pool; with 4 KB pages every block costs TLB misses. SmolLM2-135M, 1500 tokens per row, scattered
    blocks, 2 threads of an AMD EPYC family 26 (Zen 5), alternating: 8 rows 13.4 -> 12.8 ms per step,
    32 rows 51.9 -> 48.3 ms."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    from ..fast.linear import weight_empty
    return weight_empty(math.prod(shape), dtype).view(shape).zero_()


class CacheFull(RuntimeError):
    """A reservation does not fit in the free blocks (the scheduler checks `can_reserve` first)."""


class PagedKVCache:
    def __init__(self, num_layers: int, num_rows: int, num_kv_heads: int, head_dim: int, max_len: int,
                 num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the scratch block), got {num_blocks}")
        if num_rows < 1 or max_len < 1:
            raise ValueError(f"num_rows and max_len must be >= 1, got {num_rows} and {max_len}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.keys = [_pool(shape, dtype, device) for _ in range(num_layers)]
        self.values = [_pool(shape, dtype, device) for _ in range(num_layers)]
        self.block_size, self.num_blocks, self.max_len = block_size, num_blocks, max_len
        self.batch_size = num_rows                 # number of rows (KVCache naming)
        self.device = torch.device(device)
        self.lengths = [0] * num_rows              # committed positions of each row
        self.tables: list[list[int]] = [[] for _ in range(num_rows)]   # row -> block ids in position order
        self.limits = [0] * num_rows               # reserved tokens of each row
        self.free: list[int] = list(range(num_blocks - 1, SCRATCH, -1))   # a stack; SCRATCH never free
        self.reserved_blocks = 0                   # sum of reservations (admission budget)
        self._plan = None
        self.block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * self.keys[0].element_size()

    # ------------------------------------------------------------ accounting
    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def used_blocks(self) -> int:
        return self.usable_blocks - len(self.free)

    def nbytes(self) -> int:
        """Capacity: bytes of the whole pool (all layers, keys and values)."""
        return self.num_blocks * self.block_bytes

    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes

    def can_reserve(self, tokens: int) -> bool:
        return self.reserved_blocks + self.blocks_for(tokens) <= self.usable_blocks

    def reserve(self, row: int, tokens: int) -> None:
        """Give an idle row a budget of `tokens` positions (blocks come as it grows)."""
        if self.limits[row] or self.tables[row]:
            raise ValueError(f"cache row {row} is in use")
        if not 1 <= tokens <= self.max_len:
            raise ValueError(f"a row holds 1..{self.max_len} tokens, got {tokens}")
        if not self.can_reserve(tokens):
            raise CacheFull(f"{self.blocks_for(tokens)} blocks asked for, "
                            f"{self.usable_blocks - self.reserved_blocks} unreserved")
        self.limits[row] = tokens
        self.reserved_blocks += self.blocks_for(tokens)
        self.lengths[row] = 0

    def release(self, row: int) -> None:
        """The row's request ended: free its blocks and its reservation."""
        self.free.extend(reversed(self.tables[row]))
        self.tables[row] = []
        self.reserved_blocks -= self.blocks_for(self.limits[row])
        self.limits[row] = 0
        self.lengths[row] = 0

    def truncate(self, row: int, length: int) -> None:
        """Set a row's length; blocks wholly past it go back to the pool."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cache length must be in [0, {self.max_len}], got {length}")
        self.lengths[row] = length
        keep = self.blocks_for(length)
        table = self.tables[row]
        while len(table) > keep:
            self.free.append(table.pop())

    def move(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy the entries at slots `src` of a row to slots `dst` (tree compaction; see KVCache.move)."""
        if src == dst:
            return
        table = torch.tensor(self.tables[row], dtype=torch.long)
        src_t, dst_t = torch.tensor(src), torch.tensor(dst)
        src_at = (table[src_t // self.block_size], src_t % self.block_size)
        dst_at = (table[dst_t // self.block_size], dst_t % self.block_size)
        for pool in self.keys + self.values:
            pool[dst_at] = pool[src_at]

    def reset(self, row: int | None = None) -> None:
        for r in (range(self.batch_size) if row is None else [row]):
            self.truncate(r, 0)

    # ------------------------------------------------------------ forward-pass interface
    def _grow(self, row: int, end: int) -> None:
        """Own the blocks for positions < min(end, reservation)."""
        need = self.blocks_for(min(end, self.limits[row]))
        table = self.tables[row]
        while len(table) < need:
            table.append(self.free.pop())     # cannot be empty: reservations bound the tables

    def _block_tables(self, row_ids: list[int], starts: list[int], num_tokens: int) -> tuple[torch.Tensor, int]:
        """Grow the rows for positions < start + num_tokens; their block tables [B, blocks]
        (SCRATCH past what a row owns) and the key length of the pass."""
        for row, s in zip(row_ids, starts):
            self._grow(row, s + num_tokens)
        key_len = max(starts) + num_tokens
        width = self.blocks_for(key_len)
        table = torch.full((len(row_ids), width), SCRATCH, dtype=torch.long)  # [B, blocks]
        for b, row in enumerate(row_ids):
            owned = self.tables[row][:width]
            table[b, :len(owned)] = torch.tensor(owned, dtype=torch.long)
        return table, key_len

    def _make_plan(self, rows: torch.Tensor | None, start: int | torch.Tensor, batch: int, num_tokens: int):
        row_ids = list(range(batch)) if rows is None else [int(r) for r in rows.tolist()]
        if isinstance(start, int):
            starts = [start] * batch
        else:
            starts = [int(s) for s in torch.as_tensor(start).reshape(-1).tolist()]
        table, key_len = self._block_tables(row_ids, starts, num_tokens)
        positions = torch.tensor(starts)[:, None] + torch.arange(num_tokens)  # [B, T]
        slot_block = table.gather(1, positions // self.block_size)           # [B, T]
        slot_offset = positions % self.block_size                            # [B, T]
        dev = self.device
        return slot_block.to(dev), slot_offset.to(dev), table.to(dev), key_len

    def layout(self, rows: list[int], starts: list[int], num_tokens: int) -> CacheLayout:
        """Block tables of a pass for native kernels (grows the rows like a pass's first write)."""
        _, block, heads, head_dim = self.keys[0].shape
        table, _ = self._block_tables(rows, starts, num_tokens)
        return CacheLayout(self.keys, self.values, table.to(torch.int32), block, block * heads * head_dim,
                           heads * head_dim, head_dim)

    def write(self, layer: int, rows: torch.Tensor | None, start: int | torch.Tensor,
              keys: torch.Tensor,     # [B, kv_heads, T, head_dim]
              values: torch.Tensor,   # [B, kv_heads, T, head_dim]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, num_tokens, head_dim = keys.shape
        if layer == 0 or self._plan is None:
            self._plan = self._make_plan(rows, start, batch, num_tokens)
        slot_block, slot_offset, table, key_len = self._plan
        pool_k, pool_v = self.keys[layer], self.values[layer]
        # pool[block, offset] is [kv_heads, head_dim]; indexed by [B, T] -> [B, T, kv_heads, head_dim]
        pool_k[slot_block, slot_offset] = keys.transpose(1, 2)
        pool_v[slot_block, slot_offset] = values.transpose(1, 2)
        width = table.shape[1]
        # pool[table]: [B, blocks, block_size, kv_heads, hd] -> [B, kv_heads, L, hd]
        out_k = pool_k[table].view(batch, width * self.block_size, heads, head_dim)[:, :key_len].transpose(1, 2)
        out_v = pool_v[table].view(batch, width * self.block_size, heads, head_dim)[:, :key_len].transpose(1, 2)
        return out_k, out_v
