"""Prefix caching across `LLM.generate` calls: the keys and values of earlier calls' sequences,
kept on the host by block, so a prompt that starts like an earlier prompt or answer (a chat's
next turn, the same system prompt) is prefilled only after that start.

Blocks are named as in the server's paged cache (`chain_hashes`: each block's hash covers its
tokens and its parent's hash, so equal hashes mean equal prefixes). After a call, every
sequence's full committed blocks are copied out of the target's cache (`save`); before the next
call's prefill, each prompt's longest run of stored blocks is copied into its fresh cache row
(`load`) and the row's length starts there. The native kernels compute every position the same
bits whether its prefill started at 0 or mid-prompt, so answers are bitwise those without the
store. Bounded by bytes, least recently used blocks dropped first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch


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


class PrefixStore:
    def __init__(self, max_bytes: int, block_size: int = 16) -> None:
        if block_size < 1 or max_bytes < 0:
            raise ValueError(f"block_size must be >= 1 and max_bytes >= 0, got {block_size}, {max_bytes}")
        self.max_bytes, self.block_size = max_bytes, block_size
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()   # hash -> [2, layers, kv_heads, block, hd]
        self.bytes = 0
        self.hits = self.queries = 0        # prompt tokens found / looked up (as the server counts them)

    def load(self, cache, row: int, tokens: list[int]) -> int:
        """Copy the stored blocks `tokens` starts with into `row` of a contiguous KVCache (at most
        len(tokens) - 1 positions: the last prompt token is the first step's); returns the
        positions now in the row (its length)."""
        count = (len(tokens) - 1) // self.block_size
        found = []
        for key in chain_hashes(tokens, self.block_size, b"", count):
            block = self.blocks.get(key)
            if block is None:
                break
            self.blocks.move_to_end(key)
            found.append(block)
        size = self.block_size
        for i, block in enumerate(found):
            for layer, (keys, values) in enumerate(zip(cache.keys, cache.values)):
                keys[row, :, i * size:(i + 1) * size] = block[0, layer]
                values[row, :, i * size:(i + 1) * size] = block[1, layer]
        self.queries += len(tokens)
        self.hits += len(found) * size
        cache.truncate(row, len(found) * size)
        return len(found) * size

    def save(self, cache, row: int, tokens: list[int]) -> None:
        """Keep the full blocks of `row` below its length (`tokens`: the row's tokens from 0)."""
        size = self.block_size
        for i, key in enumerate(chain_hashes(tokens, size, b"", cache.lengths[row] // size)):
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            block = torch.stack([torch.stack([k[row, :, i * size:(i + 1) * size] for k in cache.keys]),
                                 torch.stack([v[row, :, i * size:(i + 1) * size] for v in cache.values])])
            nbytes = block.numel() * block.element_size()
            if nbytes > self.max_bytes:
                return
            while self.bytes + nbytes > self.max_bytes:
                _, dropped = self.blocks.popitem(last=False)
                self.bytes -= dropped.numel() * dropped.element_size()
            self.blocks[key] = block
            self.bytes += nbytes

    def clear(self) -> None:
        self.blocks.clear()
        self.bytes = 0
