"""Probes: when the controller tries drafting again for a row of a drafter with state (a trained head,
a draft model) that it keeps plain, and what it hears of the row meanwhile.

Such a drafter pays real work for every try, so a row it does not draft for is probed at a small
size (`Probes.size`) after a wait that doubles after each probe that does not pay (from PROBE_EVERY
up to MAX_PROBE_EVERY), and never more often than PROBE_SHARE of plain decoding's time allows
(`Probes.floor`, from what probes were measured to cost over the plain steps their drafts saved).
A probe is one step. While a row is kept off its drafter hears nothing of it (`RowSpec.listening`:
no target features, no commit), except in the LISTEN steps before a probe, whose catch-up reads
their features (`Probes.listens`). A stateless drafter is never probed: its shadows measure for free.

Torch-free: unit-tested with the controller (tests/engine/test_controller.py, test_kept_off.py).
"""
from __future__ import annotations

import math

from .costs import StepCosts
from .rowspec import DECAY, PROBE_EVERY, RowSpec, expected_tokens

PROBE_ACCEPTANCE = 0.9  # a row is probed only at sizes where drafts accepted this often would pay
PROBE_SHARE = 0.01      # failed probes take at most this share of plain decoding's time
MAX_PROBE_EVERY = 256   # the wait between probes (PROBE_EVERY first) doubles after each that does not pay, up to this
LISTEN = 16             # plain steps before a probe in which a drafter with state hears of the row again


class Probes:
    def __init__(self, costs: StepCosts, shadowed: bool, margin: float) -> None:
        """`shadowed`: a stateless drafter (never probed); `margin`: how much faster than plain
        decoding a probe must be predicted to run at PROBE_ACCEPTANCE to be tried."""
        self.costs = costs
        self.shadowed = shadowed
        self.margin = margin
        self.seconds: float | None = None          # what a probe costs over the plain steps it saves (measured)

    def size(self, r: RowSpec) -> int:
        """A probe's size: the second level above 0 (or the first)."""
        return r.levels[min(2, len(r.levels) - 1)]

    def floor(self, costs: StepCosts, pending: int) -> int:
        """The fewest plain steps between two probes at which failed probes cost at most PROBE_SHARE
        of plain decoding's time: from their measured cost net of the plain steps their accepted
        drafts saved, or, before any, what a failed probe is predicted to cost."""
        plain = costs.step_seconds(pending, 0, 0.0)
        if self.seconds is not None and costs is self.costs:
            seconds = self.seconds
        else:
            s = 2
            seconds = costs.step_seconds(pending + s, 1, s) - plain + costs.node_seconds()
        return math.ceil(max(seconds, 0.0) / (PROBE_SHARE * plain))

    def due(self, r: RowSpec, costs: StepCosts) -> int:
        """A probe's size if this row's wait after plain steps is over and a probe could pay at
        PROBE_ACCEPTANCE, else 0 (always 0 for a stateless drafter or a row that drafts)."""
        r.probing = False
        if self.shadowed or r.size > 0 or len(r.gain) == 1:
            return 0
        r.probe_wait -= 1
        if r.probe_wait > 0:
            return 0
        s = self.size(r)
        plain = 1.0 / costs.step_seconds(1, 0, 0.0)
        if expected_tokens(PROBE_ACCEPTANCE, s) / costs.step_seconds(1 + s, 1, s) < self.margin * plain:
            r.probe_interval = min(2 * r.probe_interval, MAX_PROBE_EVERY)   # as a probe that did not pay
            r.probe_wait = r.probe_interval
            return 0
        r.probing = True
        return s

    def after_plan(self, r: RowSpec, size: int, costs: StepCosts) -> None:
        """A probe that did not make drafting win: probe half as often; one that did: the first pace.
        `costs`: the row's (fixed ones for a pinned row)."""
        if r.probed:
            r.probed = False
            if size == 0:
                r.probe_interval = min(2 * r.probe_interval, MAX_PROBE_EVERY)
                r.probe_wait = max(r.probe_interval, self.floor(costs, 1))
            else:
                r.probe_interval = PROBE_EVERY
        elif size == 0 and r.size > 0 and not self.shadowed:    # drafting stopped paying: the first probe
            r.probe_wait = max(r.probe_wait, self.floor(costs, 1))   # waits for the floor too
        r.probed, r.previous, r.size = r.probing, r.size, size

    def listens(self, r: RowSpec, size: int) -> bool:
        """Whether the drafter hears of an AUTO row this step (its target features, its commit):
        a stateless drafter's rows always (their shadows and lookups cost nothing to keep); a drafter
        with state's while the row drafts, is pinned, or is within LISTEN plain steps of its next
        probe. A row kept off costs its drafter nothing per step; only a listening row may be raised
        from plain (controller.plan), so a draft always reads the features of the step before it."""
        return self.shadowed or size > 0 or r.pinned or r.probe_wait <= LISTEN

    def observe(self, rows: list[RowSpec], proposed: list[int], paths: list[list[int]], pass_rows: int,
                seconds: float) -> None:
        """A step's probes (rows `probing`): what they cost (`seconds`: the step's pass and drafting)
        over the plain steps that would have emitted their tokens."""
        probes = [i for i, r in enumerate(rows) if r.probing]
        if not probes:
            return
        plain_rows = pass_rows - sum(proposed[i] for i in probes)
        plain = self.costs.pass_seconds(plain_rows)
        emitted = sum(len(paths[i]) for i in probes)
        extra = (seconds - plain) / len(probes) - emitted * plain / max(plain_rows, 1)
        self.seconds = extra if self.seconds is None else DECAY * self.seconds + (1 - DECAY) * extra
