"""Which requests hold a row, and which prompt tokens the next pass prefills.

Requests wait in a FIFO queue (`submit`, any thread) until a row is free and the cache blocks their
prompt + max_tokens can need are reserved (admission by reservation: a step never runs out of
blocks). An admitted request is prefilled in chunks, shortest remaining prompt first, then decodes.
A prefill pass stalls every decoding row, so while rows decode its size follows the measured
seconds per prefilled token to stall them about `prefill_stall_ms` (`PrefillBudget`); with nothing
decoding it is `prefill_chunk` tokens (the fewest passes to the first token).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from .config import EngineConfig
from .sequence import QueueFull, Request, Sequence, ShuttingDown

SMOOTHING = 0.3          # weight of the newest measurement of the seconds per prefilled token


@dataclass
class PrefillBudget:
    chunk: int                         # most tokens per pass
    stall_s: float                     # target stall of the decoding rows per pass; 0 = always `chunk`
    floor: int = 16                    # fewest tokens per pass while rows decode (prefill must progress)
    per_token_s: float | None = None   # measured seconds per prefilled token (running estimate)

    def tokens(self, decoding: bool) -> int:
        """Tokens for the next prefill pass; `decoding`: some row waits for its next token."""
        if not decoding or self.stall_s <= 0 or not self.per_token_s:
            return self.chunk
        return max(min(self.floor, self.chunk), min(self.chunk, int(self.stall_s / self.per_token_s)))

    def observe(self, tokens: int, seconds: float) -> None:
        """One prefill pass of `tokens` prompt tokens took `seconds` (a draft model's included)."""
        if tokens > 0 and seconds > 0:
            rate = seconds / tokens
            past = self.per_token_s if self.per_token_s is not None else rate
            self.per_token_s = (1 - SMOOTHING) * past + SMOOTHING * rate


class Scheduler:
    def __init__(self, config: EngineConfig, rows: int) -> None:
        self.config = config
        self.cond = threading.Condition()     # guards inbox, aborts and the stop flags
        self.inbox: deque[Request] = deque()
        self.aborts: set[str] = set()
        self.free_rows = list(range(rows - 1, -1, -1))
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.budget = PrefillBudget(config.prefill_chunk, config.prefill_stall_ms / 1000)
        self.closed = False                   # no new requests (stopping or draining)

    def add_rows(self, rows: int) -> None:
        """Rows from the current count up to `rows` become free (the engine grew)."""
        have = len(self.free_rows) + len(self.prefilling) + len(self.running)
        self.free_rows = list(range(rows - 1, have - 1, -1)) + self.free_rows

    # ------------------------------------------------------------------ any thread
    def submit(self, request: Request) -> None:
        with self.cond:
            if self.closed:
                raise ShuttingDown("the server is shutting down; retry on another server")
            if not request.internal and sum(not r.internal for r in self.inbox) >= self.config.max_queue:
                raise QueueFull(f"the queue is full ({self.config.max_queue} requests waiting, --max-queue); "
                                f"retry later")
            if request.internal:
                self.inbox.appendleft(request)    # a health check takes the next free row
            else:
                self.inbox.append(request)
            self.cond.notify()

    def abort(self, request_id: str) -> None:
        """The request leaves the queue now, or the batch between two steps."""
        with self.cond:
            waiting = len(self.inbox)
            self.inbox = deque(r for r in self.inbox if r.id != request_id)
            if len(self.inbox) == waiting:
                self.aborts.add(request_id)
                self.cond.notify()

    def in_flight(self) -> int:
        """Requests queued or holding a row."""
        return len(self.inbox) + len(self.prefilling) + len(self.running)

    def busy(self) -> bool:
        return bool(self.inbox or self.aborts or self.prefilling or self.running)

    def take_aborts(self) -> list[Sequence]:
        """The rows whose requests were aborted (removed from the batch)."""
        with self.cond:
            ids, self.aborts = self.aborts, set()
        if not ids:
            return []
        gone = [s for s in self.prefilling + self.running if s.request.id in ids]
        self.prefilling = [s for s in self.prefilling if s.request.id not in ids]
        self.running = [s for s in self.running if s.request.id not in ids]
        return gone

    def take_all(self) -> tuple[list[Request], list[Sequence]]:
        """Everything queued and every row (the engine stops)."""
        with self.cond:
            inbox, self.inbox = list(self.inbox), deque()
        rows, self.prefilling, self.running = self.prefilling + self.running, [], []
        return inbox, rows

    # ------------------------------------------------------------------ the engine thread
    def head(self) -> Request | None:
        """The queue's head if a row is free for it (FIFO: it waits for blocks, the rest behind it); a
        later choice of the same prompt waits until the first one's prompt is prefilled (its blocks
        are then shared)."""
        if not self.free_rows:
            return None
        with self.cond:
            request = self.inbox[0] if self.inbox else None
            if request is not None and request.after is not None and (
                    any(s.request.id == request.after for s in self.prefilling)
                    or any(r.id == request.after for r in self.inbox)):
                return None
            return request

    def take(self, request: Request) -> int | None:
        """Admit `request`, the head `head` returned: out of the queue, into a free row (returned);
        None if it is no longer the head (aborted, or a health check came first)."""
        with self.cond:
            if not self.inbox or self.inbox[0] is not request:
                return None
            self.inbox.popleft()
        return self.free_rows.pop()

    def place(self, seq: Sequence) -> None:
        (self.prefilling if seq.prefilled < seq.prefill_target else self.running).append(seq)

    def release(self, row: int) -> None:
        self.free_rows.append(row)

    def prefill_chunks(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens) to prefill in the next pass: shortest remaining prompt first, so a short
        request is not queued behind a long prompt's chunks."""
        budget, chunks = self.budget.tokens(decoding=bool(self.running)), []
        for s in sorted(self.prefilling, key=lambda s: s.prefill_target - s.prefilled):
            n = min(s.prefill_target - s.prefilled, budget)
            chunks.append((s, n))
            budget -= n
            if budget == 0:
                break
        return chunks

    def prefilled(self) -> list[Sequence]:
        """Move the rows whose prompt is now in the cache to the decoding rows; returns them."""
        done = [s for s in self.prefilling if s.prefilled >= s.prefill_target]
        self.prefilling = [s for s in self.prefilling if s.prefilled < s.prefill_target]
        self.running += done
        return done
