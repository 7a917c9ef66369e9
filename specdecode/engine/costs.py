"""What a step costs: the target's pass against its rows, and drafting.

The pass follows a curve measured once on an empty cache (`measure_cost_curve`: seconds against the
rows of one pass), corrected by two factors learned from the steps run: `scale` for a one-row pass,
`row_scale` for what the rows past the first add. Both grow with the context (every row reads the
keys before it). A batch of B sequences is a pass of B rows and more; the curve is read between its
points and extended along its last segment. Where the curve says extra rows cost nothing (a flat
start-up measurement), `row_floor` learns the seconds each row adds. A curve whose one-row passes
now run far faster than it says was measured under load (`stale`): the engine measures it again.
Drafting costs seconds per drafting sequence (looking for drafts) plus seconds per drafted node,
measured; until measured, a drafter's prior per node (its relative cost times a one-row pass). A
drafter that runs a model pass per draft depth over the rows drafting (a draft model, a trained
head: `passes`) costs per pass what the curve's shape says a pass over that many rows costs (a
batch's drafts share each pass).

A mixture-of-experts target (`ExpertCosts`, `StepCosts.moe`): a pass of r rows reads the union of
the experts its rows route to, so it costs the rows (the curve, measured on rows of one token, which
route alike: a one-row pass's experts) plus seconds per distinct expert past those. The start-up
measurement times passes of distinct random tokens beside the curve's (`measure_pass_costs`): what
the extra experts cost, and how many r such rows read (random tokens route nearly at random: the
worst case for the union). Each pass's own union (`ExpertCounter`, the fused decoder's count) then
teaches how much of that worst case the real rows show (`ExpertCosts.spread`), so a row's price is
the experts it is expected to add.

Torch-free except `measure_cost_curve`, `measure_pass_costs` and `ExpertCounter`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

SPIKE = 3.0             # one step's time counts at most this many times the estimate it updates (a step
                        # descheduled on a busy core must not price drafting out for good)
DECAY = 0.7             # weight of the past in the moving averages
STALE = 0.67            # one-row passes running below this share of the curve's: it was measured under load
VERIFY_ROW = 0.15       # a verified row's cost in one-row passes: the fixed prior of pinned rows


def toward(estimate: float, seen: float, past: float = DECAY) -> float:
    """A moving average's next value: `seen` weighs 1 - past, counted at most SPIKE * estimate."""
    if estimate > 0:
        seen = min(seen, SPIKE * estimate)
    return past * estimate + (1 - past) * seen


def interpolate(curve: dict[int, float], rows: float) -> float:
    """The curve between its points; beyond the last, along its last segment."""
    points = sorted(curve.items())
    if rows <= points[0][0] or len(points) == 1:
        return points[0][1] if rows <= points[0][0] else points[0][1] * rows / points[0][0]
    for (r0, t0), (r1, t1) in zip(points, points[1:]):
        if rows <= r1:
            return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
    (r0, t0), (r1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (rows - r1) / (r1 - r0)


def curve_rows(max_rows: int) -> list[int]:
    """The pass sizes a curve up to `max_rows` is measured at: powers of two and max_rows."""
    return sorted({r for r in (1, 2, 4, 8, 16, 32, 64) if r <= max_rows} | {max_rows})


def measure_cost_curve(model, cache, row: int, rows: list[int], repeats: int = 3) -> dict[int, float]:
    """Seconds of a pass of r rows (one sequence's chain in cache row `row`, from slot 0), for r in
    `rows`: the fastest of `repeats` passes taken in rounds over all sizes (a moment when another
    process takes the core slows one pass of every size, not every pass of one); a pass over more
    rows is never taken to cost less than one over fewer. The caller's prefill overwrites the slots."""
    return measure_pass_costs(model, cache, row, rows, repeats)[0]


def measure_pass_costs(model, cache, row: int, rows: list[int], repeats: int = 3,
                       counter: ExpertCounter | None = None) -> tuple[dict[int, float], ExpertCosts | None]:
    """`measure_cost_curve`'s curve (rows of token 0: every row computes the same hidden states, so a
    mixture of experts routes them alike), and with a MoE target's `counter` its `ExpertCosts`:
    passes of the same sizes over distinct random tokens, timed in the same rounds, give the union
    of experts r rows read and what each expert past a one-row pass's costs (least squares over the
    sizes of the time and union the distinct rows add; at least its share of the weights a one-row
    pass reads, `ExpertCounter.share`)."""
    import torch

    from ..forward import ForwardBatch
    device = model.device
    gen = torch.Generator().manual_seed(0)
    kinds = ("same", "distinct") if counter is not None else ("same",)
    passes = {}
    for kind in kinds:
        for r in rows:
            if kind == "distinct" and r == 1:
                continue
            tokens = (torch.zeros(1, r, dtype=torch.long) if kind == "same"
                      else torch.randint(0, model.vocab_size, (1, r), generator=gen)).to(device)
            passes[kind, r] = ForwardBatch.chain(tokens, torch.zeros(1, dtype=torch.long, device=device),
                                                 torch.tensor([row], device=device),
                                                 torch.arange(r, device=device)[None])
    union = {}
    for key, fb in passes.items():                                       # warm-up, and each pass's union
        model.logits(model.run(fb, cache), fb.logit_index)
        if counter is not None:
            union[key] = counter.read()
    best = dict.fromkeys(passes, float("inf"))
    for _ in range(repeats):
        for key, fb in passes.items():
            started = time.perf_counter()
            model.logits(model.run(fb, cache), fb.logit_index)
            best[key] = min(best[key], time.perf_counter() - started)
    cache.truncate(row, 0)
    curve, floor = {}, 0.0
    for r in sorted(rows):
        floor = curve[r] = max(floor, best["same", r])
    if counter is None:
        return curve, None
    added = [(union["distinct", r] - union["same", r], best["distinct", r] - best["same", r]) for r in rows if r > 1]
    spread = sum(u * u for u, _ in added)
    per_expert = sum(u * t for u, t in added) / spread if spread > 0 else 0.0
    # never below what reading its weights costs at a one-row pass's pace (a pass that another process
    # delayed can hide the difference; a CPU decode step is bound by the bytes it reads)
    per_expert = max(per_expert, curve[min(rows)] * counter.share)
    used = counter.used
    return curve, ExpertCosts(used, counter.experts, per_expert,
                              {1: float(used), **{r: max(union["distinct", r], used) for r in rows if r > 1}})


class ExpertCounter:
    """The distinct experts a mixture-of-experts target's last pass read, per MoE layer on average
    (the fused decoder's `moe_count`, which every native pass writes)."""

    def __init__(self, counts, layers: int, used: int, experts: int, share: float = 0.0) -> None:
        self.counts, self.layers, self.used, self.experts = counts, layers, used, experts
        self.share = share          # one more expert in every MoE layer, as a share of a token's weights

    @staticmethod
    def of(model) -> ExpertCounter | None:
        """The counter of a MoE model (the fused decoder's count, or the eager MoE MLPs' `distinct`,
        models/moe.py); None for any other."""
        config = getattr(model, "config", None)
        if getattr(config, "moe", None) is None:
            return None
        counts = getattr(getattr(model, "fused", None), "moe_count", None)
        if counts is None:
            layers = getattr(model, "layers", ())
            counts = _EagerCounts([ly for ly in layers if isinstance(ly, dict) and "router" in ly])
        layers = len(counts.layers) if isinstance(counts, _EagerCounts) else sum(config.moe_layers or ())
        if not layers:
            return None
        expert = 3 * config.hidden_size * config.moe["intermediate"] * layers
        return ExpertCounter(counts, layers, config.moe["used"], config.moe["experts"], expert / config.weight_count())

    def read(self) -> float:
        """Distinct experts per MoE layer of the last pass (layers without experts count 0)."""
        return sum(self.counts.tolist()) / self.layers


class _EagerCounts:
    """The distinct experts each eager MoE MLP's last call read (models/moe.py's layer["distinct"])."""

    def __init__(self, layers: list[dict]) -> None:
        self.layers = layers

    def tolist(self) -> list[int]:
        return [ly.get("distinct", 0) for ly in self.layers]


@dataclass
class ExpertCosts:
    """What a mixture-of-experts target's pass adds for the distinct experts its rows read."""
    used: int                       # experts routed per token: what a one-row pass reads per layer
    experts: int                    # experts per layer: the most any pass reads
    seconds: float                  # seconds per distinct expert per layer past a one-row pass's (measured)
    union: dict[int, float]         # rows -> distinct experts per layer of a pass of distinct random tokens
    spread: float = 1.0             # learned: the share of that union's growth real passes show
    passes: int = 0                 # passes observed, their rows and distinct experts (totals: for a trace)
    rows_seen: int = 0
    experts_seen: float = 0.0

    def distinct(self, rows: float) -> float:
        """The distinct experts per layer a pass of `rows` rows is expected to read."""
        worst = min(interpolate(self.union, rows), float(self.experts))
        return self.used + self.spread * max(worst - self.used, 0.0)

    def added(self, rows: float) -> float:
        """The experts per layer a pass of `rows` rows reads past a one-row pass's."""
        return self.distinct(rows) - self.used

    def observe(self, rows: int, distinct: float) -> None:
        """A pass of `rows` rows read `distinct` experts per layer: the spread moves toward what it showed."""
        self.passes += 1
        self.rows_seen += rows
        self.experts_seen += distinct
        worst = min(interpolate(self.union, rows), float(self.experts)) - self.used
        if rows > 1 and worst > 0.5:
            self.spread = DECAY * self.spread + (1 - DECAY) * min(max((distinct - self.used) / worst, 0.0), 1.5)


@dataclass
class StepCosts:
    """Predicted seconds of a step (target pass + verification, and drafting), learned as it runs."""
    curve: dict[int, float]                     # rows of one pass -> seconds (start-up measurement)
    draft_cost: float | None = None             # prior drafting cost per node, in one-row passes (None: measured only)
    passes: bool = False                        # drafting runs a pass per depth over the drafting rows
    scale: float = 1.0                          # measured / curve time of a one-row pass
    row_scale: float = 1.0                      # measured / curve time the rows past the first add
    row_floor: float = 0.0                      # seconds a row adds where the curve says nothing
    per_row: float = 0.0                        # drafting seconds per drafting sequence (looking)
    per_node: float = 0.0                       # drafting seconds per drafted node
    node_measured: bool = False
    moe: ExpertCosts | None = None              # a mixture-of-experts target: what its passes' experts add
    _at: dict[float, float] = field(default_factory=dict, repr=False)     # rows -> curve seconds

    def extend(self, curve: dict[int, float]) -> None:
        """More measured points (a larger batch)."""
        self.curve.update(curve)
        self._at.clear()

    @property
    def stale(self) -> bool:
        """Whether the passes run so much faster than the curve says that it was measured while
        another process held the cores (the context only makes passes slower): its shape, which
        prices every added row, is then wrong too, and the curve should be measured again."""
        return self.scale < STALE

    def price_experts(self, moe: ExpertCosts | None) -> None:
        """A MoE target's expert costs, measured with the curve (`measure_pass_costs`); measured again,
        they keep the spread learned from the passes and the totals."""
        if moe is not None and self.moe is not None:
            moe.spread, moe.passes = self.moe.spread, self.moe.passes
            moe.rows_seen, moe.experts_seen = self.moe.rows_seen, self.moe.experts_seen
        self.moe = moe

    def remeasured(self, curve: dict[int, float]) -> None:
        """The curve measured again (`stale`): its points replace the old ones, and the corrections
        learned against the old ones start over."""
        self.curve = dict(curve)
        self._at.clear()
        self.scale = self.row_scale = 1.0
        self.row_floor = 0.0

    def _curve(self, rows: float) -> float:
        seconds = self._at.get(rows)
        if seconds is None:
            seconds = self._at[rows] = interpolate(self.curve, rows)
        return seconds

    def pass_seconds(self, rows: float) -> float:
        """A target pass over `rows` rows (every sequence's pending tokens and drafts)."""
        one = self._curve(1.0)
        extra = max(self.row_scale * (self._curve(rows) - one), self.row_floor * (rows - 1.0))
        if self.moe is not None:
            extra += self.moe.seconds * self.moe.added(rows)
        return self.scale * (one + extra)

    def pass_shape(self, rows: float) -> float:
        """A target pass over `rows` rows in one-row passes, as measured at start-up (no timings of
        the steps): the curve's shape, plus on MoE the experts those rows are expected to add."""
        one = self._curve(1.0)
        experts = self.moe.seconds * self.moe.added(rows) if self.moe is not None else 0.0
        return (self._curve(rows) + experts) / one

    def node_seconds(self) -> float:
        """Drafting seconds per node: measured, or the prior times a one-row pass (a draft model's
        pass grows with the context as the target's does)."""
        if self.draft_cost is not None and not self.node_measured:
            return self.draft_cost * self.pass_seconds(1.0)
        return self.per_node

    def shape(self, rows: float) -> float:
        """A pass over `rows` rows, in one-row passes."""
        return self._curve(rows) / self._curve(1.0)

    def units(self, nodes: float, depth_rows: list[int] | None) -> float:
        """Drafting work in nodes: with `passes`, each depth's pass over the rows drafting that deep
        (`depth_rows[d]`: rows at depth d + 1) in one-row passes; else the nodes."""
        if self.passes and depth_rows is not None:
            return sum(self.shape(r) for r in depth_rows if r)
        return nodes

    def step_seconds(self, rows: float, drafting: int, nodes: float, depth_rows: list[int] | None = None) -> float:
        """A step whose pass has `rows` rows, `drafting` sequences of which drafted `nodes` nodes."""
        if not drafting:
            return self.pass_seconds(rows)
        return self.pass_seconds(rows) + self.per_row * drafting + self.node_seconds() * self.units(nodes, depth_rows)

    def observe_pass(self, rows: int, seconds: float, experts: float | None = None) -> None:
        """One measured pass (with verification) of `rows` rows; on MoE, `experts`: the distinct
        experts per layer it read (their seconds are taken out before the curve's corrections)."""
        if self.moe is not None and experts is not None:
            self.moe.observe(rows, experts)
            seconds -= self.scale * self.moe.seconds * max(experts - self.moe.used, 0.0)
        one = self._curve(1.0)
        extra = self._curve(rows) - one
        if rows <= 1:
            self.scale = toward(self.scale, seconds / max(one, 1e-9))
        elif extra > 0.02 * one:
            added = (seconds / self.scale - one) / extra
            self.row_scale = toward(self.row_scale, min(max(added, 0.25), 8.0))
        else:                            # rows the curve prices at (nearly) nothing: what each costs here
            added = (seconds / self.scale - one) / (rows - 1)
            self.row_floor = DECAY * self.row_floor + (1 - DECAY) * max(added, 0.0)

    def observe_drafting(self, seconds: float, drafting: int, nodes: float, depth_rows: list[int] | None = None
                         ) -> None:
        """Drafting seconds of `drafting` sequences that proposed `nodes` nodes (a step's or shadows')."""
        if not drafting:
            return
        if not nodes:                    # looked and found nothing: the cost of looking (no zero prior)
            self.per_row = toward(self.per_row, seconds / drafting, DECAY if self.per_row else 0.0)
            return
        per_node = max(seconds - self.per_row * drafting, 0.0) / self.units(nodes, depth_rows)
        known = self.draft_cost is not None or self.node_measured
        self.per_node = toward(self.node_seconds(), per_node, DECAY if known else 0.0)
        self.node_measured = True


def fixed_costs(relative_cost: float, passes: bool) -> StepCosts:
    """Costs that never change with measurements (a pinned row's decisions must not depend on
    timings): a one-row pass of 1, each further row VERIFY_ROW of it, drafting its prior."""
    return StepCosts({1: 1.0, 2: 1.0 + VERIFY_ROW}, draft_cost=relative_cost, passes=passes)
