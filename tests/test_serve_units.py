"""Server parts without a server: the paged KV cache against the contiguous one, its block
accounting, and the speculation policy's switching (torch-free)."""
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


class _CharTokenizer:
    """Token i is the character chr(i)."""

    def decode(self, ids):
        return "".join(map(chr, ids))


@pytest.mark.parametrize("stop", [["7"], ["5, 6"], [" 7"], ["xyz", ", 6"]])
def test_streamed_text_never_shows_a_stop_string(stop):
    """Streaming sends the text the engine returns without streaming: nothing of a stop string,
    even when the token that completes it arrives in the same step as text before it."""
    from specdecode.params import SamplingParams
    from specdecode.serve.app import TextStream
    text = "1, 2, 3, 4, 5, 6, 7, 8"
    end = min(text.find(s) for s in stop if s in text)
    for step in (1, 2, 3, 5):
        stream = TextStream(_CharTokenizer(), SamplingParams(stop=stop))
        sent = ""
        for i in range(0, len(text), step):
            sent += stream.add([ord(c) for c in text[i:i + step]], False)[0]
            assert all(s not in sent for s in stop) and text.startswith(sent)
            if any(s in text[:i + step] for s in stop):
                break
        sent += stream.finish(end)
        assert sent == text[:end], (step, sent)


def test_held_tokens_post_one_merged_event_then_the_last():
    """A non-streamed choice's sink keeps its tokens on the engine thread: nothing is posted per
    step; at the end one Tokens event with every id, kind and logprob in order, then the final event."""
    from specdecode.serve.app import HeldTokens
    from specdecode.engine.sequence import Failed, Finished, Tokens
    posted = []
    sink = HeldTokens(posted.append)
    sink(Tokens([1, 2], ["accepted", "bonus"], [-0.1, -0.2]))
    sink(Tokens([3], ["recovered"], [-0.3]))
    assert posted == []
    done = Finished("stop", None, {}, {})
    sink(done)
    assert [type(e) for e in posted] == [Tokens, Finished] and posted[1] is done
    assert (posted[0].ids, posted[0].kinds, posted[0].logprobs) == ([1, 2, 3], ["accepted", "bonus", "recovered"],
                                                                    [-0.1, -0.2, -0.3])
    posted.clear()
    failing = HeldTokens(posted.append)
    failing(Tokens([7], ["bonus"], None))
    failing(Failed(500, "boom"))                 # an error after some tokens: the tokens first, then it
    assert [type(e) for e in posted] == [Tokens, Failed] and posted[0].logprobs is None


def test_paced_tokens_send_the_first_at_once_then_at_most_every_interval(monkeypatch):
    """A streamed choice's sink: the first tokens go at once (time to first token), later ones
    are merged until `interval` has passed since the last post, and what is held goes before the
    final event; ids, kinds and logprobs in order."""
    import specdecode.serve.app as app
    from specdecode.engine.sequence import Finished, Tokens
    now = [100.0]
    monkeypatch.setattr(app.time, "monotonic", lambda: now[0])
    posted = []
    sink = app.PacedTokens(posted.append, interval=0.02)
    sink(Tokens([1], ["bonus"], [-0.1]))
    assert [e.ids for e in posted] == [[1]]                       # at once
    for t, token in ((0.005, 2), (0.010, 3), (0.019, 4)):
        now[0] = 100.0 + t
        sink(Tokens([token], ["accepted"], [-0.2]))
    assert len(posted) == 1                                      # within 20 ms: held
    now[0] = 100.021
    sink(Tokens([5], ["recovered"], [-0.3]))
    assert posted[1].ids == [2, 3, 4, 5] and posted[1].kinds == ["accepted"] * 3 + ["recovered"]
    assert posted[1].logprobs == [-0.2, -0.2, -0.2, -0.3]
    now[0] = 100.025
    sink(Tokens([6], ["bonus"], None))
    done = Finished("length", None, {}, {})
    sink(done)
    assert [e.ids for e in posted[2:3]] == [[6]] and posted[3] is done and len(posted) == 4


@pytest.mark.parametrize("bad", [-1, 10_001, "20", True, float("nan")])
def test_bad_stream_interval_is_refused_by_name(bad):
    from specdecode.params import ParamError
    from specdecode.engine.config import EngineConfig
    with pytest.raises(ParamError, match=r"stream_interval_ms must be a number of milliseconds in \[0, 10000\]"):
        EngineConfig(stream_interval_ms=bad)
