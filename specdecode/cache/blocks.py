"""The blocks of a paged KV cache: who holds them, and which hold a reusable prefix.

A block is *held* while one or more cache rows have it in their block table (its reference
count); a held block is never handed out again. A full block whose positions are all committed
can be *registered* under the hash of its tokens and of every token before them (`chain_hashes`:
each block's hash covers its parent's, so equal hashes mean equal prefixes, as in vLLM's
automatic prefix caching). When its last holder lets go, a registered block is not freed but
kept, unheld, in least-recently-used order: a later request whose prompt starts with the same
tokens takes it back (`match`) instead of computing it again. Blocks are handed out from the free
list first, then by evicting the least recently used unheld registered block (its hash is
forgotten, so a stale block can never be matched).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable


def chain_hashes(tokens: list[int], block_size: int, salt: bytes, count: int, parents: list[bytes] = ()
                 ) -> list[bytes]:
    """Hashes of the first `count` full blocks of `tokens`, each covering its parent's hash (the
    first covers `salt`: what else changes the keys and values, e.g. the model and its dtype).
    `parents`: hashes already known for the first blocks (extended, not recomputed)."""
    out = list(parents[:count])
    previous = out[-1] if out else salt
    for i in range(len(out), count):
        block = tokens[i * block_size:(i + 1) * block_size]
        if len(block) < block_size:
            break
        previous = hashlib.blake2b(previous + array("q", block).tobytes(), digest_size=16).digest()
        out.append(previous)
    return out


class BlockPool:
    def __init__(self, num_blocks: int, first: int = 1) -> None:
        """Blocks first..num_blocks-1 (those below `first` are never handed out: the scratch block)."""
        self.refs = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}          # hash -> registered block
        self.idle: OrderedDict[int, None] = OrderedDict()   # unheld registered blocks, oldest first
        self.free: list[int] = list(range(num_blocks - 1, first - 1, -1))   # a stack
        self.held = 0                               # blocks with refs > 0
        self.max_idle: int | None = None            # bound on idle registered blocks (None: the pool)
        self.evicted = 0
        self.on_register: Callable[[int, bytes], None] | None = None   # told of each block registered
                                                                        # (the disk tier stages it)

    def grow(self, num_blocks: int) -> None:
        """Blocks up to num_blocks - 1 join the free list."""
        old = len(self.refs)
        self.refs += [0] * (num_blocks - old)
        self.hash_of += [None] * (num_blocks - old)
        self.free = list(range(num_blocks - 1, old - 1, -1)) + self.free

    @property
    def available(self) -> int:
        """Blocks that can be handed out: free, or idle registered ones (evicted on demand)."""
        return len(self.free) + len(self.idle)

    def take(self) -> int:
        """A block for a row to write (held once)."""
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.idle.popitem(last=False)     # the least recently used cached prefix
            self._forget(block)
        self.refs[block] = 1
        self.held += 1
        return block

    def hold(self, block: int) -> None:
        """One more row holds `block` (a matched prefix block)."""
        if self.refs[block] == 0:
            self.idle.pop(block, None)
            self.held += 1
        self.refs[block] += 1

    def drop(self, block: int) -> None:
        """A row lets go of `block`: unheld, it is kept if registered, else freed."""
        self.refs[block] -= 1
        if self.refs[block]:
            return
        self.held -= 1
        if self.hash_of[block] is not None:
            self.idle[block] = None                     # the most recently used
            self._trim()
        else:
            self.free.append(block)

    def register(self, block: int, key: bytes) -> None:
        """`block` (held, full, committed) holds the prefix `key`; the first block registered under
        a key keeps it."""
        if self.hash_of[block] is None and key not in self.cached:
            self.cached[key] = block
            self.hash_of[block] = key
            if self.on_register is not None:
                self.on_register(block, key)

    def match(self, keys: list[bytes]) -> list[int]:
        """The registered blocks of the longest run of `keys` from the first."""
        blocks = []
        for key in keys:
            block = self.cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def revived(self, blocks: list[int]) -> int:
        """How many of `blocks` are unheld (holding them takes them out of `available`)."""
        return sum(1 for b in blocks if self.refs[b] == 0)

    def _forget(self, block: int) -> None:
        key = self.hash_of[block]
        if key is not None:
            del self.cached[key]
            self.hash_of[block] = None
            self.evicted += 1

    def _trim(self) -> None:
        while self.max_idle is not None and len(self.idle) > self.max_idle:
            block, _ = self.idle.popitem(last=False)
            self._forget(block)
            self.free.append(block)
