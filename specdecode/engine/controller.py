"""The speculation controller: how many drafts each row of the batch carries in the next step
(chain tokens or tree nodes), from measured acceptance and costs. One algorithm for a lone request
and a batch of many.

Gains. Per row and draft size s (a level of LEVELS), the tokens a step at s emits and the nodes it
proposes, moving averages (`RowSpec.gain`, `RowSpec.nodes`). Drafters order nodes best-first, so
the draft of a smaller size is a prefix of the one proposed: a step at size S tells what every
s <= S would have emitted (the accepted path cut at the first node >= s); a step whose row
proposed fewer nodes than S, or whose chain was rejected inside its draft, tells every larger size
already measured too. A stateless drafter's rows at size 0 get shadow drafts, never verified,
scored against the tokens the row then emits: free measurements of every size.

Costs (costs.StepCosts): the target pass against its rows (every row's pending tokens and drafts;
on a mixture of experts also the distinct experts they are expected to read) and drafting, per
drafting row and per node.

Choice (`plan`). The sizes that maximise the batch's tokens per second: the sum of the rows' gains
over the step's predicted seconds. From plain decoding, rows are raised one move at a time, the row
with the most tokens per added row first, each to the level that gives the most tokens per second,
while that grows; a row's first move must win MARGIN over its share of plain decoding (the noise of
the model and what it leaves out). A lone row is the same rule: its best size, plain unless
drafting wins by MARGIN.

Exploration. After a step that accepted every node, the next size above is a candidate (a long copy
climbs past k, up to the span of a copying drafter; on a mixture of experts at the acceptance the
row's gain shows, `_climb_gain`); every EXPLORE steps, the next size above the
best, up to k. Their gains are estimates (every node accepted; PRIOR over plain decoding) weighed
like measured ones. A drafter with state pays for every try: a row it does not draft for is probed
now and then (probes.py: waits that double, bounded by the share of time failed probes may take),
and its drafter hears nothing of it meanwhile. New rows of such a drafter
start from what the last long row measured (`template`, weak evidence: another request's
acceptance), drafting at most a probe's size until one of their drafts is accepted.

Evidence before timings. Timings are noisy on a busy host; counted acceptance is not. A stateless
drafter's row (lookups, a prediction: drafting costs it nothing but the pass's rows) whose measured
tokens per step at a size show at least EVIDENT of its drafts accepted (verified drafts or shadows
that came true) keeps drafting at that size (`RowSpec.kept`); the costs may raise it, never lower
it, and it ends when the drafts stop being accepted. On a mixture of experts, whose verified rows
each read the experts they add, a kept size must also cover the pass's start-up shape (`_kept_size`).
A predicted output's row drafts PREDICTED tokens from its first step. A drafter with state pays real,
measured work per draft: its rows stay with the costs (and their MARGIN).

Pinned rows (seeded sampling with a drafter that samples its drafts: the row's random draws follow
its sizes) decide alone, from their own tokens and acceptance and fixed costs, never from timings,
so that the seed reproduces the text. `ON` rows draft k every step (`LLM(adaptive=False)`, the
server's `speculate: true`); `OFF` rows never.

Torch-free: unit-tested on synthetic steps (tests/engine/test_controller.py).
"""
from __future__ import annotations

import heapq
import math

from .costs import StepCosts, fixed_costs
from .probes import Probes
from .rowspec import AUTO, DECAY, OFF, ON, PROBE_EVERY, RowSpec, expected_tokens

__all__ = ["AUTO", "OFF", "ON", "PROBE_EVERY", "RowSpec", "SpeculationController", "expected_tokens"]

LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PRIOR = 1.2             # an explored size is assumed to decode this much faster than plain decoding
PRIOR_ACCEPTANCE = 0.7  # per position: what a drafter with state is assumed to reach before any step
EXPLORE = 8             # steps between explorations of the next larger size
MARGIN = 1.05           # drafting must be predicted this much faster than plain decoding
CARRY_MIN_STEPS = 32    # a finished row becomes the template of new rows only after this many steps
SHADOW_SHARE = 0.01     # shadow drafts (drafting and scoring) take at most this share of the steps' time
YOUNG = 16              # a row's first steps, drafting shadows at every step
PLAIN_RECHECK = 8       # steps a plain choice is kept while no row's gains changed (choosing is Python every step)
PREDICTED = 4           # a predicted output's row drafts this many from its first step (at most its k)


class SpeculationController:
    def __init__(self, capabilities, costs: StepCosts, adaptive: bool = True, max_batch: int | None = None) -> None:
        """`max_batch`: in a batch of more rows only ON rows draft (the server's spec_max_batch_size)."""
        caps = capabilities
        self.costs = costs
        self.adaptive = adaptive
        self.max_batch = max_batch
        self.shadowed = caps is not None and not caps.has_state     # shadows measure: no probes, no priors
        self.chains = caps is None or not caps.drafts_trees
        acceptance = caps.prior_acceptance if caps is not None else None
        self.prior_acceptance = PRIOR_ACCEPTANCE if acceptance is None else acceptance
        self.fixed = fixed_costs(caps.relative_cost if caps is not None else 0.0, costs.passes)   # pinned rows' costs
        self.template: RowSpec | None = None      # the last long row of a drafter with state (new rows start there)
        self.probes = Probes(costs, self.shadowed, MARGIN)   # when rows kept plain try drafting again
        self.shadow_seconds = 0.0                 # seconds of one step's shadow drafts (drafting + scoring)
        self.shadow_steps = 0
        self.plain_key: tuple | None = None       # the free rows and their gains' versions when all chose plain
        self.plain_steps = 0                      # steps that kept that choice

    # ------------------------------------------------------------------ rows
    def new_row(self, k: int, mode: str = AUTO, span: int = 0, pinned: bool = False,
                predicted: bool = False, sampled: bool = False) -> RowSpec:
        """A row asking for `k` drafts per step; `span`: how far a copying drafter's row may climb
        past k; `predicted`: the request carries a predicted output (news: drafted from the start);
        `sampled`: temperature > 0 (a lookup's draft is then accepted with the target's probability
        of each token, below the prior: such a row starts plain and its shadows decide)."""
        if mode == OFF or k <= 0:
            return RowSpec(0, OFF, listening=False)
        mode = mode if self.adaptive else ON
        top = max(k, span)
        row = RowSpec(k, mode, tuple(sorted({s for s in LEVELS if s <= top} | {k, top})), pinned)
        if mode != AUTO:
            return row
        template = self.template                  # only a drafter with state has one (finish_row)
        if template is not None and not predicted and not pinned:
            for s in row.levels:
                if s in template.gain:
                    row.gain[s], row.nodes[s] = template.gain[s], template.nodes[s]
                    row.carried.add(s)
            row.untried = True
            row.probe_interval = template.probe_interval
            cap = 2 * PROBE_EVERY                 # where probes keep failing, the wait goes on (across rows)
            row.probe_wait = (min(template.probe_wait, max(cap, self.probes.floor(self.costs, 1)))
                              if template.probe_interval > cap else max(PROBE_EVERY, min(template.probe_wait, cap)))
            return row
        if self.shadowed and sampled and not predicted:
            return row
        # the prior: every position accepted at prior_acceptance, up to 4 drafts. A stateless drafter's
        # greedy row starts there too: its first proposal is verified (the first verified step weighs
        # 0.9 against the prior, so one miss ends it), where plain-first waited for several shadows to
        # come true and a short answer that copies was half over before it drafted
        for s in row.levels[1:]:
            if s <= 4:
                row.gain[s], row.nodes[s] = expected_tokens(self.prior_acceptance, s), float(s)
                row.carried.add(s)
        if predicted:                             # a prediction is news the first step checks, whatever the timings
            row.kept = max(s for s in row.levels if s <= PREDICTED)
        return row

    def finish_row(self, row: RowSpec) -> None:
        """A row's request ended: a long row of a drafter with state is where new rows start."""
        if not self.shadowed and row.mode == AUTO and not row.pinned and \
                (row.steps >= CARRY_MIN_STEPS or self.template is not None) and len(row.gain) > 1:
            self.template = row

    # ------------------------------------------------------------------ before a step
    def plan(self, rows: list[RowSpec], pending: list[int]) -> list[int]:
        """Each row's draft size for the next step (0: plain); `pending[b]`: the row's tokens that
        go into the pass besides its drafts (normally 1)."""
        sizes = [0] * len(rows)
        free = []
        held = self.held(rows)
        for i, r in enumerate(rows):
            if r.mode == OFF:
                continue
            r.steps += 1
            if r.mode == ON:
                sizes[i] = r.k
            elif held:
                r.probing = False
            elif r.pinned:
                sizes[i] = self.probes.due(r, self.fixed) or self._alone(r, self.fixed, pending[i])
            elif (probe := self.probes.due(r, self.costs)):
                sizes[i] = probe
            elif self.shadowed or r.listening:    # a row kept off (not listening) waits for its probe
                if self.shadowed:                 # drafts being accepted go on; timings may raise the size
                    sizes[i] = self._kept_size(r, pending[i])
                free.append(i)
        if free:
            key = (tuple(id(rows[i]) for i in free), sum(rows[i].version for i in free),
                   sum(rows[i].steps // EXPLORE for i in free))
            if key == self.plain_key and self.plain_steps < PLAIN_RECHECK:
                self.plain_steps += 1             # nothing they measured changed: still plain
            else:
                self._choose(rows, pending, sizes, free)
                plain = all(sizes[i] == 0 for i in free)
                self.plain_key, self.plain_steps = (key if plain else None), 0
        for i, r in enumerate(rows):
            if r.mode == AUTO:
                self.probes.after_plan(r, sizes[i], self.fixed if r.pinned else self.costs)
                if not held:
                    r.listening = self.probes.listens(r, sizes[i])
        return sizes

    def _kept_size(self, r: RowSpec, pending: int) -> int:
        """A stateless drafter's row's kept size (`RowSpec.kept`, within its k or climb). On a mixture of
        experts each verified row reads the experts it adds, so half the drafts accepted may not pay:
        a measured size is kept there only while its counted tokens per step cover the rows it adds at
        the pass's start-up shape (`StepCosts.pass_shape`, no step timings); else the costs decide.
        A prediction's first size (news, not measured) is kept."""
        s = min(r.kept, max(r.k, r.size))
        if not s or self.costs.moe is None or s in r.carried:
            return s
        gain, nodes = r.gain.get(s, r.gain[r.kept]), r.nodes.get(s, float(s))
        return s if gain >= self.costs.pass_shape(pending + nodes) / self.costs.pass_shape(pending) else 0

    def _choose(self, rows: list[RowSpec], pending: list[int], sizes: list[int], free: list[int]) -> None:
        """Raise the free rows' sizes while the batch's tokens per second grows (module docstring)."""
        costs = self.costs
        total_rows = float(sum(pending))
        drafting, node_sum, tokens = 0, 0.0, 0.0
        depth_rows = [0] * (max(max(r.levels) for r in rows) + 1)    # rows drafting at each depth (passes)
        for i, r in enumerate(rows):
            s = sizes[i]
            n = r.nodes.get(s, float(s))
            total_rows += n
            node_sum += n
            drafting += s > 0
            tokens += r.gain.get(s, 1.0)
            for d in range(round(n)):
                depth_rows[d] += 1

        def seconds_with(rows_, drafting_, nodes_, deeper: tuple[int, int] = (0, 0)) -> float:
            """The step's seconds with the depths deeper[0] .. deeper[1] - 1 one row more."""
            for d in range(*deeper):
                depth_rows[d] += 1
            t = costs.step_seconds(rows_, drafting_, nodes_, depth_rows)
            for d in range(*deeper):
                depth_rows[d] -= 1
            return t
        seconds = seconds_with(total_rows, drafting, node_sum)
        share = (MARGIN - 1.0) * tokens / len(rows)           # a row's first move must win this much
        options = {i: self._options(rows[i], pending[i]) for i in free}
        heap = []
        for i in free:
            if (key := self._steepest(options[i], sizes[i])) is not None:
                heapq.heappush(heap, (-key, i))
        while heap:
            _, i = heapq.heappop(heap)
            r, now = rows[i], sizes[i]
            g0, n0 = r.gain.get(now, 1.0), (r.nodes.get(now, float(now)) if now else 0.0)
            best, best_rate = None, (tokens + (share if now == 0 else 0.0)) / seconds
            for s, g, n in options[i]:
                if s <= now:
                    continue
                t = seconds_with(total_rows + n - n0, drafting + (now == 0), node_sum + n - n0,
                                 (round(n0), round(n)))
                if (tokens + g - g0) / t > best_rate:
                    best, best_rate = (s, g, n, t), (tokens + g - g0) / t
            if best is None:
                continue
            s, g, n, seconds = best
            for d in range(round(n0), round(n)):
                depth_rows[d] += 1
            sizes[i], tokens = s, tokens + g - g0
            total_rows, node_sum, drafting = total_rows + n - n0, node_sum + n - n0, drafting + (now == 0)
            if (key := self._steepest(options[i], s)) is not None:
                heapq.heappush(heap, (-key, i))

    @staticmethod
    def _steepest(options: list[tuple[int, float, float]], now: int) -> float | None:
        """The most tokens per added node of a row's moves above size `now` (None: no move)."""
        base = next(((g, n) for s, g, n in options if s == now), (1.0, 0.0))
        keys = [(g - base[0]) / max(n - base[1], 0.5) for s, g, n in options if s > now]
        return max(keys) if keys else None

    def _options(self, r: RowSpec, pending: int, costs: StepCosts | None = None) -> list[tuple[int, float, float]]:
        """(size, tokens, nodes) of the sizes a row may take now: those measured up to its cap, and
        the ones exploration estimates (module docstring)."""
        costs = costs or self.costs
        cap = max(r.k, r.size)                   # sizes past k only as far as a climb has reached
        if r.untried:
            cap = min(cap, self.probes.size(r))
        out = [(0, r.gain[0], 0.0)] + [(s, r.gain[s], r.nodes[s]) for s in r.levels[1:] if s <= cap and s in r.gain]
        measured = max(s for s, _, _ in out)
        if r.all_accepted and r.size > 0:        # a climb: the next size above, every node accepted
            above = [s for s in r.levels if s > r.size]
            if above and not r.untried:
                climb = (above[0], self._climb_gain(r, above[0]), float(above[0]))
                out = [o for o in out if o[0] != above[0]] + [climb]
        elif r.steps % EXPLORE == 0 and measured < r.k and not r.untried:   # now and then the next size up to k
            s = next(s for s in r.levels if s > measured)
            out.append((s, self.prior(pending, costs)(s), float(s)))
        return out

    def _climb_gain(self, r: RowSpec, above: int) -> float:
        """A climb's estimate of the next size's tokens per step: every node accepted; on a mixture of
        experts, where a rejected row costs the experts it added, the acceptance the row's gain at its
        size shows, per position (one accepted step says little there)."""
        if self.costs.moe is None:
            return above + 1.0
        gain, low, high = r.gain.get(r.size, 1.0), 0.0, 1.0
        for _ in range(20):                      # expected_tokens(a, size) == gain, by bisection
            mid = (low + high) / 2
            low, high = (mid, high) if expected_tokens(mid, r.size) < gain else (low, mid)
        return expected_tokens(low, above)

    def prior(self, pending: int, costs: StepCosts | None = None):
        """The gain of n nodes at a size not yet measured: PRIOR times plain decoding's rate at their
        cost (at most every node accepted)."""
        costs = costs or self.costs
        plain = costs.step_seconds(pending, 0, 0.0)
        return lambda n: min(PRIOR * costs.step_seconds(pending + n, 1, float(n)) / plain, n + 1.0)

    def _alone(self, r: RowSpec, costs: StepCosts, pending: int) -> int:
        """A pinned row's best size, decided from its own gains at fixed costs."""
        plain = MARGIN / costs.step_seconds(pending, 0, 0.0)
        best, best_rate = 0, plain
        for s, g, n in self._options(r, pending, costs):
            rate = g / costs.step_seconds(pending + n, 1, n) if s else 0.0
            if rate > best_rate:
                best, best_rate = s, rate
        return best

    # ------------------------------------------------------------------ after a step
    def observe(self, rows: list[RowSpec], sizes: list[int], proposed: list[int], paths: list[list[int]],
                pass_rows: int, verify_seconds: float, draft_seconds: float, depths: list[int] | None = None,
                experts: float | None = None) -> None:
        """A step: per row its planned size, the nodes it proposed and its accepted path (node
        indices by depth), and its draft's depth (a chain's: its nodes); the pass's rows and the
        measured seconds of the pass (with verification) and of drafting; on MoE the distinct
        experts per layer the pass read."""
        depths = proposed if depths is None else depths
        costs = self.costs
        costs.observe_pass(pass_rows, verify_seconds, experts)
        if not any(sizes):           # a plain step (rows kept off or plain): no drafting, probe or gain to measure
            return
        drafting = sum(1 for s in sizes if s > 0)
        # a drafter with state drafting after plain steps first catches up on the tokens since (one
        # pass of its model): counted as one more node per such row, not as dearer nodes
        catch_up = 0 if self.shadowed else sum(1 for r, s in zip(rows, sizes) if s > 0 and r.previous == 0)
        deepest = max(depths, default=0)
        depth_rows = [sum(1 for d in depths if d > level) + (catch_up if level == deepest else 0)
                      for level in range(deepest + 1)]
        costs.observe_drafting(draft_seconds, drafting, sum(proposed) + catch_up, depth_rows)
        self.probes.observe(rows, proposed, paths, pass_rows, verify_seconds + draft_seconds)
        for r, s, n, path in zip(rows, sizes, proposed, paths):
            if s > 0 and r.mode != OFF:   # a first observation at a size: shadowed, what smaller sizes emit
                prior = None if self.shadowed else self.prior(1, self.fixed if r.pinned else costs)
                r.observe(s, n, path, self.chains, prior)

    def free_draft_pays(self, pass_rows: float, batch: int, length: int, acceptance: float) -> bool:
        """Would a draft that costs nothing to make (a lookup), `length` tokens each accepted at
        `acceptance`, added to a pass of `pass_rows` rows over `batch` sequences, emit more tokens
        per second than the row's plain step, by MARGIN? Only the pass grows."""
        now = self.costs.pass_seconds(pass_rows)
        later = self.costs.pass_seconds(pass_rows + length)
        return (batch - 1 + expected_tokens(acceptance, length)) / later > MARGIN * batch / now

    def free_rows(self, rows: list[RowSpec], sizes: list[int], constrained: list[bool]) -> list[int]:
        """The rows planned plain that may take drafts that cost nothing to make (a cascade's
        lookups; each kept only where `free_draft_pays`): AUTO rows at size 0, not pinned (their
        random draws follow their sizes), without a grammar, while the batch may draft."""
        if self.held(rows):
            return []
        return [i for i, (r, k) in enumerate(zip(rows, sizes))
                if k == 0 and r.mode == AUTO and not r.pinned and not constrained[i]]

    def held(self, rows: list[RowSpec]) -> bool:
        """Whether a batch of these rows is too large for any but ON rows to draft (`max_batch`)."""
        return self.max_batch is not None and len(rows) > self.max_batch

    # ------------------------------------------------------------------ shadow drafts
    def shadow_rows(self, rows: list[RowSpec], sizes: list[int], rooms: list[int], greedy: list[bool]) -> list[int]:
        """The rows that draft shadows this step ([]: none): a stateless drafter's AUTO rows at size
        0 with none pending and room for their k, when shadows are due (`shadow_due`). A young greedy
        row shadows every step (a short answer that copies is found early); a sampled row's shadows
        are rationed from the start: their hidden cost (the passes after them ran slower) outweighed
        what a sampled row's drafts win."""
        idle = [i for i, (r, k) in enumerate(zip(rows, sizes)) if k == 0 and r.mode == AUTO
                and r.shadow is None and not r.pinned and rooms[i] > 0]
        if not idle:
            return []
        young = any(rows[i].steps < YOUNG and greedy[i] for i in idle)
        return idle if self.shadow_due(self.costs.pass_seconds(len(rows)), young) else []

    def shadow_due(self, step_seconds: float, young: bool = False) -> bool:
        """Should this step draft shadows (stateless drafters' rows at size 0)? Every step while they
        are cheap, or while a row is `young` (its first YOUNG steps: a short answer is over before
        rationed shadows find that it copies); every n-th when they cost more than SHADOW_SHARE of a step."""
        if not self.shadowed:
            return False
        self.shadow_steps += 1
        if young:
            return True
        period = math.ceil(self.shadow_seconds / (SHADOW_SHARE * step_seconds)) if step_seconds > 0 else 1
        return self.shadow_steps % max(1, period) == 0

    def observe_shadows(self, seconds: float, draft_seconds: float, rows: int, nodes: int) -> None:
        """One step's shadow drafts cost `seconds` (drafting and scoring), of which `draft_seconds`
        the drafter's own for `rows` rows and `nodes` nodes (a measurement of drafting like a step's)."""
        past = DECAY if self.shadow_seconds else 0.0
        self.shadow_seconds = past * self.shadow_seconds + (1 - past) * seconds
        if nodes:
            self.costs.observe_drafting(draft_seconds, rows, nodes)
