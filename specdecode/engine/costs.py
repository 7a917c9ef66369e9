"""The target's forward cost against the rows of a pass (the cost curve the draft budget reads,
engine/budget.py): measured once at start-up on an empty cache, and read between its points; and
how a measured cost is followed from step to step (`toward`)."""
from __future__ import annotations

import time

SPIKE = 3.0             # one step's time counts at most this many times the estimate it updates: a step
                        # descheduled on a busy core took 8-12 ms where its kind took ~70 us (the tiny test
                        # model; a 2-thread pass waits at every barrier for the thread without a core), and one
                        # such drafting step priced a lookup's node at 12x its cost and kept a Predicted
                        # Output's exact prediction plain for 30 steps


def toward(estimate: float, seen: float, past: float) -> float:
    """A moving average's next value: `seen` weighs 1 - past, counted at most SPIKE * estimate (a
    step's time: one descheduled step moves the estimate a bounded step, a lasting change a few)."""
    if estimate > 0:
        seen = min(seen, SPIKE * estimate)
    return past * estimate + (1 - past) * seen


def measure_cost_curve(model, cache, max_rows: int, repeats: int = 3, batch: int = 1) -> dict[int, float]:
    """Forward seconds per sequence of a pass of `batch` sequences of r rows each, r in powers of
    two up to max_rows (and max_rows); rows 0..batch-1 of `cache` at slots 0..r-1 (the caller's
    prefill overwrites them). A batch's pass is measured as a batch: at a few sequences one more
    row per sequence costs little (the weights are read once), at many the pass is bound by
    arithmetic and every row costs nearly a sequence's step, so drafting that pays alone does not
    pay there. Past one sequence the curve is two points (1 and max_rows rows; interpolated).

    Each size's time is the fastest of `repeats` passes taken in rounds over all the sizes, so that
    a moment when another process takes the core slows one pass of every size rather than every
    pass of one; and a pass over more rows is never taken to cost less than one over fewer (a start-up
    on a busy 2-core host measured 6 rows at 3.09 ms after 4 rows at 3.31 ms: the budget then priced
    the fifth and sixth rows at nothing)."""
    import torch                    # here: the rest of this module is torch-free (serve/policy.py reads it)

    from ..forward import ForwardBatch
    rows = sorted({r for r in (1, 2, 4, 8, 16, 32, 64) if r <= max_rows} | {max_rows}) if batch == 1 \
        else sorted({1, max_rows})
    device = model.device
    passes = {}
    for r in rows:
        tokens = torch.zeros(batch, r, dtype=torch.long, device=device)
        passes[r] = ForwardBatch.chain(tokens, torch.zeros(batch, dtype=torch.long, device=device),
                                       torch.arange(batch, device=device),
                                       torch.arange(r, device=device)[None].expand(batch, r))
        model.logits(model.run(passes[r], cache), passes[r].logit_index)        # warm-up
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(repeats):
        for r, fb in passes.items():
            t0 = time.perf_counter()
            model.logits(model.run(fb, cache), fb.logit_index)
            best[r] = min(best[r], time.perf_counter() - t0)
    for row in range(batch):
        cache.truncate(row, 0)
    curve, floor = {}, 0.0
    for r in rows:
        floor = curve[r] = max(floor, best[r] / batch)
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
