"""From the engine thread to a request's handler: events posted to the event loop (`Mailbox`), a
choice's tokens merged on the engine thread (`HeldTokens`) or in the handler's queue
(`merge_tokens`), and their text detokenized once (`TextStream`)."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from ..engine.sequence import Tokens
from ..params import SamplingParams


class Mailbox:
    """Events from the engine thread to one event loop: however many events a step produces, the
    loop is woken once (one `call_soon_threadsafe`) and hands each to its queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.items, self.lock, self.scheduled = loop, [], threading.Lock(), False

    @staticmethod
    def of(app_state) -> Mailbox:
        """The running loop's mailbox (made on first use)."""
        loop = asyncio.get_running_loop()
        boxes = app_state.__dict__.setdefault("_mailboxes", {})
        if loop not in boxes:
            boxes[loop] = Mailbox(loop)
        return boxes[loop]

    def post(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.items.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:           # the event loop is gone (shutdown)
            pass

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


class HeldTokens:
    """A choice's sink on the engine thread: its Tokens events merged into one and posted with its
    last event, so the event loop is woken once per answer instead of once per step (on a machine
    of few cores each wake-up takes a core from the engine's pass). With an `interval` (a streamed
    choice), the first tokens are posted at once (the time to first token) and later ones at most
    every `interval` seconds (at the step that reaches it): one chunk per step would cost the server
    a wake-up, a detokenization and an SSE event, and the client a parse, per step."""

    def __init__(self, post: Callable[[object], None], interval: float | None = None) -> None:
        self.post, self.interval, self.held, self.last = post, interval, None, None

    def __call__(self, event) -> None:
        if not isinstance(event, Tokens):
            if self.held is not None:
                self.post(self.held)
            self.held = None
            self.post(event)
            return
        if self.held is None:
            self.held = event.copy()
        else:
            self.held.extend(event)
        if self.interval is not None:
            now = time.monotonic()
            if self.last is None or now - self.last >= self.interval:
                self.post(self.held)
                self.held, self.last = None, now


class TextStream:
    """Incremental detokenization: text deltas that never split a UTF-8 character and never
    show text that may still turn out to be part of a stop string. Each token is decoded once,
    with the few tokens before it (as vLLM does), so a long answer costs no more per token than a
    short one."""

    def __init__(self, tokenizer, params: SamplingParams, decode=None) -> None:
        """decode: ids -> text (default the tokenizer's, skipping special tokens)."""
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0
        self.decode = decode or tokenizer.decode
        self.text = ""                     # the text of ids[:read_at] (whole characters)
        self.prefix_at = self.read_at = 0  # ids[prefix_at:read_at]: the context the next tokens decode with
        self.stops = tuple(s for s in params.stop if s)
        self.hold = max((len(s) - 1 for s in self.stops), default=0)

    def _decode_new(self) -> str:
        """The text ids[read_at:] add, or '' while they end inside a character. Decoded after
        the tokens before them: a tokenizer that drops a word's leading space at the start of a
        decode drops it from both strings alike."""
        decode = self.decode
        prefix = decode(self.ids[self.prefix_at:self.read_at]) if self.read_at > self.prefix_at else ""
        full = decode(self.ids[self.prefix_at:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_at, self.read_at = self.read_at, len(self.ids)
        self.text += full[len(prefix):]
        return full[len(prefix):]

    def add(self, ids: list[int], with_token_texts: bool) -> tuple[str, list[str]]:
        """(the text that may be sent now, each token's own text when asked)."""
        texts = []
        if with_token_texts:
            for token in ids:
                self.ids.append(token)
                texts.append(self._decode_new())
        else:
            self.ids += ids
            self._decode_new()
        text = self.text
        # a stop string's prefix at the end is held back, so none can start before self.sent;
        # a whole one (completed by these tokens) cuts the text where it starts
        cut = len(text) - self.hold
        for stop in self.stops:
            found = text.find(stop, self.sent)
            if found >= 0:
                cut = min(cut, found)
        text = text[:max(self.sent, cut)]
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta, texts

    def finish(self, stop_text_index: int | None) -> str:
        text = self.full_text(stop_text_index)
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta

    def full_text(self, stop_text_index: int | None) -> str:
        text = self.decode(self.ids)
        return text[:stop_text_index] if stop_text_index is not None else text


def drain(first, queue: asyncio.Queue) -> list:
    """`first` and whatever else is already in the queue: the events of one or more engine steps."""
    items = [first]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def merge_tokens(items: list) -> list:
    """Consecutive Tokens events of a choice merged into one (a client that fell behind gets one
    chunk per choice for several steps); other events kept in order."""
    out, last = [], {}
    for gen, event in items:
        if isinstance(event, Tokens) and gen in last:
            last[gen].extend(event)
            continue
        if isinstance(event, Tokens):
            event = event.copy()
            last[gen] = event
        else:
            last.pop(gen, None)
        out.append((gen, event))
    return out
