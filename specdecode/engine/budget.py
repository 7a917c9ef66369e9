"""How many drafts a step carries (chain tokens or tree nodes): chosen from measured costs and
the acceptance observed so far, so that the expected tokens per second is maximal, and plain
decoding (0 drafts) whenever nothing else pays.

Cost of a step at size b: the target forward over (pending + b) rows per sequence, read off a
curve measured once at start-up (`measure_cost_curve`: forward seconds against rows) and scaled
by the ratio of measured to predicted verify time of the sizes actually run, plus the drafting
time (per drafted node, measured).

Gain at size b: tokens emitted per step. Drafters order nodes best-first, so the draft of a
smaller budget is a prefix of the one proposed (a chain's first tokens; a tree's first nodes,
which form a tree). Every verified step therefore tells what every smaller size would have
emitted: the accepted path cut at the first node >= b. Sizes above the largest run so far are
explored one level at a time (every `explore_every` steps, the next size above the best), and
while plain decoding wins a small size is probed every `probe_every` steps. Per size, gains are exponential moving averages.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def measure_cost_curve(model, cache, max_rows: int, repeats: int = 3) -> dict[int, float]:
    """Forward seconds of one sequence's pass of r rows, r in powers of two up to max_rows (and
    max_rows), on row 0 of `cache` at slots 0..r-1 (the caller's prefill overwrites them)."""
    from ..forward import ForwardBatch
    rows = sorted({r for r in (1, 2, 4, 8, 16, 32, 64) if r <= max_rows} | {max_rows})
    curve = {}
    for r in rows:
        tokens = torch.zeros(1, r, dtype=torch.long, device=model.device)
        fb = ForwardBatch.chain(tokens, torch.tensor([0]), torch.tensor([0]), torch.arange(r)[None])
        model.run(fb, cache)                                      # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.run(fb, cache)
            best = min(best, time.perf_counter() - t0)
        curve[r] = best
    cache.truncate(0, 0)
    return curve


def interpolate(curve: dict[int, float], rows: float) -> float:
    points = sorted(curve.items())
    if rows <= points[0][0]:
        return points[0][1]
    for (r0, t0), (r1, t1) in zip(points, points[1:]):
        if rows <= r1:
            return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
    (r0, t0), (r1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (rows - r1) / (r1 - r0)


@dataclass
class DraftBudget:
    max_size: int
    curve: dict[int, float]                 # rows of one sequence's pass -> forward seconds
    decay: float = 0.9                      # weight of the past in the moving averages
    explore_every: int = 8                  # steps between explorations of the next larger size
    probe_every: int = 16                   # steps between probes while plain decoding wins
    levels: list[int] = field(init=False)
    gain: dict[int, float] = field(init=False)       # size -> mean tokens emitted per sequence-step
    nodes: dict[int, float] = field(init=False)      # size -> mean nodes a sequence proposes at that size
    scale: float = field(init=False, default=1.0)    # measured / predicted verify time
    draft_per_node: float = field(init=False, default=0.0)
    size: int = field(init=False)
    steps: int = field(init=False, default=0)
    chosen: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.levels = sorted({x for x in LEVELS if x <= self.max_size} | {self.max_size})
        self.gain = {0: 1.0}
        self.nodes = {0: 0.0}
        self.size = min(self.levels, key=lambda x: abs(x - 4))   # start at a modest size

    # ------------------------------------------------------------------ the model
    def step_seconds(self, size: int, pending: float = 1.0) -> float:
        """Predicted seconds per sequence of a step at `size` (drafting included)."""
        nodes = self.nodes.get(size, size)
        return self.scale * interpolate(self.curve, pending + nodes) + self.draft_per_node * nodes

    def best(self) -> int:
        """The size with the most tokens per second among those measured."""
        # ties go to the larger size: a drafter that proposes nothing at a size costs nothing there
        # (lookup drafters often have no match), and drafting keeps its gains measured
        return max((s for s in self.levels if s in self.gain),
                   key=lambda s: (round(self.gain[s] / self.step_seconds(s), 9), s))

    # ------------------------------------------------------------------ each step
    def next_size(self) -> int:
        """The size the next step drafts."""
        self.steps += 1
        best = self.best()
        larger = [s for s in self.levels if s > best]
        if len(self.gain) == 1:     # no draft measured yet: the starting size
            pass
        elif best == 0:               # plain decoding wins: now and then probe a small size
            probe = self.steps % self.probe_every == 0 and larger
            self.size = larger[min(1, len(larger) - 1)] if probe else 0
        elif self.steps % self.explore_every == 0 and larger:
            self.size = larger[0]   # hill climbing: the next larger size (its gain is then known)
        else:
            self.size = best
        self.chosen.append(self.size)
        return self.size

    def observe(self, size: int, num_nodes: list[int], accepted_nodes: list[list[int]],
                verify_seconds: float, draft_seconds: float, pending: float) -> None:
        """A step at `size`: per sequence the nodes proposed and the accepted path (node indices
        by depth); its measured verify (target pass + verification) and drafting seconds."""
        batch = len(num_nodes)
        if batch == 0:
            return
        predicted = batch * interpolate(self.curve, pending + max(num_nodes + [0]))
        self.scale = self.decay * self.scale + (1 - self.decay) * (verify_seconds / predicted)
        nodes = sum(num_nodes)
        if nodes:
            per_node = draft_seconds / nodes
            self.draft_per_node = self.decay * self.draft_per_node + (1 - self.decay) * per_node
        if size == 0:
            return
        for s in self.levels:
            if s == 0 or s > size:
                continue
            emitted = sum(1 + sum(1 for node in path if node < s) for path in accepted_nodes) / batch
            proposed = sum(min(n, s) for n in num_nodes) / batch
            for table, value in ((self.gain, emitted), (self.nodes, proposed)):
                old = table.get(s)
                table[s] = value if old is None else self.decay * old + (1 - self.decay) * value
