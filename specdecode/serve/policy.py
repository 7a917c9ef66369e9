"""When to speculate: per request and for the whole batch, from measured acceptance and costs.

Torch-free, so it is unit-testable. The scheduler asks `plan` for each row's k before a
step and reports the step to `observe`; every decision comes back as a `Decision` that the
metrics count.

Model. Draft acceptance is treated as i.i.d. per position with rate alpha, estimated per
request by the geometric maximum likelihood (accepted / (accepted + rejections), decayed so
recent steps weigh more). A step with k drafts then emits E(alpha, k) = 1 + alpha + ... +
alpha^k tokens on average. Its cost relative to a plain step is r(B, k) = (draft + verify
time) / plain step time at batch size B, measured by exponential moving averages; until both
were measured, a prior from the drafter's relative cost is used. Speculation pays when
E > r: a request stays on while E >= r * (1 + margin) and comes back on at E >= r * (1 +
margin) * (1 + hysteresis).

Long copies: a row of a copying drafter (lookups, a predicted output) that decodes alone doubles
its draft after each step whose drafts were all accepted, up to its span, and goes back to k at a
rejection (in a batch every row's drafts lengthen the pass all rows wait for: k is the cap).

Switching off:
* request ("low_acceptance"): its own alpha gives E below the bar;
* batch ("batch_cost"): at batch size B >= 2 the batch's gain, tokens per row and step with every
  row counted (B + accepted drafts) / B, is below the bar: verifying the rows' drafts lengthens the
  pass all B rows wait for more than they save;
* batch ("batch_size"): more rows than `max_batch_size` (a fixed limit, off by default).

Calibration: the first step at a batch size, and one in `recalibrate_every` after, is plain
(no drafts) so the plain step time at that size is measured, not assumed.

Switching back on (the draft's cache catches up by itself, see `drafters/model.py`):
* lookup drafters (no model, `shadow=True`): a disabled request keeps drafting for free and
  its drafts are scored against the tokens it then emits ("acceptance_recovered");
* model drafters: a disabled request speculates for one probe step after `probe_interval`
  plain steps (doubling after each failed probe, up to `max_probe_interval`) ("probe");
* the batch: when it shrinks below the size it was switched off at ("batch_size_dropped"),
  unless the step costs measured at the new size (2 rows or more: a lone row is its own policy's)
  say the acceptance of the rows now in it (the one it was switched off with until they measured
  their own) does not pay there either (then the new size is the threshold), or after a probe step whose
  pooled acceptance pays again ("probe"); probed only at sizes where drafts accepted PROBE_ALPHA of
  the time would pay (at 24 rows of the embedded model a step of 5 drafts per row cost 4.4 plain steps),
  or, with a lookup drafter, where the acceptance its rows' shadow drafts measure would pay.

A batch that grows to a size whose costs (measured, or estimated as below) say its rows' pooled
acceptance (PROBE_ALPHA before it is known) cannot pay is switched off before its step ("batch_cost").
Costs at a batch size not measured yet: the nearest measured size's cost per draft row, scaled up
by the size ratio for a larger batch (a pass of more rows is more bound by arithmetic), rather than
the one-row prior: a batch that grew from 11 to 16 rows speculated once at 3.8 plain steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.acceptance import expected_tokens
from ..engine.costs import SPIKE, toward

AUTO, ON, OFF = "auto", "on", "off"
PROBE_ALPHA = 0.9       # the batch is probed only at sizes where drafts accepted this often would pay


@dataclass
class Decision:
    scope: str       # "request" | "batch"
    action: str      # "disabled" | "enabled" | "probe"
    reason: str


@dataclass
class RowPolicy:
    """Per-request speculation state."""
    mode: str = AUTO               # "auto" (policy decides), "on" (forced), "off" (never)
    k: int = 0                     # draft length asked for
    on: bool = True                # the policy's current choice (auto mode)
    successes: float = 0.0         # decayed accepted drafts
    trials: float = 0.0            # decayed accepted drafts + rejections
    observations: int = 0          # steps (or shadow drafts) seen since the last switch
    steps_off: int = 0
    probe_wait: int = 0
    probing: bool = False
    shadow: tuple[int, list[int]] | None = None   # (output length when drafted, draft tokens)
    span: int = 0                  # a copying drafter's longest draft (0: k); reached by doubling k after each
    streak: int = 0                # step whose drafts were all accepted (a long copy), back to k at a rejection

    def size(self, batch: int = 1) -> int:
        """Drafts of the next speculating step: k, doubled per fully accepted step up to span when the
        row decodes alone (in a batch every row's drafts lengthen the pass all rows wait for)."""
        return min(self.span, self.k << min(self.streak, 8)) if self.span > self.k and batch == 1 else self.k

    @property
    def alpha(self) -> float:
        return self.successes / self.trials if self.trials > 0 else 0.0

    def record(self, drafted: int, accepted: int, decay: float) -> None:
        self.successes = self.successes * decay + accepted
        self.trials = self.trials * decay + accepted + (1 if accepted < drafted else 0)
        self.observations += 1


@dataclass
class Costs:
    """Exponential moving averages of step times, keyed by batch size (and k)."""
    plain: dict[int, float] = field(default_factory=dict)
    spec: dict[tuple[int, int], float] = field(default_factory=dict)
    plain_age: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def _ema(table: dict, key, value: float, expected: float = 0.0) -> None:
        """Move table[key] a fifth of the way to `value`, counted at most SPIKE times the estimate (one
        descheduled step moves it a bounded step); a first value at most SPIKE times `expected` (the
        estimate before any was measured) when there is one. The costs of a speculative step are only
        measured while a row drafts: a spike among a switched-off row's few drafting steps had priced a
        5-draft step at 7.7 plain steps, which no acceptance can pay, so the row never came back on."""
        if key in table:
            table[key] = toward(table[key], value, 0.8)
        else:
            table[key] = min(value, SPIKE * expected) if expected > 0 else value


class SpeculationPolicy:
    def __init__(self, shadow: bool, draft_cost: float, max_batch_size: int | None = None,
                 margin: float = 0.05, hysteresis: float = 0.10, min_observations: int = 3,
                 probe_interval: int = 8, max_probe_interval: int = 128, decay: float = 0.8,
                 recalibrate_every: int = 256) -> None:
        self.shadow = shadow                  # drafts are free to compute (lookup): score them while off
        self.draft_cost = draft_cost          # prior: draft time per draft token / plain step time
        self.max_batch_size = max_batch_size
        self.margin, self.hysteresis = margin, hysteresis
        self.min_observations, self.decay = min_observations, decay
        self.probe_interval, self.max_probe_interval = probe_interval, max_probe_interval
        self.recalibrate_every = recalibrate_every
        self.costs = Costs()
        self.batch_on = True
        self.batch_off_at = 0                 # batch size at which the batch was switched off
        self.batch_reason = ""
        self.batch_probe_wait = probe_interval
        self.batch_steps_off = 0
        self.batch_probing = False
        self.batch_observations = 0
        self.batch_alpha, self.batch_k = 0.0, 0   # pooled acceptance and k when switched off for cost
        self.batch_gain = 1.0                     # tokens per row and speculative step (moving average)
        self.calibrating = False

    # ---------------------------------------------------------------- costs
    def cost_ratio(self, batch: int, k: int) -> float:
        """r(B, k): a speculative step's time over a plain step's time."""
        if self.measured(batch, k):
            return self.costs.spec[(batch, k)] / self.costs.plain[batch]
        known = [j for j in range(1, k) if self.measured(batch, j)]
        if known:                                       # the nearest size measured at this batch, scaled
            j = max(known)                              # to k (each draft row costs about the same)
            return 1.0 + (self.costs.spec[(batch, j)] / self.costs.plain[batch] - 1.0) * k / j
        other = [(b, j) for b, j in self.costs.spec if self.measured(b, j)]
        if other:   # another batch size measured: its cost per draft row, scaled up for a larger batch (a
            b, j = min(other, key=lambda bj: (abs(bj[0] - batch), -bj[0]))   # pass of more rows is more
            per_row = (self.costs.spec[(b, j)] / self.costs.plain[b] - 1.0) / j   # bound by arithmetic:
            return 1.0 + k * per_row * max(1.0, batch / b)    # at 16 rows a draft row cost 0.56 of a step,
        return 1.0 + k * (self.draft_cost + 0.03)       # at 1 row 0.03); prior: drafting + a little verify

    def measured(self, batch: int, k: int) -> bool:
        """Both step costs at this batch size and k were measured (not the prior)."""
        return bool(self.costs.plain.get(batch)) and bool(self.costs.spec.get((batch, k)))

    def bar(self, batch: int, k: int, turning_on: bool) -> float:
        needed = max(self.cost_ratio(batch, k), 1.0) * (1.0 + self.margin)
        return needed * (1.0 + self.hysteresis) if turning_on else needed

    def pays(self, alpha: float, batch: int, k: int, turning_on: bool) -> bool:
        return expected_tokens(alpha, k) >= self.bar(batch, k, turning_on)

    # ---------------------------------------------------------------- before a step
    def plan(self, rows: list[RowPolicy]) -> tuple[list[int], list[Decision]]:
        """Draft length of each row for the next step (0 = no drafts)."""
        batch = len(rows)
        decisions: list[Decision] = []
        if self.max_batch_size is not None:
            over = batch > self.max_batch_size
            if over and self.batch_on:
                self._batch_off(batch, "batch_size", decisions)
            elif not over and not self.batch_on and self.batch_reason == "batch_size":
                self._batch_on_again("batch_size_dropped", decisions)
        auto = [r for r in rows if r.mode == AUTO and r.k > 0]
        seen = self._pooled_alpha(auto)               # planning changes no row's counts: read once
        if not self.batch_on and self.batch_reason == "batch_cost" and batch < self.batch_off_at:
            # the rows' own acceptance where they measured it (they may be other requests than the ones
            # the batch was switched off with); a lone row is its own policy's: a batch switched off at 8
            # rows, measured not to pay at 1 with those rows' acceptance, kept every later request plain,
            # an exact Predicted Output (96% accepted) included
            alpha = self.batch_alpha if seen is None else seen
            if batch >= 2 and self.measured(batch, self.batch_k) and not self.pays(alpha, batch, self.batch_k, True):
                self.batch_off_at = batch     # measured not to pay at this size either: stay off
            else:
                self._batch_on_again("batch_size_dropped", decisions)
        if self.batch_on and batch >= 2 and auto:      # the costs at this size say it cannot pay: off now,
            alpha = PROBE_ALPHA if seen is None else seen   # not after steps that cost several plain ones each
            k = max(r.k for r in auto)
            if not self.pays(alpha, batch, k, turning_on=False):
                self._batch_off(batch, "batch_cost", decisions)
                self.batch_alpha, self.batch_k = alpha, k
        self.batch_probing = False
        if not self.batch_on and self.batch_reason == "batch_cost" and self.batch_steps_off >= self.batch_probe_wait:
            # a lookup drafter's rows keep measuring their acceptance with shadow drafts while the batch is
            # off: probed only where that would pay (blind probes at 16 rows of the embedded model, a step
            # of 5 drafts per row costing 3.4 plain steps with ~20% accepted, cost the server ~3% of its
            # throughput); the check is free, so it runs every step
            shadowed = seen if self.shadow else None
            if self.pays(PROBE_ALPHA if shadowed is None else shadowed, batch, self.batch_k, turning_on=True):
                self.batch_probing = True
                decisions.append(Decision("batch", "probe", "periodic"))
            elif shadowed is None:  # not even drafts accepted PROBE_ALPHA of the time would pay at this size:
                self.batch_steps_off = 0        # a probe (a step of k drafts per row) costs several plain steps
                self.batch_probe_wait = min(2 * self.batch_probe_wait, self.max_probe_interval)
        # a plain step now and then measures the plain cost at this batch size
        age = self.costs.plain_age.get(batch)
        self.calibrating = (self.batch_on and bool(auto)
                            and not any(r.mode == ON and r.k > 0 for r in rows)     # a forced row drafts anyway
                            and (age is None or age >= self.recalibrate_every))
        if self.calibrating:
            decisions.append(Decision("calibration", "probe", "plain_cost"))
        ks = []
        for r in rows:
            r.probing = False
            if r.mode == OFF or r.k == 0:
                ks.append(0)
            elif r.mode == ON:
                ks.append(r.size(batch))
            elif self.calibrating:
                ks.append(0)
            elif not self.batch_on:
                ks.append(r.k if self.batch_probing and r.on else 0)
            elif r.on:
                ks.append(r.size(batch))
            elif not self.shadow and r.steps_off >= r.probe_wait:
                r.probing = True
                decisions.append(Decision("request", "probe", "periodic"))
                ks.append(r.k)
            else:
                ks.append(0)
        return ks, decisions

    def _pooled_alpha(self, rows: list[RowPolicy]) -> float | None:
        """The rows' pooled acceptance (their decayed accepted drafts over trials: steps' and, with a
        lookup drafter, shadow drafts'), None before min_observations trials."""
        trials = sum(r.trials for r in rows)
        return sum(r.successes for r in rows) / trials if trials >= self.min_observations else None

    # ---------------------------------------------------------------- after a step
    def observe(self, rows: list[RowPolicy], ks: list[int], drafted: list[int], accepted: list[int],
                step_seconds: float) -> list[Decision]:
        batch = len(rows)
        decisions: list[Decision] = []
        kmax = max(ks, default=0)
        for key in list(self.costs.plain_age):
            self.costs.plain_age[key] += 1
        if sum(drafted) == 0:
            Costs._ema(self.costs.plain, batch, step_seconds)
            self.costs.plain_age[batch] = 0
        else:
            plain = self.costs.plain.get(batch, 0.0)
            Costs._ema(self.costs.spec, (batch, kmax), step_seconds, plain * self.cost_ratio(batch, kmax))
        pooled_s = pooled_t = 0.0
        for r, k, n, a in zip(rows, ks, drafted, accepted):
            if n > 0:
                r.record(n, a, self.decay)
                r.streak = r.streak + 1 if a == n else 0
                if r.mode == AUTO:
                    pooled_s += a
                    pooled_t += a + (1 if a < n else 0)
            if r.mode != AUTO or r.k == 0:
                continue
            if r.on and self.batch_on and n > 0 and r.observations >= self.min_observations \
                    and not self.pays(r.alpha, batch, r.k, turning_on=False):
                self._row_off(r, decisions)
            elif not r.on:
                r.steps_off += 1
                if r.probing:
                    if self.pays(r.alpha, batch, r.k, turning_on=True):
                        self._row_on(r, "probe", decisions)
                    else:
                        r.steps_off = 0
                        r.probe_wait = min(2 * r.probe_wait, self.max_probe_interval)
        gain = (batch + sum(accepted)) / batch         # tokens per row and step, every row counted
        self._observe_batch(batch, kmax, pooled_s, pooled_t, gain, decisions)
        return decisions

    def observe_shadow(self, row: RowPolicy, batch: int, drafted: int, matched: int) -> list[Decision]:
        """A lookup draft made while the row was off, scored against the tokens it then emitted."""
        decisions: list[Decision] = []
        row.record(drafted, matched, self.decay)
        if not row.on and row.mode == AUTO and self.pays(row.alpha, batch, row.k, turning_on=True):
            self._row_on(row, "acceptance_recovered", decisions)
        return decisions

    def _observe_batch(self, batch: int, kmax: int, successes: float, trials: float, gain: float,
                       decisions: list[Decision]) -> None:
        """A step's pooled acceptance and its gain: tokens per row (every row, drafting or not). The
        batch pays when its gain beats the step's cost ratio: a row's drafts lengthen the pass every
        row waits for, so a row whose own drafts pay alone may not pay in a batch."""
        if trials == 0:
            if not self.batch_on:
                self.batch_steps_off = 0 if self.batch_probing else self.batch_steps_off + 1
            return
        alpha = successes / trials
        self.batch_gain = gain if self.batch_observations == 0 else \
            self.decay * self.batch_gain + (1 - self.decay) * gain
        if self.batch_on and batch >= 2:
            self.batch_observations += 1
            if self.batch_observations >= self.min_observations and \
                    self.batch_gain < self.bar(batch, kmax, turning_on=False):
                self._batch_off(batch, "batch_cost", decisions)
                self.batch_alpha, self.batch_k = alpha, kmax
        elif self.batch_probing:
            if gain >= self.bar(batch, kmax, turning_on=True):
                self._batch_on_again("probe", decisions)
            else:
                self.batch_steps_off = 0
                self.batch_probe_wait = min(2 * self.batch_probe_wait, self.max_probe_interval)

    # ---------------------------------------------------------------- switches
    def _row_off(self, r: RowPolicy, decisions: list[Decision]) -> None:
        r.on, r.steps_off, r.probe_wait, r.observations = False, 0, self.probe_interval, 0
        decisions.append(Decision("request", "disabled", "low_acceptance"))

    def _row_on(self, r: RowPolicy, reason: str, decisions: list[Decision]) -> None:
        r.on, r.observations, r.shadow = True, 0, None
        decisions.append(Decision("request", "enabled", reason))

    def _batch_off(self, batch: int, reason: str, decisions: list[Decision]) -> None:
        self.batch_on, self.batch_off_at, self.batch_reason = False, batch, reason
        self.batch_steps_off, self.batch_probe_wait = 0, self.probe_interval
        decisions.append(Decision("batch", "disabled", reason))

    def _batch_on_again(self, reason: str, decisions: list[Decision]) -> None:
        self.batch_on, self.batch_reason, self.batch_observations = True, "", 0
        decisions.append(Decision("batch", "enabled", reason))
