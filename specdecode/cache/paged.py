"""Paged KV cache: fixed-size blocks shared by all requests, with the `KVCache` interface.

Keys and values of every layer live in one pool of blocks, `[num_blocks, block_size,
kv_heads, head_dim]` (a shape that may differ between layers, as in Gemma 4); each cache row (one
running request) owns a block table. Blocks are allocated as a row grows (by the writes of a
forward pass) and freed when the row rolls back past a block boundary (`truncate`) or ends
(`release`), so memory follows the tokens actually held, not a worst-case `[batch, max_len]` slab.

Admission is by reservation: a request reserves the blocks its prompt + max_tokens can ever
need before it is admitted (`reserve`), so the pool can never run dry in the middle of a step
(no preemption).

Prefix caching (`enable_prefix_caching`; blocks.py): a row's full, committed blocks are
registered under the hash of their tokens and everything before them (`commit`); a new request
takes the registered blocks its prompt starts with (`match`, then `reserve(..., hits)`) and is
prefilled from there. Shared blocks are never written: a row only writes at positions >= its
length, and a matched prefix ends at or before it (rollback never goes below a row's committed
length), so no copy-on-write is needed. Reservations count what a row may still allocate, and
holding an idle cached block takes it out of what can be handed out. Writes past a row's
reservation are padding of a ragged batch (slots after a row's own drafts, drafts past its token
budget); they go to a scratch block that is never a real position of any row, are masked by
attention and never read back.

`write` has the contract of `KVCache.write`: it stores the keys/values of one layer and
returns this layer's keys/values for the rows, `[B, kv_heads, L, head_dim]`, gathered from
the blocks. The forward pass calls `write` for layers 0..N-1 in order with the same rows and
positions, so the position -> slot plan is built once per pass, at layer 0.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .blocks import BlockPool, chain_hashes
from .contiguous import CacheLayout, check_committed, per_layer

SCRATCH = 0          # block 0: target of padding writes, never owned by a row
GROW_BLOCKS = 64     # blocks `grow` copies at a time (a run of zeros, never written, is not copied: not made resident)


def _pool(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed pool tensor, on the CPU on 2 MB pages where the kernel grants them (madvise, as packed
    weights get: fast/linear.weight_empty): a decode step reads each row's blocks, scattered over the
    pool, and with 4 KB pages every block costs TLB misses. Its pages become resident as blocks are first
    written (fast/linear.zeroed_empty): a pool sized for the whole context costs the memory of its use."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    from ..fast.linear import zeroed_empty
    return zeroed_empty(math.prod(shape), dtype).view(shape)


class CacheFull(RuntimeError):
    """A reservation does not fit in the free blocks (the scheduler checks `can_reserve` first)."""


class PagedKVCache:
    def __init__(self, num_layers: int, num_rows: int, num_kv_heads: int | Sequence[int], head_dim: int | Sequence[int],
                 max_len: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the scratch block), got {num_blocks}")
        if num_rows < 1 or max_len < 1:
            raise ValueError(f"num_rows and max_len must be >= 1, got {num_rows} and {max_len}")
        shapes = [(num_blocks, block_size, h, d) for h, d in zip(per_layer(num_kv_heads, num_layers, "num_kv_heads"),
                                                                 per_layer(head_dim, num_layers, "head_dim"))]
        self.keys = [_pool(shape, dtype, device) for shape in shapes]
        self.values = [_pool(shape, dtype, device) for shape in shapes]
        self.block_size, self.num_blocks, self.max_len = block_size, num_blocks, max_len
        self.batch_size = num_rows                 # number of rows (KVCache naming)
        self.device = torch.device(device)
        self.lengths = [0] * num_rows              # committed positions of each row
        self.tables: list[list[int]] = [[] for _ in range(num_rows)]   # row -> block ids in position order
        self.limits = [0] * num_rows               # reserved tokens of each row
        self.pool = BlockPool(num_blocks, first=SCRATCH + 1)          # SCRATCH is never handed out
        self.pending = 0                           # blocks rows may still allocate (sum over rows)
        self.salt: bytes | None = None             # prefix caching: on when set (enable_prefix_caching)
        self.row_hashes: list[list[bytes]] = [[] for _ in range(num_rows)]   # hashes of a row's full blocks
        self.row_tables: list[torch.Tensor | None] = [None] * num_rows   # a row's table as int32, None: stale
        self._plan = None
        self.block_bytes = 2 * sum(k[0].numel() for k in self.keys) * self.keys[0].element_size()

    def grow(self, num_rows: int, num_blocks: int) -> None:
        """More rows (idle) and blocks (free), keeping every block's contents and every row's table:
        cached prefixes survive (`LLM.generate` grows its engine between calls)."""
        for _ in range(num_rows - self.batch_size):
            self.lengths.append(0)
            self.tables.append([])
            self.limits.append(0)
            self.row_hashes.append([])
            self.row_tables.append(None)
        self.batch_size = max(self.batch_size, num_rows)
        if num_blocks > self.num_blocks:
            for pools in (self.keys, self.values):
                for i, pool in enumerate(pools):
                    bigger = _pool((num_blocks, *pool.shape[1:]), pool.dtype, pool.device)
                    for first in range(0, self.num_blocks, GROW_BLOCKS):   # blocks never written: left unmapped
                        part = pool[first:first + GROW_BLOCKS]
                        if part.any():
                            bigger[first:first + part.shape[0]] = part
                    pools[i] = bigger
            self.pool.grow(num_blocks)
            self.num_blocks = num_blocks

    # ------------------------------------------------------------ accounting
    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def used_blocks(self) -> int:
        """Blocks held by rows (idle cached prefixes are not counted: they are there to be taken)."""
        return self.pool.held

    @property
    def cached_blocks(self) -> int:
        """Idle blocks kept for their prefix."""
        return len(self.pool.idle)

    @property
    def reserved_blocks(self) -> int:
        """Blocks held or still reservable by rows (the admission budget in use)."""
        return self.pool.held + self.pending

    def nbytes(self) -> int:
        """Capacity: bytes of the whole pool (all layers, keys and values)."""
        return self.num_blocks * self.block_bytes

    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes

    def can_reserve(self, tokens: int, hits: list[int] = ()) -> bool:
        """Whether a row of `tokens` positions whose first blocks are the matched `hits` fits."""
        need = self.blocks_for(tokens) - len(hits)
        return self.pool.held + self.pending + need + self.pool.revived(hits) <= self.usable_blocks

    def reserve(self, row: int, tokens: int, hits: list[int] = ()) -> None:
        """Give an idle row a budget of `tokens` positions (blocks come as it grows); `hits`: the
        registered blocks its tokens start with (from `match`), held by it from now on, its length
        the positions they cover."""
        if self.limits[row] or self.tables[row]:
            raise ValueError(f"cache row {row} is in use")
        if not 1 <= tokens <= self.max_len:
            raise ValueError(f"a row holds 1..{self.max_len} tokens, got {tokens}")
        if len(hits) * self.block_size >= tokens:
            raise ValueError(f"{len(hits)} matched blocks cover all {tokens} tokens of the row")
        if not self.can_reserve(tokens, hits):
            raise CacheFull(f"{self.blocks_for(tokens) - len(hits)} blocks asked for, "
                            f"{self.usable_blocks - self.reserved_blocks} unreserved")
        for block in hits:
            self.pool.hold(block)
        self.tables[row] = list(hits)
        self.row_tables[row] = None
        self.row_hashes[row] = [self.pool.hash_of[b] for b in hits]
        self.limits[row] = tokens
        self.pending += self.blocks_for(tokens) - len(hits)
        self.lengths[row] = len(hits) * self.block_size

    def release(self, row: int) -> None:
        """The row's request ended: let go of its blocks and its reservation."""
        table = self.tables[row]
        self.pending -= self.blocks_for(self.limits[row]) - len(table)
        for block in reversed(table):
            self.pool.drop(block)
        self.tables[row] = []
        self.row_tables[row] = None
        self.row_hashes[row] = []
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
            self.pool.drop(table.pop())
            self.pending += 1
            self.row_tables[row] = None
        del self.row_hashes[row][keep:]

    # ------------------------------------------------------------ prefix caching
    def enable_prefix_caching(self, salt: bytes, max_cached_blocks: int | None = None) -> None:
        """Register full committed blocks and match prompts against them. `salt`: what else the
        keys and values depend on (model, weights, dtype); `max_cached_blocks`: most idle cached
        blocks kept (None: as many as the pool has room for)."""
        self.salt = salt
        self.pool.max_idle = max_cached_blocks

    @property
    def prefix_caching(self) -> bool:
        return self.salt is not None

    def commit(self, row: int, tokens: list[int]) -> None:
        """Register the row's full blocks below its length (committed: never written again);
        `tokens`: the row's tokens from position 0 (at least its length of them)."""
        known = self.row_hashes[row]
        full = min(self.lengths[row] // self.block_size, len(self.tables[row]))
        if self.salt is None or len(known) >= full:
            return
        hashes = chain_hashes(tokens, self.block_size, self.salt, full, known)
        for block, key in zip(self.tables[row][len(known):], hashes[len(known):]):
            self.pool.register(block, key)
        self.row_hashes[row] = hashes

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

    def read(self, layer: int, rows: list[int], positions: torch.Tensor,   # [B, L] int64
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer `layer`'s keys and values of `rows` at committed `positions` (each below its
        row's length), [B, kv_heads, L, head_dim]; nothing is written (see KVCache.read)."""
        check_committed(self.lengths, rows, positions)
        width = max(len(self.tables[r]) for r in rows)
        table = torch.full((len(rows), width), SCRATCH, dtype=torch.long)                     # [B, blocks]
        for b, r in enumerate(rows):
            table[b, :len(self.tables[r])] = torch.tensor(self.tables[r], dtype=torch.long)
        positions = positions.cpu()
        blocks = table.gather(1, positions // self.block_size)                                 # [B, L]
        at = blocks.to(self.device), (positions % self.block_size).to(self.device)
        return self.keys[layer][at].transpose(1, 2), self.values[layer][at].transpose(1, 2)

    # ------------------------------------------------------------ forward-pass interface
    def _grow(self, row: int, end: int) -> None:
        """Own the blocks for positions < min(end, reservation)."""
        need = self.blocks_for(min(end, self.limits[row]))
        table = self.tables[row]
        while len(table) < need:
            table.append(self.pool.take())    # cannot fail: reservations bound the tables
            self.pending -= 1
            self.row_tables[row] = None

    def _block_tables(self, rows: list[int], starts: list[int], num_tokens: int) -> torch.Tensor:
        """Grow the rows for positions < start + num_tokens; their block tables [B, blocks], int32
        (SCRATCH past what a row owns). A row's table changes once per block, so its int32 tensor is
        kept until then (every step builds the tables, and building them anew in Python is a visible
        share of a small model's step)."""
        for row, s in zip(rows, starts):
            self._grow(row, s + num_tokens)
        width = self.blocks_for(max(starts) + num_tokens)
        tables = [self._row_table(row) for row in rows]
        if len(rows) == 1 and tables[0].shape[0] >= width:
            return tables[0][None, :width]
        table = torch.full((len(rows), width), SCRATCH, dtype=torch.int32)   # [B, blocks]
        for b, owned in enumerate(tables):
            owned = owned[:width]
            table[b, :owned.shape[0]] = owned
        return table

    def _make_plan(self, rows: torch.Tensor | None, start: int | torch.Tensor, batch: int, num_tokens: int):
        row_ids = list(range(batch)) if rows is None else [int(r) for r in rows.tolist()]
        if isinstance(start, int):
            starts = [start] * batch
        else:
            starts = [int(s) for s in torch.as_tensor(start).reshape(-1).tolist()]
        table, key_len = self._block_tables(row_ids, starts, num_tokens).long(), max(starts) + num_tokens
        positions = torch.tensor(starts)[:, None] + torch.arange(num_tokens)  # [B, T]
        slot_block = table.gather(1, positions // self.block_size)           # [B, T]
        slot_offset = positions % self.block_size                            # [B, T]
        dev = self.device
        return slot_block.to(dev), slot_offset.to(dev), table.to(dev), key_len

    def layout(self, rows: list[int], starts: list[int], num_tokens: int) -> CacheLayout:
        """Block tables of a pass for native kernels (grows the rows like a pass's first write)."""
        _, block, heads, head_dim = self.keys[0].shape
        return CacheLayout(self.keys, self.values, self._block_tables(rows, starts, num_tokens), block,
                           block * heads * head_dim, heads * head_dim, head_dim)

    def _row_table(self, row: int) -> torch.Tensor:
        table = self.row_tables[row]
        if table is None:
            table = self.row_tables[row] = torch.tensor(self.tables[row], dtype=torch.int32)
        return table

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
