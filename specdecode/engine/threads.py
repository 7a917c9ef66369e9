"""How many threads a step's passes use, chosen from measured step times.

The fused decoder's OpenMP threads meet at a barrier after every phase of a pass. When another
process is busy on one of the cores, the thread that shares it is descheduled for whole time slices
and every barrier waits for it: fewer threads are then faster (docs/models.md, "Threads").

The tuner runs the steps on the current count and now and then tries the other one for `trial`
steps (its first step, which wakes the other threads, left out). A trial step is compared only with
steps of the same size (rows) run on the current count within the last `period` steps, since a
pass's cost is far from proportional to its rows; sizes are matched in buckets (exact up to 8 rows,
then within a quarter), and a trial step without a match extends the trial, up to 4 x `trial` steps.
The trial's count is kept when the median of its time-per-row ratios to the matched steps is below
1 / (1 + `margin`). Trials cost time when they lose, so the wait between them doubles after each
lost trial (from `period` up to `max_period` steps) and goes back to `period` after a switch; steps of
a size suddenly SLOW times as long as the last ones of that size, twice in a row, start a trial at once.
"""
from __future__ import annotations

import math
import os
from collections import deque
from statistics import median

import torch

SLOW = 4.0              # a step this many times its size's recent time is a sudden slowdown


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; all of them where that is not known)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def size_bucket(rows: int) -> int:
    """Pass sizes compared with each other: exact up to 8 rows, then ranges a quarter wide."""
    return rows if rows <= 8 else 8 + round(4 * math.log2(rows / 8))


class ThreadTuner:
    def __init__(self, max_threads: int | None = None, period: int = 64, max_period: int = 512, trial: int = 3,
                 margin: float = 0.05, set_threads=torch.set_num_threads) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.choices = sorted({self.max_threads, max(1, self.max_threads // 2)}, reverse=True)
        self.period, self.max_period, self.trial, self.margin = period, max_period, trial, margin
        self.set_threads = set_threads
        self.current = self.max_threads           # the chosen count
        self.running = self.max_threads           # the count the next step runs on
        # size bucket -> (step, seconds per row) of the last steps of that size on `current`
        self.recent: dict[int, deque[tuple[int, float]]] = {}
        self.trying: list[tuple[int, int, float]] = []  # (step, size bucket, seconds per row) of the trial's
        self.interval = period                    # steps between trials (doubles after each lost trial)
        self.wait = period                        # steps until the next trial
        self.trial_left = 0
        self.trial_steps = 0                      # steps the current trial has run
        self.slow = 0                             # steps in a row SLOW times their size's recent time
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
            self.trial_steps = 0
            self.trials += 1
            self._run(next(c for c in self.choices if c != self.current))

    def after(self, seconds: float, rows: int) -> None:
        """After a step of `rows` pass rows (all sequences' pending tokens and drafts) that took
        `seconds` (drafting and verification)."""
        if not self.active or rows <= 0 or seconds <= 0:
            return
        entry = (self.steps, size_bucket(rows), seconds / rows)
        if self.trial_left == 0:
            before = [t for _, t in self.recent.get(entry[1], ())]
            self.slow = self.slow + 1 if before and entry[2] > SLOW * median(before) else 0
            if self.slow >= 2:                    # the machine became busy: try the other count now
                self.wait, self.interval, self.slow = 0, self.period, 0
            self._remember(*entry)
            return
        if self.trial_steps > 0:                  # the trial's first step pays for waking the other count
            self.trying.append(entry)
        self.trial_steps += 1
        self.trial_left -= 1
        ratios = self._ratios()
        if self.trial_left == 0 and len(ratios) < self.trial - 1 and self.trial_steps < 4 * self.trial:
            self.trial_left = 1                   # too few steps of a size seen before: one more
        if self.trial_left:
            return
        if ratios and median(ratios) * (1 + self.margin) < 1:   # the trial's count is faster
            self.current = self.running
            self.switches += 1
            self.recent = {}
            for step, bucket, per_row in self.trying:
                self._remember(step, bucket, per_row)
            self.interval = self.period
        else:
            self.interval = min(2 * self.interval, self.max_period)
        self.wait = self.interval
        self.trying = []
        self._run(self.current)

    def _remember(self, step: int, bucket: int, per_row: float) -> None:
        """A step on the current count: the reference for trial steps of its size."""
        self.recent.setdefault(bucket, deque(maxlen=self.trial)).append((step, per_row))

    def _ratios(self) -> list[float]:
        """The trial steps' times per row over those of same-size steps on the current count in the
        `period` steps before the trial."""
        oldest = self.steps - self.trial_steps - self.period
        ratios = []
        for _, bucket, per_row in self.trying:
            same = [t for step, t in self.recent.get(bucket, ()) if step >= oldest]
            if same:
                ratios.append(per_row / median(same))
        return ratios

    def _run(self, threads: int) -> None:
        if threads != self.running:
            self.set_threads(threads)
            self.running = threads
