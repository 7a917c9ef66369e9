"""How many threads a step's passes use, chosen from measured step times.

The fused decoder splits each pass between OpenMP threads that meet at a barrier after every
phase (a few hundred per step). On an idle machine every thread has a core and more threads are
faster. When another process is busy on one of the cores, the thread that shares it is
descheduled for whole time slices and every barrier waits for it: on a 2-core AMD EPYC with a
busy loop on one core the embedded model decoded 92-180 tok/s on 2 threads and 132-243 on 1.

The tuner runs the steps on the current count and now and then tries the other one for `trial`
steps: the trial's median time per pass row (its first step, which wakes the other threads, left
out) is compared with that of the steps just before it (adjacent steps: the same batch, much the
same draft sizes), and the faster count is kept, the current one winning ties within `margin`.
Trials cost time when they lose (on an idle machine a 1-thread step is ~1.6x a 2-thread one), so
the wait between them doubles after each lost trial (from `period`, 64, up to `max_period`, 512 steps:
under 2% of an idle machine's time) and goes back to `period` after a switch. A machine that
becomes busy, or idle again, is followed within `max_period` steps (a few seconds).
"""
from __future__ import annotations

from collections import deque
from statistics import median

import torch


class ThreadTuner:
    def __init__(self, max_threads: int | None = None, period: int = 64, max_period: int = 512, trial: int = 3,
                 margin: float = 0.05, set_threads=torch.set_num_threads) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.choices = sorted({self.max_threads, max(1, self.max_threads // 2)}, reverse=True)
        self.period, self.max_period, self.trial, self.margin = period, max_period, trial, margin
        self.set_threads = set_threads
        self.current = self.max_threads           # the chosen count
        self.running = self.max_threads           # the count the next step runs on
        self.recent: deque[float] = deque(maxlen=trial)   # seconds per row of the last steps on `current`
        self.trying: list[float] = []             # ... of the trial's steps
        self.interval = period                    # steps between trials (doubles after each lost trial)
        self.wait = period                        # steps until the next trial
        self.trial_left = 0
        self.steps = self.trials = self.switches = 0

    @property
    def active(self) -> bool:
        return len(self.choices) > 1

    def before(self) -> None:
        """Before a step: start a trial of the other count when it is due."""
        if not self.active:
            return
        self.steps += 1
        self.wait -= 1
        if self.trial_left == 0 and self.wait <= 0:
            self.trial_left = self.trial
            self.trials += 1
            self._run(next(c for c in self.choices if c != self.current))

    def after(self, seconds: float, rows: int) -> None:
        """After a step of `rows` pass rows (all sequences' pending tokens and drafts) that took
        `seconds` (drafting and verification)."""
        if not self.active or rows <= 0 or seconds <= 0:
            return
        per_row = seconds / rows
        if self.trial_left == 0:
            self.recent.append(per_row)
            return
        if self.trial_left < self.trial:          # the trial's first step pays for waking the other count
            self.trying.append(per_row)
        self.trial_left -= 1
        if self.trial_left:
            return
        before = self.recent
        if before and median(self.trying) * (1 + self.margin) < median(before):   # the trial's count is faster
            self.current = self.running
            self.switches += 1
            self.recent = deque(self.trying, maxlen=self.trial)
            self.interval = self.period
        else:
            self.interval = min(2 * self.interval, self.max_period)
        self.wait = self.interval
        self.trying = []
        self._run(self.current)

    def _run(self, threads: int) -> None:
        if threads != self.running:
            self.set_threads(threads)
            self.running = threads
