"""The prefix cache's disk tier (cache/disk.py) while serving: blocks are written behind, by a
writer thread, from copies the engine thread takes when the pool registers them.

The guarantees tested: the engine thread never writes a file (the writer is the only caller of
the write function) and a request's blocks reach the disk without a graceful stop; a full
staging queue skips a new block instead of waiting for the writer; a file holds the block as
it was when staged, even if the pool reuses the block before the writer gets to it, and a write
cut short leaves nothing behind at the next start; a server killed with SIGKILL right after a
request answers it again from disk, with the same text.
Format, damaged files, the size bound and the graceful stop: tests/cache/test_prefix.py.
"""
from __future__ import annotations

import threading
import time

import httpx
import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.serve_server import LocalServer
from specdecode.cache import disk as disk_module
from specdecode.cache.disk import DiskPrefixCache
from specdecode.cache.paged import PagedKVCache
from specdecode.engine.config import EngineConfig
from specdecode.engine.sequence import Finished, Request
from specdecode.serve.server import build_state

TEXT = ("the quick brown fox jumps over the lazy dog. speculative decoding drafts tokens and verifies them "
        "in one pass of the target model. ")


def poll(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout:g} s"
        time.sleep(0.05)


def small_cache(num_blocks: int = 12) -> PagedKVCache:
    cache = PagedKVCache(num_layers=2, num_rows=1, num_kv_heads=2, head_dim=4, max_len=32, num_blocks=num_blocks,
                         block_size=4, dtype=torch.float32)
    cache.enable_prefix_caching(b"test-salt")
    for pool in cache.keys + cache.values:
        pool.copy_(torch.randn(pool.shape))
    return cache


def test_a_full_staging_queue_skips_new_blocks_and_files_hold_the_block_as_staged(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_module, "LINGER", 0.2)
    cache = small_cache()
    disk = DiskPrefixCache(tmp_path, cache, max_bytes=2**30, staging_bytes=2 * cache.block_bytes)
    assert disk.capacity == 2
    release, writers = threading.Event(), []
    inner = DiskPrefixCache._write

    def held_write(self, key, copy):
        writers.append(threading.current_thread())
        assert release.wait(30)
        return inner(self, key, copy)
    monkeypatch.setattr(DiskPrefixCache, "_write", held_write)
    blocks = [cache.pool.take() for _ in range(6)]
    keys = [bytes([i]) * 16 for i in range(6)]
    staged = {key: torch.stack([t[b] for t in cache.keys + cache.values]).clone() for b, key in zip(blocks, keys)}
    cache.pool.register(blocks[0], keys[0])                      # staged, then taken by the writer
    poll(lambda: disk.writing == keys[0], 10, "the writer takes the first block")

    def register_rest():
        for b, key in zip(blocks[1:], keys[1:]):
            cache.pool.register(b, key)
    engine = threading.Thread(target=register_rest)
    engine.start()
    engine.join(10)
    assert not engine.is_alive()                                 # never waits for the held writer
    assert disk.skipped == 3 and list(disk.pending) == keys[1:3]
    for b in blocks:                                             # the pool reuses the blocks
        for t in cache.keys + cache.values:
            t[b] = 0.0
    release.set()
    assert disk.wait(time.monotonic() + 30)
    assert {t.name for t in writers} == {"specdecode-prefix-writer"} and disk.written == 3
    assert sorted(p.stem for p in disk.dir.glob("*.kv")) == sorted(k.hex() for k in keys[:3])
    cut = disk.dir / "cut-short.tmp"                             # a write a kill interrupted
    cut.write_bytes(b"{}")
    fresh = small_cache()
    again = DiskPrefixCache(tmp_path, fresh, max_bytes=2**30)
    assert again.load() == 3 and not cut.exists()
    for key in keys[:3]:
        b = fresh.pool.cached[key]
        assert torch.equal(torch.stack([t[b] for t in fresh.keys + fresh.values]), staged[key])
    disk.note(blocks[3:4])                                       # a later request's hit on a skipped block
    assert disk.wait(time.monotonic() + 30) and (disk.dir / f"{keys[3].hex()}.kv").exists()
    poll(lambda: disk.writer is None, 2 * disk_module.LINGER, "the idle writer ends")


def test_the_engine_thread_never_writes_and_blocks_reach_disk_while_serving(tiny_models, tmp_path, monkeypatch):
    threads = []
    inner = DiskPrefixCache._write

    def recorded(self, key, copy):
        threads.append(threading.current_thread())
        return inner(self, key, copy)
    monkeypatch.setattr(DiskPrefixCache, "_write", recorded)
    llm = LLM(model=str(tiny_models["llama"]), method="none", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, block_size=4, max_model_len=240,
                                          prefix_cache_dir=str(tmp_path)), check_budget=False)
    prompt = llm.tokenizer.encode(TEXT)
    done = []
    state.engine.submit(Request(prompt, SamplingParams(max_tokens=8, ignore_eos=True),
                                lambda e: done.append(e) if isinstance(e, Finished) else None))
    state.engine.run_until_idle()                                # on this thread, no graceful stop
    assert done
    disk = state.engine.disks[0]
    assert disk.wait(time.monotonic() + 30)
    files = {p.stem for p in disk.dir.glob("*.kv")}
    assert len(files) == disk.written >= (len(prompt) - 1) // 4
    assert threads and threading.current_thread() not in threads
    assert {t.name for t in threads} == {"specdecode-prefix-writer"}
    # a hit on a block already on disk stages nothing
    before = disk.written
    state.engine.submit(Request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), lambda e: None))
    state.engine.run_until_idle()
    assert disk.wait(time.monotonic() + 30) and disk.written == before


def test_a_server_killed_after_a_request_answers_it_again_from_disk(tiny_models, tmp_path):
    cache_dir = tmp_path / "kv"
    args = ["--model", str(tiny_models["llama"]), "--method", "none", "--dtype", "fp32", "--threads", "1",
            "--prefix-cache-dir", str(cache_dir), "--log-level", "warning"]
    body = {"prompt": TEXT * 3, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with LocalServer(args, tmp_path / "first.log", startup_timeout_s=120) as server:
        first = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        prompt_tokens = first["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and prompt_tokens > 160
        full = (prompt_tokens - 1) // 16                         # blocks a later request can take
        poll(lambda: len(list(cache_dir.rglob("*.kv"))) >= full, 30, "the prompt's blocks reach the disk")
        server.process.kill()                                    # SIGKILL: no graceful stop
        server.process.wait(30)
    with LocalServer(args, tmp_path / "second.log", startup_timeout_s=120) as server:
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * prompt_tokens
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
