"""The paged KV cache (cache/paged.py) without a server: the logits of the contiguous cache through
ragged steps with rollbacks, reads of committed entries (what a drafter's read-only view gives), and
its block accounting (reserve, allocate, roll back, release)."""
from __future__ import annotations

import pytest
import torch

from specdecode.cache.contiguous import KVCache
from specdecode.cache.paged import CacheFull, PagedKVCache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_models):
    from specdecode.models.loader import load_model
    return load_model(str(tiny_models["qwen2"]), dtype="fp32", progress=False)


def paged_for(model, rows=4, max_len=96, num_blocks=64, block_size=4):
    c = model.config
    return PagedKVCache(c.num_layers, rows, c.num_kv_heads, c.head_dim, max_len, num_blocks, block_size,
                        model.dtype, model.device)


def test_paged_cache_gives_the_logits_of_the_contiguous_cache(target):
    """Ragged prefill + ragged multi-token steps with rollbacks: same logits as KVCache."""
    model = target.model
    c = model.config
    dense = KVCache(c.num_layers, 3, c.num_kv_heads, c.head_dim, 96, model.dtype)
    paged = paged_for(model, rows=5)
    rows = [3, 0, 4]                     # arbitrary paged rows for dense rows 0, 1, 2
    for r in rows:
        paged.reserve(r, 80)
    gen = torch.Generator().manual_seed(0)
    lengths = [0, 0, 0]
    for step, width in enumerate([11, 1, 4, 3, 6, 2]):
        tokens = torch.randint(0, model.vocab_size, (3, width), generator=gen)
        starts = torch.tensor(lengths)
        want = model.forward(tokens, dense, starts, rows=torch.arange(3))
        got = model.forward(tokens, paged, starts, rows=torch.tensor(rows))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        keep = [width - (b + step) % width for b in range(3)]      # ragged acceptance, some rollback
        for b in range(3):
            lengths[b] += keep[b]
            dense.truncate(b, lengths[b])
            paged.truncate(rows[b], lengths[b])
    assert [paged.lengths[r] for r in rows] == lengths


def test_reads_give_the_committed_entries_of_both_caches_and_write_nothing(target):
    """`read` at per-row positions (blocks of 4: rows spanning several) returns what the contiguous
    cache holds there, copies that leave the pools unchanged; an uncommitted position is refused."""
    model = target.model
    c = model.config
    dense = KVCache(c.num_layers, 2, c.num_kv_heads, c.head_dim, 96, model.dtype)
    paged = paged_for(model, rows=3)
    rows = [2, 0]
    for r in rows:
        paged.reserve(r, 40)
    tokens = torch.randint(0, model.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    model.forward(tokens, dense, torch.tensor([0, 0]), rows=torch.arange(2))
    model.forward(tokens, paged, torch.tensor([0, 0]), rows=torch.tensor(rows))
    for b in range(2):
        dense.truncate(b, 13 - 4 * b)
        paged.truncate(rows[b], 13 - 4 * b)
    positions = torch.tensor([[12, 0, 5, 7, 3], [8, 8, 1, 4, 0]])
    before = [t.clone() for t in paged.keys + paged.values]
    for layer in range(c.num_layers):
        want, got = dense.read(layer, [0, 1], positions), paged.read(layer, rows, positions)
        assert want[0].shape == (2, c.num_kv_heads, 5, c.head_dim)
        assert torch.equal(want[0][1, :, 2], dense.keys[layer][1, :, 1])           # row 1's position 1
        assert torch.equal(want[1][0, :, 0], dense.values[layer][0, :, 12])        # row 0's position 12
        torch.testing.assert_close(got, want)
        got[0].zero_()                                   # a copy: the pool keeps its entries
    assert all(torch.equal(a, b) for a, b in zip(before, paged.keys + paged.values))
    for cache, ids in ((dense, [0, 1]), (paged, rows)):
        with pytest.raises(ValueError, match="not committed"):
            cache.read(0, ids, torch.tensor([[0, 1], [9, 0]]))     # the second row holds 9 positions


def test_blocks_follow_the_tokens_held_and_return_on_release(target):
    paged = paged_for(target.model, rows=2, num_blocks=9, block_size=4)      # 8 usable blocks
    assert paged.can_reserve(32) and not paged.can_reserve(33)
    paged.reserve(0, 20)                              # 5 blocks reserved, none allocated yet
    assert paged.used_blocks == 0 and paged.used_bytes() == 0
    with pytest.raises(CacheFull):
        paged.reserve(1, 16)                          # 4 more blocks: over the 8
    tokens = torch.randint(0, 50, (1, 6))
    target.model.forward(tokens, paged, torch.tensor([0]), rows=torch.tensor([0]))
    assert paged.used_blocks == 2                     # positions 0..5 -> blocks 0 and 1
    paged.truncate(0, 4)                              # rolled back to a block boundary: block 1 freed
    assert paged.used_blocks == 1
    target.model.forward(torch.randint(0, 50, (1, 30)), paged, torch.tensor([4]), rows=torch.tensor([0]))
    assert paged.used_blocks == 5                     # capped at the reservation; the rest went to scratch
    paged.truncate(0, 20)
    paged.release(0)
    assert paged.used_blocks == 0 and paged.reserved_blocks == 0 and paged.lengths[0] == 0
    paged.reserve(1, 32)                              # the whole pool is free again
    with pytest.raises(ValueError, match="row 1 is in use"):
        paged.reserve(1, 4)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_a_pool_is_resident_as_its_blocks_are_written():
    """A pool sized for a long context costs the memory of the blocks written, not its capacity: it reads
    as zeros, and its pages become resident on first write (a fresh anonymous mapping)."""
    def anon_kb() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))
    before = anon_kb()
    cache = PagedKVCache(2, 1, 4, 64, 16384, 2049, 16, torch.bfloat16)       # 4 pools of 16 MiB
    assert anon_kb() - before < 8 * 1024, anon_kb() - before
    assert cache.keys[0][7].abs().sum() == 0 and cache.values[1][2048].abs().sum() == 0
    cache.keys[0][1:65] = 1.0                                                   # 64 blocks: 512 KiB
    assert anon_kb() - before < 16 * 1024 and cache.keys[0][1:65].float().mean() == 1.0


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_growing_a_pool_keeps_its_blocks_and_leaves_the_unwritten_ones_unmapped():
    def anon_kb() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))
    cache = PagedKVCache(1, 1, 4, 64, 16384, 2049, 16, torch.bfloat16)        # 2 pools of 16 MiB
    cache.keys[0][3] = 2.0
    cache.values[0][2000] = -1.0
    cache.values[0][2048] = 3.0                                                # the last block, past 32 x 64
    before = anon_kb()
    cache.grow(2, 4097)
    assert anon_kb() - before < 8 * 1024, anon_kb() - before
    assert cache.keys[0].shape[0] == 4097 and float(cache.keys[0][3].float().mean()) == 2.0
    assert float(cache.values[0][2000].float().mean()) == -1.0 and cache.keys[0][4:].abs().sum() == 0
    assert float(cache.values[0][2048].float().mean()) == 3.0 and cache.values[0][2049:].abs().sum() == 0
