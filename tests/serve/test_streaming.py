"""How the server hands tokens to a client (serve/events.py), without a server: streamed text never
shows a stop string, a non-streamed choice's tokens are posted as one merged event, a streamed
choice's tokens are paced by the stream interval, and a bad interval is refused by name."""
from __future__ import annotations

import pytest


class _CharTokenizer:
    """Token i is the character chr(i)."""

    def decode(self, ids):
        return "".join(map(chr, ids))


@pytest.mark.parametrize("stop", [["7"], ["5, 6"], [" 7"], ["xyz", ", 6"]])
def test_streamed_text_never_shows_a_stop_string(stop):
    """Streaming sends the text the engine returns without streaming: nothing of a stop string,
    even when the token that completes it arrives in the same step as text before it."""
    from specdecode.params import SamplingParams
    from specdecode.serve.events import TextStream
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
    from specdecode.engine.sequence import Failed, Finished, Tokens
    from specdecode.serve.events import HeldTokens
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
    import specdecode.serve.events as events
    from specdecode.engine.sequence import Finished, Tokens
    now = [100.0]
    monkeypatch.setattr(events.time, "monotonic", lambda: now[0])
    posted = []
    sink = events.HeldTokens(posted.append, interval=0.02)
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
    from specdecode.engine.config import EngineConfig
    from specdecode.params import ParamError
    with pytest.raises(ParamError, match=r"stream_interval_ms must be a number of milliseconds in \[0, 10000\]"):
        EngineConfig(stream_interval_ms=bad)
