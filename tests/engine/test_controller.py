"""The speculation controller (engine/controller.py) and the step costs it reads (engine/costs.py),
on synthetic steps: what smaller and larger sizes would have emitted, plain decoding where drafts
do not pay, growth where they do, exploration, probes, shadows, batches, pinned rows."""
import random
import subprocess
import sys
from types import SimpleNamespace

from specdecode.engine.controller import (
    AUTO,
    CARRY_MIN_STEPS,
    OFF,
    ON,
    PROBE_EVERY,
    SHADOW_SHARE,
    RowSpec,
    SpeculationController,
    expected_tokens,
)
from specdecode.engine.costs import StepCosts, interpolate

CURVE = {1: 1.0, 2: 1.05, 4: 1.3, 8: 2.2, 16: 4.1, 32: 8.0, 64: 16.0}


def caps(has_state=False, trees=False, relative_cost=0.01, prior_acceptance=None, copies=False):
    return SimpleNamespace(has_state=has_state, drafts_trees=trees, relative_cost=relative_cost,
                           prior_acceptance=prior_acceptance, copies=copies)


def controller(curve=CURVE, **kw):
    c = caps(**kw)
    return SpeculationController(c, StepCosts(dict(curve), draft_cost=c.relative_cost if c.has_state else None,
                                              passes=c.has_state))


def run(ctrl, rows, steps, accept, propose=None, node_cost=0.0, rng=None, curve=CURVE):
    """Drive `ctrl` for `steps` steps: row b accepts each draft with probability accept[b] (a chain);
    `propose(b, size)` how many nodes it proposes (default: all); the pass costs CURVE at its rows;
    a stateless drafter's rows at size 0 get shadow drafts of k tokens (as the engine drafts them).
    Returns the sizes chosen per step."""
    rng = rng or random.Random(0)
    propose = propose or (lambda b, size: size)
    chosen = []
    for _ in range(steps):
        sizes = ctrl.plan(rows, [1] * len(rows))
        chosen.append(sizes)
        if any(s == 0 and r.mode == AUTO for r, s in zip(rows, sizes)) and ctrl.shadow_due(1.0):
            for b, (r, s) in enumerate(zip(rows, sizes)):
                if s == 0 and r.mode == AUTO:
                    n = propose(b, r.k)
                    matched = next((i for i in range(n) if rng.random() >= accept[b]), n)
                    r.observe_shadow(n, matched, None)
        proposed = [propose(b, s) if s else 0 for b, s in enumerate(sizes)]
        paths = []
        for b, n in enumerate(proposed):
            a = 0
            while a < n and rng.random() < accept[b]:
                a += 1
            paths.append(list(range(a)))
        pass_rows = len(rows) + sum(proposed)
        ctrl.observe(rows, sizes, proposed, paths, pass_rows, interpolate(curve, pass_rows), node_cost * sum(proposed))
    return chosen


def test_interpolate_and_extrapolate():
    assert interpolate(CURVE, 1) == 1.0
    assert abs(interpolate(CURVE, 3) - 1.175) < 1e-9
    assert abs(interpolate(CURVE, 80) - (16.0 + 8.0 * 16 / 32)) < 1e-9


def test_a_step_tells_every_smaller_size_and_a_decided_one_every_larger_size_measured():
    row = RowSpec(16, AUTO, (0, 1, 2, 3, 4, 6, 8, 12, 16))
    for _ in range(60):     # 8 nodes drafted, the path 0 -> 3 -> 6 accepted: sizes below 4 keep only node 0
        row.observe(8, 8, [0, 3, 6], chains=False, prior=lambda n: n + 1.0)
    assert [round(row.gain[s], 6) for s in (1, 2, 3, 4, 6, 8)] == [2, 2, 2, 3, 3, 4]
    assert 12 not in row.gain and row.nodes[4] == 4 and row.nodes[8] == 8
    chain = RowSpec(8, AUTO, (0, 1, 2, 4, 8), gain={0: 1.0, 8: 5.0}, nodes={0: 0.0, 8: 8.0})
    chain.observe(4, 4, [0], chains=True)               # rejected at depth 2: a larger size emits the same
    assert abs(chain.gain[8] - (0.7 * 5.0 + 0.3 * 2.0)) < 1e-9 and abs(chain.nodes[8] - 8) < 1e-9
    short = RowSpec(8, AUTO, (0, 1, 2, 4, 8), gain={0: 1.0, 8: 5.0}, nodes={0: 0.0, 8: 8.0})
    short.observe(4, 2, [0, 1], chains=True)            # proposed fewer than allowed: so would a larger size
    assert abs(short.nodes[8] - (0.7 * 8 + 0.3 * 2)) < 1e-9 and short.all_accepted


def test_plain_wins_where_drafts_are_rejected():
    ctrl = controller()
    rows = [ctrl.new_row(8, predicted=True)]            # opens at its prior: drafts from the first step
    sizes = run(ctrl, rows, 60, [0.0])
    assert sizes[0][0] > 0
    assert sum(1 for s in sizes[-40:] if s[0]) <= 6     # plain, but for explorations


def test_cheap_accurate_drafts_grow_to_k_and_a_copy_climbs_past_it():
    ctrl = controller()
    rows = [ctrl.new_row(8, predicted=True), ctrl.new_row(8, span=32, predicted=True)]
    sizes = run(ctrl, rows[:1], 40, [1.0])
    assert sizes[-1][0] == 8
    sizes = run(ctrl, rows[1:], 40, [1.0])
    assert sizes[-1][0] == 32                            # every draft accepted: past k, up to the span


def test_short_lookups_never_reach_span_sizes_without_a_climb():
    """A copying drafter whose lookups propose 5 tokens, rarely accepted: sizes above 5 are never
    chosen on no evidence of a long copy (a 32-row pass costs several plain steps)."""
    ctrl = controller()
    rows = [ctrl.new_row(5, span=32, predicted=True)]
    sizes = run(ctrl, rows, 200, [0.1], propose=lambda b, size: min(size, 5))
    assert max(s[0] for s in sizes) <= 6


def test_a_drafter_that_finds_nothing_gives_way_to_plain_decoding():
    ctrl = controller()
    rows = [ctrl.new_row(8, predicted=True)]
    sizes = run(ctrl, rows, 20, [1.0], propose=lambda b, size: 0, node_cost=0.0)
    assert sum(1 for s in sizes[5:] if s[0]) <= 2


def test_extra_rows_cost_what_the_steps_measure():
    """The start-up curve is corrected by the steps: one-row passes set the base, passes with
    drafts what each further row adds."""
    costs = StepCosts(dict(CURVE))
    for _ in range(20):
        costs.observe_pass(1, 2.0)                                     # 2x the curve
        costs.observe_pass(4, 2.0 * (1 + 3 * (1.3 - 1.0)))             # rows cost 3x what the curve says
    assert abs(costs.scale - 2.0) < 0.01 and abs(costs.row_scale - 3.0) < 0.05
    assert abs(costs.pass_seconds(4) - 2.0 * 1.9) < 0.05
    flat = StepCosts({1: 1.0, 8: 1.0})                                 # a start-up curve measured flat
    for _ in range(20):
        flat.observe_pass(5, 1.4)
    assert abs(flat.pass_seconds(5) - 1.4) < 0.01


def test_a_free_draft_pays_where_its_expected_tokens_outgrow_the_larger_pass():
    cheap = controller({1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4})         # memory bound: extra rows cost little
    dear = controller({1: 1.0, 2: 1.8, 4: 3.6, 8: 7.5})            # compute bound: a row ~ a step
    assert cheap.free_draft_pays(1, 1, 1, 0.4) and cheap.free_draft_pays(1, 1, 4, 0.8)
    assert not cheap.free_draft_pays(1, 1, 1, 0.05)                # a coincidence: the pass costs more
    assert not dear.free_draft_pays(1, 1, 2, 0.8) and dear.free_draft_pays(1, 1, 1, 0.99)
    # in a batch, one row's extra pass rows slow every row: a long cheap path pays less there
    assert cheap.free_draft_pays(1, 1, 8, 0.85) and not controller({1: 1.0, 8: 1.4, 16: 2.8}).free_draft_pays(
        8, 8, 8, 0.85)


def test_one_descheduled_step_moves_the_costs_a_bounded_step():
    costs = StepCosts(dict(CURVE))
    costs.observe_pass(1, 1.0)
    costs.observe_pass(1, 500.0)                       # a step descheduled on a busy core
    assert costs.scale < 2.0


def test_drafting_costs_per_node_and_per_drafting_row_with_no_zero_prior():
    costs = StepCosts(dict(CURVE))
    costs.observe_drafting(0.01, 2, 0)                  # looked, found nothing
    assert abs(costs.per_row - 0.005) < 1e-9
    costs = StepCosts(dict(CURVE))
    costs.observe_drafting(2.0, 1, 4)                   # the first measurement is taken as it is
    assert abs(costs.per_node - 0.5) < 1e-9
    costs.observe_drafting(0.0, 1, 4)
    assert abs(costs.per_node - 0.35) < 1e-9
    prior = StepCosts(dict(CURVE), draft_cost=0.4)
    prior.observe_pass(1, 2.0)
    assert abs(prior.node_seconds() - 0.4 * prior.pass_seconds(1)) < 1e-9   # a draft model's prior grows like a pass


def test_shadow_drafts_start_a_stateless_drafters_rows_drafting():
    """A lookup's row drafts its first proposal at once (the prior); once a verified draft missed, it
    runs plain and shadows are averaged over ~10 of them: where one shadow in ten has its first
    token right, a lucky one does not start drafting again; a run that comes true does."""
    curve = {1: 1.0, 2: 1.1, 4: 1.4, 8: 2.2}
    ctrl = controller(curve)
    row = ctrl.new_row(4)
    size = ctrl.plan([row], [1])[0]
    assert size > 0
    ctrl.observe([row], [size], [size], [[]], 1 + size, interpolate(curve, 1 + size), 0.0)   # wrong at once
    assert ctrl.plan([row], [1]) == [0]
    for _ in range(40):
        row.shadow = (3, [4, 5, 6, 7], None, 4)
        row.score_shadow([1, 2, 3, 9], finished=False)            # wrong at once
    row.shadow = (3, [4, 5, 6, 7], None, 4)
    assert row.score_shadow([1, 2, 3, 4, 9], finished=False)      # a lucky first token
    assert ctrl.plan([row], [1]) == [0]
    for _ in range(3):
        row.shadow = (3, [4, 5, 6, 7], None, 4)
        row.score_shadow([1, 2, 3, 4, 5, 6, 7], finished=False)   # the text starts to repeat itself
    assert ctrl.plan([row], [1]) == [4]
    row.shadow = (3, [4, 5], None, 2)
    assert not row.score_shadow([1, 2, 3, 4], finished=False)      # not decided yet
    assert row.score_shadow([1, 2, 3, 9], finished=False)          # a mismatch decides it


def test_a_tree_shadow_credits_each_size_with_the_path_nodes_it_holds():
    """A tree's first nodes are mostly siblings: a tree of s nodes can accept only the main path's
    nodes below s (a chain of s tokens: s)."""
    row, chain = RowSpec(8, AUTO, (0, 1, 2, 3, 4, 6, 8)), RowSpec(4, AUTO, (0, 1, 2, 3, 4))
    for _ in range(200):
        row.observe_shadow(8, 3, [0, 3, 6])             # the main path: nodes 0, 3, 6, all came true
        chain.observe_shadow(4, 3, None)
    assert {s: round(row.gain[s], 3) for s in (1, 2, 3, 4, 6, 8)} == {1: 2, 2: 2, 3: 2, 4: 3, 6: 3, 8: 4}
    assert {s: round(chain.gain[s], 3) for s in (1, 2, 3, 4)} == {1: 2, 2: 3, 3: 4, 4: 4}


def test_costly_shadows_come_every_few_steps():
    ctrl = controller()
    assert all(ctrl.shadow_due(1.0) for _ in range(5))
    ctrl.observe_shadows(4 * SHADOW_SHARE, 0.0, 1, 0)
    assert sum(ctrl.shadow_due(1.0) for _ in range(40)) == 10
    assert all(ctrl.shadow_due(1.0, young=True) for _ in range(5))     # a young row: every step


def test_a_costly_drafter_starts_small_and_a_hopeless_one_never_drafts():
    costly = controller(has_state=True, relative_cost=0.45)
    cheap = controller(has_state=True, relative_cost=0.01)
    assert costly.plan([costly.new_row(8)], [1]) == [1]
    assert cheap.plan([cheap.new_row(8)], [1])[0] >= 3
    hopeless = controller(has_state=True, relative_cost=0.9)          # a draft token at 0.9 of a step
    row = hopeless.new_row(8)
    assert all(hopeless.plan([row], [1]) == [0] for _ in range(300))


def test_probes_back_off_when_they_fail_and_resume_the_pace_when_one_pays():
    ctrl = controller(has_state=True, relative_cost=0.3)
    row = ctrl.new_row(4)
    sizes = [s[0] for s in run(ctrl, [row], 400, [0.0], node_cost=0.3)]
    probes = [i for i, s in enumerate(sizes) if s and i > 5]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes and gaps == sorted(gaps) and gaps[-1] > 2 * PROBE_EVERY     # the wait doubles
    sizes = [s[0] for s in run(ctrl, [row], 300, [1.0], node_cost=0.01)]
    assert sizes[-1] > 0                                 # a probe that paid: drafting again


def test_new_rows_of_a_drafter_with_state_start_from_the_last_long_row():
    ctrl = controller(has_state=True, relative_cost=0.05)
    first = ctrl.new_row(4)
    run(ctrl, [first], CARRY_MIN_STEPS + 5, [0.0], node_cost=0.05)
    ctrl.finish_row(first)
    second = ctrl.new_row(4)
    assert second.untried and second.gain[4] < 1.5            # another row's evidence: drafts did not pay
    assert ctrl.plan([second], [1]) == [0]


def test_a_large_batch_drafts_only_where_drafts_pay_for_the_rows_they_add():
    """At 16 rows a pass is near its compute bound (CURVE: each row ~a quarter of a one-row step):
    rows whose drafts are rarely accepted stay plain, a row that copies drafts."""
    ctrl = controller()
    rows = [ctrl.new_row(4, predicted=True) for _ in range(16)]
    accept = [0.1] * 15 + [1.0]
    sizes = run(ctrl, rows, 80, accept)
    assert all(s == 0 for s in sizes[-1][:15]) and sizes[-1][15] > 0
    lone = controller()
    row = lone.new_row(4, predicted=True)
    assert run(lone, [row], 60, [0.6])[-1][0] > 0            # alone, 60% acceptance pays


def test_on_rows_draft_k_every_step_off_rows_never_and_adaptive_off_is_on():
    ctrl = controller()
    rows = [ctrl.new_row(5, ON), ctrl.new_row(5, OFF), ctrl.new_row(0)]
    assert run(ctrl, rows, 10, [0.0, 0.0, 0.0])[-1] == [5, 0, 0]
    fixed = SpeculationController(caps(), StepCosts(dict(CURVE)), adaptive=False)
    assert fixed.new_row(3).mode == ON


def test_a_pinned_rows_sizes_depend_on_its_acceptance_only():
    """Seeded sampling with a drafter that samples: the same acceptance gives the same sizes whatever
    the steps measured and whatever else the batch holds."""
    def sizes_of(pass_scale, others):
        ctrl = controller(has_state=True, relative_cost=0.2)
        pinned = ctrl.new_row(4, pinned=True)
        rows = [pinned] + [ctrl.new_row(4) for _ in range(others)]
        rngs = [random.Random(7 + b) for b in range(len(rows))]
        out = []
        for _ in range(60):
            sizes = ctrl.plan(rows, [1] * len(rows))
            out.append(sizes[0])
            paths = [list(range(min(s, 2))) if rng.random() < 0.7 else [] for s, rng in zip(sizes, rngs)]
            pass_rows = len(rows) + sum(sizes)
            ctrl.observe(rows, sizes, sizes, paths, pass_rows, pass_scale * interpolate(CURVE, pass_rows), 0.1)
        return out
    assert sizes_of(1.0, 0) == sizes_of(7.0, 3)


def test_the_expected_tokens_of_a_chain():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_the_controller_does_not_import_torch():
    code = "import sys, specdecode.engine.controller; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_a_drafter_that_runs_passes_is_priced_per_pass_over_the_rows_drafting():
    """A draft model drafts a batch's rows in one pass per depth: 4 rows of 2 drafts cost 2 passes over
    4 rows (CURVE's shape: 1.3 one-row passes each), not 8 one-row passes; so a batch drafts where the
    same rows priced per node would not."""
    costs = StepCosts(dict(CURVE), draft_cost=0.5, passes=True)
    one = costs.node_seconds()
    assert abs(costs.step_seconds(12, 4, 8, [4, 4]) - (costs.pass_seconds(12) + 2 * 1.3 * one)) < 1e-9
    costs.observe_drafting(2 * 1.3 * 0.2, 4, 8, [4, 4])       # measured: a pass over one row costs 0.2
    assert abs(costs.per_node - (0.7 * 0.5 + 0.3 * 0.2)) < 1e-9       # moving toward it from the prior
    per_node = StepCosts(dict(CURVE), draft_cost=0.5)
    assert per_node.step_seconds(12, 4, 8, [4, 4]) > costs.step_seconds(12, 4, 8, [4, 4])
    flat = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.3, 32: 1.8, 64: 3.0}     # memory-bound passes (a GPU)
    ctrl = controller(flat, has_state=True, relative_cost=0.2)
    rows = [ctrl.new_row(2) for _ in range(4)]
    assert all(s > 0 for s in run(ctrl, rows, 40, [0.95] * 4, node_cost=0.2 * 1.05 / 4, curve=flat)[-1])
    steep = controller(has_state=True, relative_cost=0.2)                # CURVE: a row costs ~0.24 of a step
    rows = [steep.new_row(2) for _ in range(4)]
    assert all(s == 0 for s in run(steep, rows, 40, [0.95] * 4, node_cost=0.2)[-1])


def test_counted_acceptance_keeps_a_stateless_row_drafting_whatever_the_timings():
    """Evidence before timings: where the costs say every draft loses (a pass of two rows costing
    three plain ones: a busy host's measurement), a row whose drafts were accepted goes on drafting,
    a predicted output's row drafts from its first step, and a row whose drafts stop being accepted
    goes back to the timings (plain here)."""
    dear = {1: 1.0, 2: 3.0, 4: 6.0, 8: 12.0, 16: 24.0, 32: 48.0, 64: 96.0}
    ctrl = controller(dear)
    plain, predicted = ctrl.new_row(4), ctrl.new_row(4, predicted=True)
    assert ctrl.plan([plain], [1]) == [0] and ctrl.plan([predicted], [1]) == [4]
    predicted.observe(4, 4, [0, 1, 2, 3], chains=True)           # all accepted: counted evidence
    for _ in range(5):
        assert ctrl.plan([predicted], [1]) == [4]
        predicted.observe(4, 4, [0, 1], chains=True)             # half of them: still kept
    for _ in range(3):
        ctrl.plan([predicted], [1])
        predicted.observe(4, 4, [], chains=True)                 # none: the timings decide again
    assert predicted.kept == 0 and ctrl.plan([predicted], [1]) == [0]
    plain.observe_shadow(4, 4, None)                             # a shadow that came true is evidence too
    assert ctrl.plan([plain], [1]) == [4]


def test_counted_acceptance_does_not_outvote_a_drafter_with_measured_costs():
    """A drafter with state (a draft model) costs what its passes measure, not noise: its accepted
    drafts do not keep a row drafting where those costs lose (as in the test above with passes)."""
    ctrl = controller({1: 1.0, 2: 3.0, 4: 6.0, 8: 12.0}, has_state=True, relative_cost=2.0)
    row = ctrl.new_row(4, predicted=True)
    row.observe(4, 4, [0, 1, 2, 3], chains=True)
    assert row.kept == 4 and ctrl.plan([row], [1]) == [0]


def test_a_cost_curve_measured_under_load_goes_stale_and_is_measured_again():
    """Start-up measured while another process held the cores: every added row looks dear. Once
    the one-row passes run at half the curve's time, the curve is stale; measured again, the
    corrections learned against the old one start over."""
    costs = StepCosts({1: 2.0, 2: 6.0, 4: 12.0})
    for _ in range(3):
        costs.observe_pass(1, 1.9)                          # still loaded: not stale
    assert not costs.stale
    for _ in range(10):
        costs.observe_pass(1, 1.0)                          # quiet now
    assert costs.stale
    costs.remeasured({1: 1.0, 2: 1.05, 4: 1.2})
    assert not costs.stale and abs(costs.pass_seconds(4) - 1.2) < 1e-9
