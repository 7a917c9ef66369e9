"""Prefix caching in the server's paged KV cache (serve/block_pool.py, paged_cache.py).

The guarantees tested: a prompt that starts like an earlier request (a chat's next turn, the
same system prompt, another choice of the same prompt) takes the earlier request's blocks and is
prefilled only after them; its answer is bitwise the one without the cache (greedy and seeded
sampling, with and without speculation: chains, trees, a draft model); a block taken by a later
request is never written (its keys and values are compared before and after); a block evicted
for room is never matched again; admission counts matched blocks as held.
"""
from __future__ import annotations

import time

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.cache.blocks import BlockPool, chain_hashes
from specdecode.cache.paged import CacheFull, PagedKVCache
from specdecode.engine.config import EngineConfig
from specdecode.engine.sequence import Failed, Finished, Request, Tokens
from specdecode.serve.server import build_state

BLOCK = 4
TEXT = ("the quick brown fox jumps over the lazy dog. speculative decoding drafts tokens and verifies them "
        "in one pass of the target model.")


# ----------------------------------------------------------------------------- the block pool
def test_hashes_chain_their_parents_and_the_salt():
    tokens = list(range(20))
    a = chain_hashes(tokens, 4, b"model-a", 5)
    assert len(a) == 5 and len(set(a)) == 5
    assert chain_hashes(tokens, 4, b"model-a", 3) == a[:3]
    assert chain_hashes(tokens, 4, b"model-a", 5, a[:2]) == a          # extends what is known
    assert chain_hashes(tokens, 4, b"model-b", 5)[0] != a[0]            # another model: other keys
    other = [99] + tokens[1:]                                           # the first block differs ...
    assert all(x != y for x, y in zip(chain_hashes(other, 4, b"model-a", 5), a))   # ... so every later one
    assert chain_hashes(tokens[:7], 4, b"model-a", 5) == a[:1]          # only full blocks


def test_pool_keeps_unheld_registered_blocks_and_evicts_the_oldest():
    pool = BlockPool(5)                                     # blocks 1..4
    blocks = [pool.take() for _ in range(4)]
    assert pool.available == 0 and pool.held == 4
    for block, key in zip(blocks[:3], (b"a", b"b", b"c")):
        pool.register(block, key)
    for block in blocks:
        pool.drop(block)
    assert pool.held == 0 and len(pool.idle) == 3 and pool.free == [blocks[3]]
    assert pool.match([b"a", b"b", b"x", b"c"]) == blocks[:2]
    pool.hold(blocks[0])                                    # a hit: out of the idle set
    assert pool.held == 1 and pool.available == 3
    assert pool.take() == blocks[3]                         # the free list first
    assert pool.take() == blocks[1]                         # then the least recently used idle block
    assert pool.match([b"a", b"b"]) == [blocks[0]]          # whose key is gone: never matched again
    assert pool.evicted == 1
    pool.max_idle = 0
    pool.drop(blocks[0])                                    # over the bound: freed, key forgotten
    assert pool.match([b"a"]) == [] and blocks[0] in pool.free


def paged(rows=3, num_blocks=12, block=BLOCK):
    return PagedKVCache(1, rows, 1, 4, 256, num_blocks, block, torch.float32)


def test_admission_counts_matched_blocks_as_held():
    cache = paged(num_blocks=9)                             # 8 usable blocks
    cache.enable_prefix_caching(b"salt")
    tokens = list(range(40))
    cache.reserve(0, 17)                                    # 5 blocks
    cache._grow(0, 17)
    cache.truncate(0, 16)
    cache.commit(0, tokens)                                 # blocks 0..3 registered
    cache.release(0)
    assert cache.used_blocks == 0 and cache.cached_blocks == 4
    hits = cache.pool.match(chain_hashes(tokens, BLOCK, cache.salt, 16 // BLOCK))   # as ModelRunner.match
    assert len(hits) == 4
    assert cache.can_reserve(32, hits) and not cache.can_reserve(33, hits)   # 4 held + 4 new = 8
    assert cache.can_reserve(32) and not cache.can_reserve(33)               # evicting them makes room too
    cache.reserve(1, 24, hits)
    assert cache.lengths[1] == 16 and cache.tables[1] == hits and cache.used_blocks == 4
    with pytest.raises(CacheFull):
        cache.reserve(2, 12)                                # 2 new for row 1 + 3 > the 4 left
    with pytest.raises(ValueError, match="cover all"):
        cache.reserve(2, 16, hits)


# ----------------------------------------------------------------------------- the server's engine
def serve_state(model, draft=None, method=None, k=5, prefix_cache=True, num_blocks=0, **llm_options):
    llm = LLM(model=str(model), draft=None if draft is None else str(draft), method=method,
              num_speculative_tokens=k, dtype="fp32", progress=False, **llm_options)
    return llm, build_state(llm, EngineConfig(max_batch_size=4, block_size=BLOCK, max_model_len=240,
                                             num_blocks=num_blocks, prefix_cache=prefix_cache), check_budget=False)


def run(state, requests):
    """Submit (prompt ids, params, speculate[, after]) requests at once and step the engine in
    this thread until all end; returns per request (token ids, usage)."""
    sched = state.engine
    out = [None] * len(requests)
    ids = [[] for _ in requests]
    reqs = []
    for i, (prompt, params, speculate, *after) in enumerate(requests):
        def sink(event, i=i):
            if isinstance(event, Tokens):
                ids[i] += event.ids
            elif isinstance(event, Finished):
                out[i] = (ids[i], event.usage)
            elif isinstance(event, Failed):
                raise AssertionError(event.message)
        reqs.append(Request(prompt, params, sink, speculate, after=reqs[after[0]].id if after else None))
        sched.submit(reqs[-1])
    while any(o is None for o in out):
        sched.iterate()
    return out


def cached(usage):
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_a_repeated_prompt_is_prefilled_only_after_its_cached_blocks(tiny_models):
    llm, state = serve_state(tiny_models["llama"], method="none")
    tok = llm.tokenizer
    prompt = tok.encode(TEXT)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    prefilled = []
    inner = state.engine.runner.prefill
    state.engine.runner.prefill = lambda chunks, draft=False: (
        prefilled.append(sum(n for _, n in chunks)) if not draft else None, inner(chunks, draft))
    (first, u1), = run(state, [(prompt, greedy, False)])
    (second, u2), = run(state, [(prompt, greedy, False)])
    assert cached(u1) == 0 and cached(u2) == (len(prompt) - 1) // BLOCK * BLOCK
    assert sum(prefilled) == 2 * (len(prompt) - 1) - cached(u2)
    assert second == first
    # the next turn: the first answer and a question appended, all of the last turn cached
    turn2 = prompt + first + tok.encode(" and the dog?")
    (third, u3), = run(state, [(turn2, greedy, False)])
    assert cached(u3) == (len(prompt) + len(first) - 1) // BLOCK * BLOCK   # the answer's blocks too
    _, fresh = serve_state(tiny_models["llama"], method="none", prefix_cache=False)
    assert run(fresh, [(turn2, greedy, False)])[0][0] == third
    stats = state.engine.metrics.stats()["prefix_cache"]
    assert stats["enabled"] and stats["hit_tokens"] == cached(u2) + cached(u3)
    assert stats["queried_tokens"] == 2 * len(prompt) + len(turn2)
    text = state.engine.metrics.render().decode()
    assert f"specdecode:prefix_cache_hits_total {float(cached(u2) + cached(u3))}" in text


def snapshot(cache):
    """Keys and values of every registered block (the ones a later request may share)."""
    return {block: [t[block].clone() for t in cache.keys + cache.values]
            for block in range(cache.num_blocks) if cache.pool.hash_of[block] is not None}


def guard_writes(cache):
    """Fail at once when a pass would write a slot of a registered block (even with the same
    values: the snapshot could not tell). Every pass (fused or eager) maps its slots through
    `_block_tables`."""
    inner = cache._block_tables

    def checked(row_ids, starts, num_tokens):
        table = inner(row_ids, starts, num_tokens)
        for b, start in enumerate(starts):
            for position in range(start, start + num_tokens):
                block = int(table[b, position // cache.block_size])
                assert cache.pool.hash_of[block] is None, f"a pass writes position {position} in cached block {block}"
        return table
    cache._block_tables = checked


@pytest.mark.parametrize("method,k", [("ngram", 5), ("suffix", 12), ("model", 4)])
def test_shared_blocks_are_never_written_and_answers_are_those_without_the_cache(tiny_models, method, k):
    draft = tiny_models["llama_draft"] if method == "model" else None
    llm, state = serve_state(tiny_models["llama"], draft=draft, method=method, k=k, adaptive=False)
    _, plain = serve_state(tiny_models["llama"], draft=draft, method=method, k=k, adaptive=False,
                           prefix_cache=False)
    tok = llm.tokenizer
    prompt = tok.encode(TEXT + " " + TEXT)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=7)
    first = run(state, [(prompt, greedy, True)])[0][0]
    caches = state.engine.runner.caches
    if method == "model":
        assert len(caches) == 2 and all(c.prefix_caching for c in caches)
    before = [snapshot(c) for c in caches]
    assert before[0]
    for c in caches:
        guard_writes(c)
    # again, sampling too, speculating, two choices of one prompt at once (the second waits for the
    # first's blocks), and a prompt that diverges inside a block
    other = prompt[:len(prompt) // 2] + tok.encode(" lazy fox")
    jobs = [(prompt, greedy, True), (prompt, seeded, True), (prompt, greedy, False, 1), (other, greedy, True)]
    got = run(state, jobs)
    want = run(plain, jobs)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert got[0][0] == first
    assert all(cached(u) > 0 for _, u in got)
    common = next(i for i, (a, b) in enumerate(zip(other, prompt)) if a != b)
    assert cached(got[3][1]) == min(common, len(other) - 1) // BLOCK * BLOCK      # up to the block it diverges in
    for cache, blocks in zip(caches, before):
        for block, tensors in blocks.items():
            now = [t[block] for t in cache.keys + cache.values]
            assert all(torch.equal(a, b) for a, b in zip(tensors, now)), f"shared block {block} was written"


def test_eviction_under_memory_pressure_keeps_answers_exact(tiny_models):
    """A pool with room for about two prompts: cached blocks make way for new requests (least
    recently used first), and a request never matches a block reused for other tokens."""
    llm, state = serve_state(tiny_models["llama"], method="none", num_blocks=40)
    _, plain = serve_state(tiny_models["llama"], method="none", prefix_cache=False)
    tok = llm.tokenizer
    prompts = [tok.encode(f"{i} {TEXT}") for i in range(5)]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [run(plain, [(p, greedy, False)])[0][0] for p in prompts]
    cache = state.engine.runner.cache
    for p, w in zip(prompts, want):
        assert run(state, [(p, greedy, False)])[0][0] == w
    assert cache.pool.evicted > 0
    got, usage = run(state, [(prompts[0], greedy, False)])[0]      # evicted long ago: computed again
    assert got == want[0] and cached(usage) == 0
    got, usage = run(state, [(prompts[-1], greedy, False)])[0]     # the newest: still cached
    assert got == want[-1] and cached(usage) > 0
    assert cache.used_blocks == 0 and cache.reserved_blocks == 0


def test_prefix_cache_off_and_bounded(tiny_models):
    llm, state = serve_state(tiny_models["llama"], method="none", prefix_cache=False)
    prompt = llm.tokenizer.encode(TEXT)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    run(state, [(prompt, greedy, False)])
    assert cached(run(state, [(prompt, greedy, False)])[0][1]) == 0
    assert state.engine.metrics.stats()["prefix_cache"]["enabled"] is False
    llm = LLM(model=str(tiny_models["llama"]), method="none", dtype="fp32", progress=False)
    bounded = build_state(llm, EngineConfig(max_batch_size=2, block_size=BLOCK, max_model_len=240,
                                           prefix_cache_blocks=3), check_budget=False)
    run(bounded, [(prompt, greedy, False)])
    assert bounded.engine.runner.cache.cached_blocks == 3
    assert cached(run(bounded, [(prompt, greedy, False)])[0][1]) == 3 * BLOCK


# ----------------------------------------------------------------------------- on disk
def disk_state(model, directory, **config):
    llm = LLM(model=str(model), method="none", dtype="fp32", progress=False)
    return llm, build_state(llm, EngineConfig(max_batch_size=2, block_size=BLOCK, max_model_len=240,
                                             prefix_cache_dir=str(directory), **config), check_budget=False)


def stop_gracefully(state):
    state.engine.drain(0.0)
    state.engine.run()            # returns at once (nothing in flight), writing what the cache holds


def test_a_restarted_server_takes_prefixes_from_disk(tiny_models, tmp_path):
    llm, first = disk_state(tiny_models["llama"], tmp_path)
    prompt = llm.tokenizer.encode(TEXT)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    want, usage = run(first, [(prompt, greedy, False)])[0]
    assert cached(usage) == 0
    stop_gracefully(first)
    disk = first.engine.disks[0]
    assert disk.written > 0 and len(list(disk.dir.glob("*.kv"))) == disk.written
    _, second = disk_state(tiny_models["llama"], tmp_path)
    assert second.engine.disks[0].loaded == disk.written
    got, usage = run(second, [(prompt, greedy, False)])[0]
    assert got == want and cached(usage) == (len(prompt) - 1) // BLOCK * BLOCK
    # another model never reads these files (its own directory), even renamed into its own
    _, other = disk_state(tiny_models["qwen2"], tmp_path)
    assert other.engine.disks[0].loaded == 0
    theirs = other.engine.disks[0].dir
    moved = theirs / next(disk.dir.glob("*.kv")).name
    moved.write_bytes(next(disk.dir.glob("*.kv")).read_bytes())
    _, other = disk_state(tiny_models["qwen2"], tmp_path)
    assert other.engine.disks[0].loaded == 0 and moved.exists()          # foreign: skipped, left alone


def test_damaged_files_are_skipped_and_the_directory_is_bounded(tiny_models, tmp_path):
    llm, first = disk_state(tiny_models["llama"], tmp_path)
    prompt = llm.tokenizer.encode(TEXT)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    want = run(first, [(prompt, greedy, False)])[0][0]
    stop_gracefully(first)
    files = sorted(first.engine.disks[0].dir.glob("*.kv"))
    files[0].write_bytes(files[0].read_bytes()[:-100])                  # truncated
    data = bytearray(files[1].read_bytes())
    data[-1] ^= 0xFF                                                    # one bit of a value
    files[1].write_bytes(bytes(data))
    _, second = disk_state(tiny_models["llama"], tmp_path)
    assert second.engine.disks[0].loaded == len(files) - 2
    assert not files[0].exists() and not files[1].exists()              # ours but damaged: removed
    assert run(second, [(prompt, greedy, False)])[0][0] == want         # computed where a block is missing
    size = files[2].stat().st_size
    _, small = disk_state(tiny_models["llama"], tmp_path, prefix_cache_dir_bytes=3 * size)
    run(small, [(llm.tokenizer.encode("other words " + TEXT), greedy, False)])
    stop_gracefully(small)
    assert len(list(small.engine.disks[0].dir.glob("*.kv"))) == 3


def test_disk_blocks_of_layers_with_different_head_shapes_round_trip(tmp_path):
    """Gemma 4's cache layers differ in kv heads and head dim: a block written to disk comes back
    into another cache of that geometry bitwise, and a cache of another geometry skips the file."""
    from specdecode.cache.disk import DiskPrefixCache

    def cache(dims):
        c = PagedKVCache(3, 1, (2, 2, 1), dims, 16, 4, BLOCK, torch.float32)
        c.enable_prefix_caching(b"salt")
        return c
    first = cache((16, 16, 32))
    block, key = first.pool.take(), chain_hashes(list(range(BLOCK)), BLOCK, b"salt", 1)[0]
    for t in first.keys + first.values:
        t[block] = torch.randn(t[block].shape)
    first.pool.register(block, key)
    disk = DiskPrefixCache(tmp_path, first, 1 << 20)
    assert disk.geometry["head_dim"] == [16, 16, 32] and disk.geometry["kv_heads"] == [2, 2, 1]
    disk.note([block])
    assert disk.wait(time.monotonic() + 30) and disk.written == 1
    second = cache((16, 16, 32))
    assert DiskPrefixCache(tmp_path, second, 1 << 20).load() == 1
    got = second.pool.cached[key]
    for a, b in zip(first.keys + first.values, second.keys + second.values):
        assert torch.equal(a[block], b[got])
    assert DiskPrefixCache(tmp_path, cache((16, 32, 32)), 1 << 20).load() == 0


# ----------------------------------------------------------------------------- LLM.generate
@pytest.mark.parametrize("method", ["none", "ngram", "model"])
def test_generate_calls_reuse_earlier_calls_blocks_bitwise(tiny_models, method):
    draft = str(tiny_models["llama_draft"]) if method == "model" else None
    options = dict(model=str(tiny_models["llama"]), draft=draft, method=method, dtype="fp32", progress=False,
                   adaptive=False)
    llm, plain = LLM(**options), LLM(**options, prefix_cache=False)
    assert llm.core.runner.cache.prefix_caching and not plain.core.runner.cache.prefix_caching
    tok = llm.tokenizer
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=3)
    first = tok.encode(TEXT)
    out = llm.generate([first], greedy)[0]
    assert out.stats["cached_tokens"] == 0
    # the next turn (the answer and more words) next to an unrelated prompt, in one call
    turn = first + out.token_ids + tok.encode(" and then the fox")
    other = tok.encode("def add(a, b): return a + b")
    got = llm.generate([turn, other, turn], [greedy, greedy, seeded])
    want = plain.generate([turn, other, turn], [greedy, greedy, seeded])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    cached_turn = (len(first) + len(out.token_ids) - 1) // 16 * 16      # the store's blocks are 16 tokens
    assert [g.stats["cached_tokens"] for g in got] == [cached_turn, 0, cached_turn]


def test_the_store_is_bounded_and_can_be_off(tiny_models):
    def cached_bytes(llm):
        cache = llm.core.runner.cache
        return cache.cached_blocks * cache.block_bytes
    probe = LLM(model=str(tiny_models["llama"]), method="none", dtype="fp32", progress=False)
    tok = probe.tokenizer
    prompts = [tok.encode(f"{i} {TEXT} {TEXT}") for i in range(6)]
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    probe.generate([prompts[0]], greedy)
    per_prompt = cached_bytes(probe)                       # one prompt's blocks
    assert per_prompt > 0
    llm = LLM(model=str(tiny_models["llama"]), method="none", dtype="fp32", progress=False,
              prefix_cache=per_prompt * 3 // 2)
    for p in prompts:
        llm.generate([p], greedy)
        assert cached_bytes(llm) <= per_prompt * 3 // 2
    assert llm.generate([prompts[-1]], greedy)[0].stats["cached_tokens"] > 0      # the newest kept
    assert llm.generate([prompts[0]], greedy)[0].stats["cached_tokens"] == 0      # the oldest dropped
    with pytest.raises(Exception, match="prefix_cache must be"):
        LLM(model=str(tiny_models["llama"]), method="none", dtype="fp32", progress=False, prefix_cache=-1)
    eager = LLM(model=str(tiny_models["llama"]), method="none", dtype="fp32", progress=False, fast=False)
    assert not eager.core.runner.cache.prefix_caching      # eager passes are not batch invariant
