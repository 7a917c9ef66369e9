"""How many drafts a step carries (chain tokens or tree nodes): chosen from measured costs and
the acceptance observed so far, so that the expected tokens per second is maximal, and plain
decoding (0 drafts) whenever nothing else pays.

Cost of a step at size b: the target forward over (pending + b) rows per sequence, read off a
curve measured once at start-up (`costs.measure_cost_curve`: forward seconds against rows), plus the
drafting time (per drafted node, measured). The curve is measured on an empty cache; at a real
context every row also reads the keys and values before it, so two corrections are learned from
the steps actually run: `scale` for a one-row pass (from steps that verify no draft) and
`row_scale` for what each further row adds (from steps that do; where the curve says rows cost
nothing, a start-up measured flat, `row_floor`: the seconds each row adds). On the embedded model at a few
hundred tokens of context one more row costs ~0.2 of a step, twice what the start-up curve says.

Gain at size b: tokens emitted per step. Drafters order nodes best-first, so the draft of a
smaller budget is a prefix of the one proposed (a chain's first tokens; a tree's first nodes,
which form a tree). Every verified step therefore tells what every smaller size would have
emitted: the accepted path cut at the first node >= b; and a step whose rows proposed fewer nodes than
its size allowed, what every larger size would have: the same. Sizes above the largest run so far are
explored one level at a time (every `explore_every` steps, or right after a step that accepted
every drafted node, the next size above the best), and
while plain decoding wins a small size is probed after `probe_every` steps, the wait doubling after
each probe that does not make drafting win (up to `max_probe_every`: a trained head that is rarely
right cost 6-11% in probes every 16 steps) and never more often than the probes' measured cost (net of
the plain steps their accepted drafts saved) allows
(`probe_floor`, PROBE_SHARE of plain decoding), unless shadows, below, measure the sizes (a probe of a
batch of many sequences costs several plain steps). A drafter without
per-request state (lookup, suffix, recycle) keeps drafting while plain decoding runs ("shadow"
drafts, one per sequence at a time, never verified): each is scored against the tokens the
sequence then emits, so a size that starts to pay is found without paying for a probe; a lookup
that costs more than SHADOW_SHARE (shadows.py) of a plain step (its draft and its scoring) shadows only every few
plain steps. Per size, gains are exponential moving averages (a shadow's over ~10, SHADOW_DECAY).
A drafter with state (a draft model) pays for every size it tries, so its first size is the one
its prior cost (`draft_cost`: seconds per drafted token, from the weights it reads) predicts best
at an acceptance of PRIOR_ACCEPTANCE per position (a trained head: from its held-out evaluation,
`prior_acceptance`), rather than a fixed one; the drafting time per
node starts from that prior (else from the first measured step) instead of zero. Where even drafts
that were always accepted could not beat plain decoding at the drafting cost known (`could_pay`: a
draft token costing nearly a target step), the budget neither starts nor probes there; a drafter that
pays to try is probed only where drafts accepted PROBE_ACCEPTANCE of the time would pay, since each
probe after plain steps first feeds it the tokens since its last draft.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .acceptance import expected_tokens
from .costs import interpolate, toward
from .shadows import shadow_period

LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PRIOR = 1.2             # a size not yet measured is assumed to decode this much faster than plain
PRIOR_ACCEPTANCE = 0.7  # per position: the starting size of a drafter that pays for what it tries
PROBE_SHARE = 0.01      # at most this share of plain decoding's time goes to probes that fail (a drafter that pays
                        # to try): a probe after plain steps first feeds the drafter every token since, and a
                        # trained head's probe of one or two nodes cost 1-2 plain steps on the embedded model
PROBE_ACCEPTANCE = 0.9  # a drafter that pays to try is probed only where drafts accepted this often would pay:
                        # a probe after plain steps first feeds it every token since (a catch-up pass)
CARRY_MIN_STEPS = 32    # a first call carries what it measured to the next (`carry`) only after this many steps
CARRIED_WEIGHT = 0.1    # a size's gain carried from an earlier call weighs this much against the new call's first
                        # step at that size: another request's acceptance is weak evidence about this one (the
                        # 1.5B / 0.5B pair drafted a short translation answer at the size a summary had paid
                        # at, step after step, 0.86x plain; at 0.3 still three steps at 5, at 0.1 one or two)
SHADOW_DECAY = 0.9      # weight of the past when a shadow draft is scored: shadows cost nothing, so their
                        # evidence is averaged over ~10 of them (a real step's 0.7, ~3): with 0.7 one shadow
                        # whose first token came true where one in ten does (a chat answer) made size 1 look
                        # like it paid, and every such shadow started steps that accepted nothing (3-5% of
                        # plain decoding's speed on the embedded model's answers)
PLAIN_RECHECK = 8       # steps between recomputations of best() in a run of plain steps (`_best_now`)
MARGIN = 1.05           # drafting must be predicted this much faster than plain decoding to be chosen:
                        # what the model leaves out (bookkeeping of a longer step) and its noise are
                        # a few percent, and a lookup drafter's gains near break-even are mostly noise


@dataclass
class DraftBudget:
    max_size: int
    curve: dict[int, float]                 # rows of one sequence's pass -> forward seconds
    decay: float = 0.7                      # weight of the past in the moving averages
    shadow_decay: float = SHADOW_DECAY      # ... of those that shadow drafts update
    explore_every: int = 8                  # steps between explorations of the next larger size
    probe_every: int = 16                   # steps between probes while plain decoding wins; doubled
    max_probe_every: int = 256              # after each probe that did not pay, up to max_probe_every
    probe_share: float = PROBE_SHARE        # and never more often than probes' measured cost allows
    draft_cost: float | None = None         # prior seconds per drafted node (None: measured only)
    prior_acceptance: float = PRIOR_ACCEPTANCE   # per position, what the starting size assumes
    shadowed: bool = False                  # the engine scores shadow drafts while plain decoding runs (a
                                            # stateless drafter): they measure every size for free, so no probes
    span: int = 0                           # a copying drafter's sizes past max_size: tried only right after a
                                            # step that accepted every node (a long copy), kept while they pay
    chains: bool = False                    # the drafter proposes chains, never trees (`observe`)
    opens: bool = True                      # the first step drafts the priors' size; False (a shadowed drafter
                                            # without a prediction): plain until shadows show a size that pays
                                            # (a lookup's first draft of a chat answer, 4 rows rejected in
                                            # nearly every call, cost ~0.3 of a step: 1% of a 30-token answer)
    levels: list[int] = field(init=False)
    gain: dict[int, float] = field(init=False)       # size -> mean tokens emitted per sequence-step
    nodes: dict[int, float] = field(init=False)      # size -> mean nodes a sequence proposes at that size
    scale: float = field(init=False, default=1.0)    # measured / curve time of a one-row pass
    row_scale: float = field(init=False, default=1.0)   # measured / curve time that each further row adds
    row_floor: float = field(init=False, default=0.0)   # measured seconds (on the curve's scale) a row adds where the
                                                        # curve says rows cost nothing (a start-up curve measured flat)
    draft_per_node: float = field(init=False, default=0.0)   # measured drafting seconds per node (node_seconds())
    draft_per_step: float = field(init=False, default=0.0)   # drafting seconds of a step that drafts nothing
    shadow_seconds: float = field(init=False, default=0.0)   # seconds of one shadow draft (measured)
    probe_seconds: float | None = field(init=False, default=None)   # what a probe costs over the plain steps that
                                                                     # would have emitted its tokens (measured)
    plain_steps: int = field(init=False, default=0)
    draft_measured: bool = field(init=False, default=False)     # draft_per_node holds a measurement
    all_accepted: bool = field(init=False, default=False)   # the last step accepted every drafted node
    size: int = field(init=False)
    steps: int = field(init=False, default=0)
    probe_interval: int = field(init=False, default=0)   # steps between probes now (probe_every, doubled ...)
    probe_wait: int = field(init=False, default=0)       # plain steps until the next probe
    probed: bool = field(init=False, default=False)      # the last step was a probe
    last_size: int = field(init=False, default=0)        # the size of the last step observed
    chosen: list[int] = field(init=False, default_factory=list)
    carried: set[int] = field(init=False, default_factory=set)   # sizes whose gain an earlier call measured,
                                                                 # not yet observed in this one
    seasoned: bool = field(init=False, default=False)   # started from an earlier call's budget (`carry`)
    calls: int = field(init=False, default=0)           # earlier calls in the chain of `carry` (0: the first)
    untried: bool = field(init=False, default=False)    # seasoned, and no draft of this call accepted yet
    _at: dict[float, float] = field(init=False, default_factory=dict, repr=False)   # rows -> curve seconds
    _version: int = field(init=False, default=0, repr=False)      # bumped by every `_update` (a gain; a drafting
                                                                  # step's times change only in steps that update one)
    _best_at: tuple[int, int, int] | None = field(init=False, default=None, repr=False)   # (version, step, best())

    def __post_init__(self) -> None:
        top = max(self.max_size, self.span)
        self.levels = sorted({x for x in LEVELS if x <= top} | {self.max_size, top})
        self.gain = {0: 1.0}
        self.nodes = {0: 0.0}
        self.probe_interval = self.probe_wait = self.probe_every
        # start at the modest size (at most 4) that the prior acceptance predicts fastest, at the costs
        # known (the batch's verify rows; a drafter that pays to try, its prior cost); plain decoding where
        # none pays (a batch of many sequences, whose every verify row costs nearly a step)
        sizes = [s for s in self.levels if 0 < s <= 4] or [min(self.levels[1:], default=0)]
        self.size = max(sizes, key=lambda s: (expected_tokens(self.prior_acceptance, s) / self.step_seconds(s), -s))
        if not self.opens or not self.could_pay(self.size, self.prior_acceptance):   # not even that pays:
            self.size = 0                                     # plain, and probes only where a size still could

    def carry(self, earlier: "DraftBudget | None") -> None:
        """Start from what an earlier call of the same drafter with state (a trained head, a draft
        model) measured: its gains per size (each weighing CARRIED_WEIGHT against this call's first
        step at that size), the drafting and pass-time corrections, its probing pace. Such a
        drafter pays for every try, and started from the priors with every request a head right
        ~4% of the time lost 5-8% of a 128-token answer to its first sizes and probes;
        carried, it starts plain where it did not pay, and a new request's first probe comes after
        probe_every to 2 * probe_every steps; where probes keep failing (their interval has doubled
        past 2 * probe_every), the wait runs on from where the earlier call left it, at most
        probe_floor steps: failed probes then cost probe_share of the time across calls, not one
        probe per request (a head's probe in each 30-token answer of the embedded model cost 3%).
        Not carried: a drafter without state (its shadow drafts measure every size at no cost from
        the first plain step), a request with a prediction (the engine: news the earlier call did
        not have), and a first call shorter than CARRY_MIN_STEPS steps, whose times include
        one-time costs (a bench's 8-token warm-up, a draft model's weights first read from disk, left
        the 1.5B / 0.5B pair drafting nothing). Every later call passes on what it was given and
        measured (`calls`): restarted from the priors after a short call, a head that did
        not pay explored 1-4 drafts per step for the first 8-10 steps of the next request (0.87-0.95x
        on a 36-token code answer)."""
        if earlier is None:
            return
        self.calls = earlier.calls + 1
        if (earlier.steps < CARRY_MIN_STEPS and earlier.calls == 0) or self.shadowed \
                or earlier.shadowed or len(earlier.gain) == 1:
            return
        self.seasoned = self.untried = True
        for size in self.levels:
            if size in earlier.gain:
                self.gain[size], self.nodes[size] = earlier.gain[size], earlier.nodes[size]
                self.carried.add(size)
        self.scale, self.row_scale, self.row_floor = earlier.scale, earlier.row_scale, earlier.row_floor
        self.draft_per_node, self.draft_per_step = earlier.draft_per_node, earlier.draft_per_step
        self.draft_measured, self.shadow_seconds = earlier.draft_measured, earlier.shadow_seconds
        self.probe_interval, self.probe_seconds = earlier.probe_interval, earlier.probe_seconds
        # the wait goes on where the earlier call left it, between probe_every and 2 * probe_every (a new
        # request may be one where the drafter pays); where probes keep failing (their interval has
        # doubled past that), with no lower bound and capped only by what the probes' cost allows
        # (probe_floor: a head's probes of 5-30 ms on the embedded model, every request, cost it 3-5%)
        cap = 2 * self.probe_every
        if earlier.probe_interval > cap:
            self.probe_wait = min(earlier.probe_wait, max(cap, self.probe_floor()))
        else:
            self.probe_wait = max(self.probe_every, min(earlier.probe_wait, cap))
        self.size = self.best()

    @property
    def draft_time_known(self) -> bool:
        """The drafting time per node is a prior (`draft_cost`) or a measurement."""
        return self.draft_cost is not None or self.draft_measured

    def could_pay(self, size: int, acceptance: float = 1.0) -> bool:
        """Could drafting at `size` beat plain decoding if drafts were accepted at `acceptance` per
        position (1.0: all of them), at the drafting cost known so far? (A drafter whose tokens cost
        nearly a target step cannot: the 135M model's layer-skip draft keeps 27 of its 30 layers.)
        Drafting costs nothing until its cost is known (a prior or a measurement): verification alone
        decides then."""
        return expected_tokens(acceptance, size) / self.step_seconds(size) >= MARGIN / self.step_seconds(0)

    # ------------------------------------------------------------------ the model
    def step_seconds(self, size: int, pending: float = 1.0) -> float:
        """Predicted seconds per sequence of a step at `size` (drafting included)."""
        nodes = self.nodes.get(size, size)
        drafting = self.draft_per_step + self.node_seconds() * nodes if size > 0 else 0.0
        return self.pass_seconds(pending + nodes) + drafting

    def node_seconds(self) -> float:
        """Drafting seconds per node: measured, or the prior scaled like a one-row target pass
        (a draft model's step grows with the context as the target's does)."""
        if self.draft_cost is not None and not self.draft_measured:
            return self.draft_cost * self.scale
        return self.draft_per_node

    def pass_seconds(self, rows: float) -> float:
        """Predicted seconds of one sequence's target pass (and verification) over `rows` rows."""
        one = self._curve_at(1.0)
        return self.scale * (one + max(self.row_scale * (self._curve_at(rows) - one), self.row_floor * (rows - 1.0)))

    def _curve_at(self, rows: float) -> float:
        """interpolate(curve, rows), remembered: every step asks it for each size (the curve is fixed)."""
        seconds = self._at.get(rows)
        if seconds is None:
            seconds = self._at[rows] = interpolate(self.curve, rows)
        return seconds

    def best(self) -> int:
        """The size with the most tokens per second among those measured."""
        # ties go to the larger size: a drafter that proposes nothing at a size costs little there
        # (lookup drafters often have no match), and drafting keeps its gains measured; plain
        # decoding keeps a MARGIN. Sizes past max_size (a copying drafter's span) only up to the size
        # a climb has reached: where a lookup's drafts are short every size above them ties (or wins
        # on one lucky step), and choosing 32 there verifies the next long lookup whole (32 rows:
        # several plain steps) on no evidence of a long copy
        # (every step asks this: each size's step time is computed once, could_pay inlined at acceptance 1)
        cap = max(self.max_size, self.size)
        if self.untried:    # a new request's drafts risk at most a probe's size until one is accepted: the sizes
            cap = min(cap, self.probe_size())   # carried are another request's evidence (the pair's 18-token
                                                # translation after a summary drafted 4 and 4, both rejected,
                                                # 0.87-0.92x; capped only at its first step, 2 then 4)
        plain = self.step_seconds(0)
        best, best_key = 0, (round(self.gain[0] / plain, 9), 0)
        for s in self.levels:
            if s == 0 or s > cap or s not in self.gain:
                continue
            seconds = self.step_seconds(s)
            if (s + 1) / seconds < MARGIN / plain:          # could_pay(s): not even if every draft came true
                continue
            key = (round(self.gain[s] / seconds / MARGIN, 9), s)
            if key > best_key:
                best, best_key = s, key
        return best

    # ------------------------------------------------------------------ each step
    def next_size(self) -> int:
        """The size the next step drafts."""
        self.steps += 1
        best = self._best_now()
        larger = [s for s in self.levels if s > best]
        if self.probed:               # a probe that did not make drafting win: probe half as often
            self.probe_interval = self.probe_every if best else min(2 * self.probe_interval, self.max_probe_every)
            self.probed, self.probe_wait = False, max(self.probe_interval, self.probe_floor())
        elif best == 0 and self.last_size > 0:    # drafting (the starting size) stopped paying: the first
            self.probe_wait = max(self.probe_wait, self.probe_floor())        # probe waits for the floor too
        if len(self.gain) == 1 and self.size > 0:     # no draft measured yet: the starting size
            pass
        elif best == 0:               # plain decoding wins: now and then probe a small size that could pay
            self.probe_wait -= 1
            probe = not self.shadowed and self.probe_wait <= 0 and larger
            self.size = self.probe_size() if probe else 0
            if self.size and not self.could_pay(self.size, PROBE_ACCEPTANCE if self.draft_cost is not None else 1.0):
                self.size = 0
            self.probed = self.size > 0
        elif self.all_accepted and [s for s in self.levels if s > max(best, self.size) and self.could_pay(s)]:
            # hill climbing: after a step whose drafts were all accepted, the next size above it (past
            # max_size too: a long copy goes on growing while it is accepted whole) that could pay
            self.size = next(s for s in self.levels if s > max(best, self.size) and self.could_pay(s))
        elif self.steps % self.explore_every == 0 and [s for s in larger if s <= self.max_size and self.could_pay(s)]:
            self.size = larger[0]   # now and then the next larger size up to max_size (its gain is then known)
        else:
            self.size = best
        self.chosen.append(self.size)
        return self.size

    def _best_now(self) -> int:
        """best(), recomputed only every PLAIN_RECHECK steps of a run of plain steps where nothing but
        the pass-time scale changed (no gain, no drafting cost): such a step moves every size's time
        alike, and best() cost ~20 us a step (0.7% of the embedded model's) where it answered plain."""
        cached = self._best_at
        if cached is not None and cached[2] == 0 and self.last_size == 0 and cached[0] == self._version \
                and self.steps - cached[1] < PLAIN_RECHECK:
            return 0
        best = self.best()
        self._best_at = (self._version, self.steps, best)
        return best

    def probe_floor(self) -> int:
        """The fewest plain steps between two probes at which failed probes cost at most
        probe_share of plain decoding's time (their measured cost, net of the plain steps their
        accepted drafts saved: probes that pay for themselves set no floor; before any probe, what
        the budget predicts a probe costs a drafter that pays to try: its size's step over a plain
        one, plus a catch-up node, as if it failed): a cheap probe keeps the pace of probe_every,
        a costly one (a head's catch-up, a draft model's) comes less often. The 1.5B / 0.5B pair's
        probe (one draft-model token and a row, ~0.5 of a plain step) 16 steps after the starting
        size failed had cost a short translation answer 2%."""
        if self.probe_seconds is not None:
            seconds = self.probe_seconds
        elif self.draft_cost is not None and len(self.levels) > 1:
            seconds = self.step_seconds(self.probe_size()) - self.step_seconds(0) + self.node_seconds()
        else:
            seconds = 0.0
        return math.ceil(max(seconds, 0.0) / (self.probe_share * self.step_seconds(0)))

    def probe_size(self) -> int:
        """The size a probe from plain decoding drafts: the second level above 0 (or the first)."""
        return self.levels[min(2, len(self.levels) - 1)]

    def shadow_due(self) -> bool:
        """Should this plain step draft a shadow? Every plain step while shadows are cheap; every
        n-th step when one costs more than SHADOW_SHARE of a plain step."""
        self.plain_steps += 1
        return self.plain_steps % shadow_period(self.shadow_seconds, self.pass_seconds(1.0)) == 0

    def observe_shadow_cost(self, seconds: float, draft_seconds: float = 0.0, rows: int = 0, nodes: int = 0) -> None:
        """What one shadow cost (its draft and its scoring), and the drafter's time for shadows of
        `rows` sequences, `nodes` nodes in all: drafts like a step's, so the drafting cost per node
        follows them while plain decoding runs (else one slow drafting step, priced at what it
        took, keeps drafting off until another step drafts)."""
        self.shadow_seconds = seconds if not self.shadow_seconds else toward(self.shadow_seconds, seconds, self.decay)
        if nodes:
            self._observe_nodes(draft_seconds, rows, nodes)

    def _observe_nodes(self, draft_seconds: float, rows: int, nodes: int) -> None:
        """Drafting seconds of `rows` sequences' `nodes` nodes (a step's, or shadows'): the drafting
        cost per node, beyond the cost of looking (draft_per_step, per sequence)."""
        per_node = max(draft_seconds - self.draft_per_step * rows, 0.0) / nodes
        past = self.decay if self.draft_time_known else 0.0          # no zero prior
        self.draft_per_node = toward(self.node_seconds(), per_node, past)
        self.draft_measured = True

    def observe_shadow(self, proposed: int, matched: int, nodes: list[int] | None = None) -> None:
        """A shadow draft of `proposed` nodes whose main path's first `matched` tokens came true;
        `nodes`: the path's node indices (a tree's; None: a chain, 0, 1, ...). A size of s nodes
        is credited with the matched path nodes below s only: a recycle tree's first 5 nodes are
        mostly siblings, and crediting it with 5 matched path tokens made every size look like it
        paid where real trees of that size accepted nothing (0.82x plain on a short answer)."""
        for s in self.levels:
            if s == 0:
                continue
            hits = matched if nodes is None else sum(1 for node in nodes[:matched] if node < s)
            self._update(s, 1.0 + min(hits, s), float(min(proposed, s)), self.shadow_decay)

    def observe(self, size: int, num_nodes: list[int], accepted_nodes: list[list[int]],
                verify_seconds: float, draft_seconds: float, pending: float) -> None:
        """A step at `size`: per sequence the nodes proposed and the accepted path (node indices
        by depth); its measured verify (target pass + verification) and drafting seconds."""
        batch = len(num_nodes)
        if batch == 0:
            return
        self.all_accepted = size > 0 and sum(num_nodes) > 0 and all(
            len(path) == n for path, n in zip(accepted_nodes, num_nodes))
        drafted = max(num_nodes + [0])
        rows = pending + drafted
        one = self._curve_at(1.0)
        extra = self._curve_at(rows) - one
        if extra > 0.02 * one:        # what the rows past the first cost here
            added = (verify_seconds / batch / self.scale - one) / extra
            self.row_scale = toward(self.row_scale, min(max(added, 0.25), 8.0), self.decay)
        elif drafted:                 # rows the curve prices at (nearly) nothing: what each costs here
            added = (verify_seconds / batch / self.scale - one) / drafted
            self.row_floor = self.decay * self.row_floor + (1 - self.decay) * added
        else:                         # a one-row pass: the base cost
            self.scale = toward(self.scale, verify_seconds / batch / max(one + extra, 1e-9), self.decay)
        nodes = sum(num_nodes)
        if size > 0 and not nodes:      # looked for drafts and found none: the cost of looking
            self.draft_per_step = toward(self.draft_per_step, draft_seconds / batch, self.decay)
        if nodes:
            # a drafter with state drafting after plain steps first catches up on the tokens since
            # (one batched pass of its model): counted as one more node, not as dearer nodes (a
            # probe after 200 plain steps would otherwise close the door on later probes for good)
            catch_up = batch if self.draft_cost is not None and self.last_size == 0 else 0
            self._observe_nodes(draft_seconds, batch, nodes + catch_up)
        self.last_size = size
        self.untried = self.untried and not any(accepted_nodes)     # until a draft of this request's is accepted
        if self.probed and size > 0:     # what this probe cost over the plain steps that would have emitted its
            # tokens: a probe whose drafts were accepted costs less than its time, or nothing (simulated, a
            # drafter right 60% of the time at 0.02 of a step per token whose stretches of drafting end on
            # noise: 1.13x plain with probes priced at their time over one plain step, 1.18x net)
            emitted = sum(1 + len(path) for path in accepted_nodes) / batch
            extra = (draft_seconds + verify_seconds) / batch - emitted * self.step_seconds(0)
            self.probe_seconds = extra if self.probe_seconds is None else \
                self.decay * self.probe_seconds + (1 - self.decay) * extra
        if size == 0:
            return
        # a step whose every row proposed fewer nodes than the size allowed (a lookup's short match, a
        # draft model's chain stopped where it was unsure) tells what every larger size would have
        # drafted too: the same; so does a chain rejected inside its draft (a larger size's chain has
        # it as a prefix: the same tokens emitted, more nodes drafted). Known larger sizes learn it (else
        # a size carried from another request keeps that request's gain while this one's steps, at
        # smaller sizes, say otherwise: the pair's translation went on from an accepted probe of 2 to
        # sizes 5, 4 and 5 a summary had paid at, 2 of 9 drafts accepted, 0.85x plain)
        decided = all(n < size or (self.chains and len(path) < n) for path, n in zip(accepted_nodes, num_nodes))
        for s in self.levels:
            if s == 0 or (s > size and not (decided and s in self.gain)):
                continue
            emitted = sum(1 + sum(1 for node in path if node < s) for path in accepted_nodes) / batch
            proposed = sum(min(n, s) if n < size or s <= size else s for n in num_nodes) / batch
            self._update(s, emitted, proposed, CARRIED_WEIGHT if s in self.carried else None)
            self.carried.discard(s)

    def _update(self, size: int, emitted: float, proposed: float, decay: float | None = None) -> None:
        """Moving averages of a size's tokens and nodes per step. The first observation is blended
        with an optimistic prior (drafting at that size 20% faster than plain decoding, at most every
        node accepted), so one unlucky step does not switch speculation off. A shadowed drafter's
        prior is what the smaller sizes emit (a larger draft emits at least as much; plain decoding's
        1 token where none is measured): its shadows measure every size at no cost, and with their
        slow average a prior of even break-even let one lucky shadow choose a size no step had
        supported (the embedded model's 30-token translation: 0.88-0.92x plain). The prior is taken at
        the nodes the first observation proposed, not at the size: a lookup that proposes 5 tokens
        at size 32 would otherwise start with the gain of 32 accepted nodes, whose cost then falls
        toward 5 nodes faster than the gain falls toward what was accepted, and that size is chosen
        (a 32-row pass costs several plain steps) where nothing is accepted."""
        self._version += 1
        if size not in self.gain:        # (never more than a step can emit: proposed + 1 tokens)
            self.nodes[size] = float(proposed)
            if self.shadowed:       # shadows explore for free: no optimism, what the smaller sizes emit
                self.gain[size] = max(g for s, g in self.gain.items() if s < size)
            else:
                self.gain[size] = min(PRIOR * self.step_seconds(size) / self.step_seconds(0), proposed + 1.0)
        past = self.decay if decay is None else decay
        self.gain[size] = past * self.gain[size] + (1 - past) * emitted
        self.nodes[size] = past * self.nodes[size] + (1 - past) * proposed
