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


def test_the_events_of_one_wake_up_go_out_in_one_write():
    """stream_events writes once per wake-up: the role chunk alone, then each drained batch of
    events (here the last text, the finish chunk, the usage and [DONE]) in one string, so a
    stream's end is one socket send and one wake-up of the client, not four."""
    import asyncio
    import json
    from types import SimpleNamespace

    from specdecode.engine.sequence import Finished, Tokens
    from specdecode.params import SamplingParams
    from specdecode.serve.app import stream_events
    from specdecode.serve.events import TextStream
    from specdecode.serve.generation import Generation

    class Choice:                          # the parts of a Generation that stream_events reads
        envelope, choice, text_chunk = Generation.envelope, Generation.choice, Generation.text_chunk
        release_logprobs, logprobs = Generation.release_logprobs, Generation.logprobs

        def __init__(self) -> None:
            self.parsed = SimpleNamespace(chat=True, stream=True, echo=False, echo_only=False, include_usage=True,
                                          return_token_kinds=False, return_token_ids=False, model="m",
                                          params=SamplingParams())
            self.text = TextStream(_CharTokenizer(), SamplingParams())
            self.tools = self.reasoning = self._text_template = None
            self.held_logprobs, self.logprobs_at, self.index, self.choice_of_prompt = [], 0, 0, 0
            self.id, self.created, self.done = "chatcmpl-1", 1, False
            self.request = SimpleNamespace(id="r")
            self.state = SimpleNamespace(engine=SimpleNamespace(abort=lambda request_id: None))

    async def run() -> list[str]:
        gen, queue = Choice(), asyncio.Queue()
        usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        queue.put_nowait((gen, Tokens([ord("a")], ["bonus"])))
        writes = []
        events = stream_events([gen], queue)
        writes.append(await events.__anext__())                        # the role chunk
        writes.append(await events.__anext__())                        # "a"
        for item in ((gen, Tokens([ord("b"), ord("c")], ["accepted", "bonus"])),
                     (gen, Finished("length", None, usage, {}))):
            queue.put_nowait(item)                                     # one wake-up's events
        writes += [w async for w in events]
        return writes

    writes = asyncio.run(run())
    assert len(writes) == 3 and all(w.endswith("\n\n") for w in writes)
    last = [e[len("data: "):] for e in writes[2].split("\n\n") if e]
    assert last[-1] == "[DONE]" and len(last) == 4
    chunks = [json.loads(e) for e in last[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"content": "bc"}
    assert chunks[1]["choices"][0]["finish_reason"] == "length" and chunks[2]["usage"]["completion_tokens"] == 3
