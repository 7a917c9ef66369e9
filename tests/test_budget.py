"""The adaptive draft size (engine/budget.py): what smaller sizes would have emitted comes from
the accepted path, the cost curve decides, plain decoding wins when drafts do not pay, and the
next larger size is explored."""
from specdecode.engine.budget import DraftBudget
from specdecode.engine.costs import interpolate

CURVE = {1: 1.0, 2: 1.05, 4: 1.3, 8: 2.2, 16: 4.1}


def test_interpolate_and_extrapolate():
    assert interpolate(CURVE, 1) == 1.0
    assert abs(interpolate(CURVE, 3) - 1.175) < 1e-9
    assert abs(interpolate(CURVE, 20) - (4.1 + 1.9 * 4 / 8)) < 1e-9


def test_counterfactual_gains_of_smaller_sizes():
    budget = DraftBudget(16, CURVE, decay=0.0)
    # one sequence drafted 8 nodes, accepted the path 0 -> 3 -> 6: sizes below 4 keep only node 0
    budget.observe(8, [8], [[0, 3, 6]], verify_seconds=2.2, draft_seconds=0.0, pending=1)
    assert budget.gain[1] == 2 and budget.gain[2] == 2 and budget.gain[3] == 2
    assert budget.gain[4] == 3 and budget.gain[6] == 3 and budget.gain[8] == 4
    assert 12 not in budget.gain                       # never run: unknown
    assert budget.nodes[4] == 4 and budget.nodes[8] == 8


def test_plain_wins_when_drafts_are_rejected_and_larger_sizes_are_explored():
    budget = DraftBudget(16, CURVE, decay=0.5, explore_every=4, probe_every=6)
    sizes = []
    for _ in range(30):
        size = budget.next_size()
        sizes.append(size)
        nodes = min(size, 8)
        budget.observe(size, [nodes], [[]], verify_seconds=interpolate(CURVE, 1 + nodes), draft_seconds=0.0,
                       pending=1)
    assert budget.best() == 0
    assert sizes[-1] in (0, 1, 2, 3)                   # plain, or a probe of a small size
    assert sizes.count(0) > 20


def test_cheap_accurate_drafts_grow_the_size():
    budget = DraftBudget(16, CURVE, decay=0.5, explore_every=2)
    for _ in range(40):
        size = budget.next_size()
        path = list(range(size))                       # everything accepted
        budget.observe(size, [size], [path], verify_seconds=interpolate(CURVE, 1 + size), draft_seconds=0.0,
                       pending=1)
    assert budget.best() == 16


def test_a_drafter_that_proposes_nothing_gives_way_to_plain_decoding():
    """No match (no nodes) gains nothing and looking costs time: plain decoding (drafting must be
    predicted MARGIN faster); a stateless drafter's shadow drafts keep measuring it (next test)."""
    budget = DraftBudget(16, CURVE, decay=0.5)
    sizes = []
    for _ in range(10):
        size = budget.next_size()
        sizes.append(size)
        budget.observe(size, [0], [[]], verify_seconds=interpolate(CURVE, 1), draft_seconds=0.02 if size else 0.0,
                       pending=1)
    assert budget.best() == 0 and budget.draft_per_step > 0.0
    assert sum(1 for s in sizes if s) <= 2           # the prior of a size is taken at what it proposed: nothing


def test_short_lookups_do_not_reach_span_sizes():
    """A copying drafter (span 32) whose lookups propose 5 tokens that are never accepted: the sizes
    above 5 tie with 5 (or win on a lucky step) but are never chosen without a climb, so no step
    verifies a 32-token lookup on no evidence; and a size's prior follows what it proposed."""
    budget = DraftBudget(5, CURVE, decay=0.7, span=32, shadowed=True)
    chosen = []
    for step in range(200):
        size = budget.next_size()
        chosen.append(size)
        if size:
            accepted = [0] if step % 17 == 0 else []          # now and then one token
            budget.observe(size, [min(size, 5)], [accepted], verify_seconds=interpolate(CURVE, 1 + min(size, 5)),
                           draft_seconds=0.0, pending=1)
        else:
            budget.observe(0, [0], [[]], verify_seconds=interpolate(CURVE, 1), draft_seconds=0.0, pending=1)
            budget.observe_shadow(5, 1 if step % 17 == 0 else 0)
    assert max(chosen) <= 5, sorted(set(chosen))
    assert budget.nodes[32] <= 5.0 + 1e-9


def test_extra_rows_cost_what_the_steps_measure():
    """The start-up curve (an empty cache) is corrected by what steps measure: a one-row pass sets
    the base, passes with drafts what each further row adds."""
    budget = DraftBudget(8, CURVE, decay=0.5)
    for _ in range(12):
        budget.observe(0, [0], [[]], verify_seconds=2.0, draft_seconds=0.0, pending=1)         # 2x the curve
        budget.observe(4, [3], [[0]], verify_seconds=2.0 * (1 + 3 * (1.3 - 1.0)), draft_seconds=0.0, pending=1)
    assert abs(budget.scale - 2.0) < 0.01 and abs(budget.row_scale - 3.0) < 0.05
    assert abs(budget.pass_seconds(4) - 2.0 * 1.9) < 0.05


def test_shadow_drafts_bring_speculation_back():
    """While plain decoding runs, a stateless drafter's drafts scored against the emitted text
    raise the gain of the sizes they would have filled."""
    from types import SimpleNamespace

    from specdecode.drafters.base import DraftProposal
    from specdecode.engine.shadows import ShadowDrafts

    budget = DraftBudget(8, CURVE, decay=0.5)
    for _ in range(3):                                  # drafts rejected: plain decoding wins
        size = budget.next_size()
        budget.observe(size, [size], [[]], verify_seconds=interpolate(CURVE, 1 + size), draft_seconds=0.0,
                       pending=1)
    assert budget.best() == 0
    seq = SimpleNamespace(row=0, token_ids=[1, 2, 3], finished=False)
    drafter = SimpleNamespace(propose=lambda seqs, ks: DraftProposal.from_lists([[4, 5, 6, 7]]))
    shadows = ShadowDrafts()
    for _ in range(3):                                  # the text then continues exactly as drafted
        shadows.propose(drafter, [seq], 8)
        start = len(seq.token_ids)
        seq.token_ids += [4, 5, 6, 7]
        shadows.score([seq], budget)
        seq.token_ids = seq.token_ids[:start]
    assert budget.best() >= 4


def test_a_tree_shadow_credits_each_size_with_the_path_nodes_it_holds():
    """A tree's first nodes are mostly siblings: a tree of s nodes can accept only the main path's
    nodes below s. A shadow tree whose main path is nodes 0, 3, 6 and came true whole credits sizes
    1-3 with one token, 4-6 with two, 7+ with three (a chain of s tokens would have s)."""
    from types import SimpleNamespace

    from specdecode.drafters.base import DraftProposal
    from specdecode.engine.shadows import ShadowDrafts

    # root children 10, 11, 12 (nodes 0-2); children of node 0: 20, 21, 22 (3-5); of node 3: 30, 31 (6, 7)
    tree = [(10, -1), (11, -1), (12, -1), (20, 0), (21, 0), (22, 0), (30, 3), (31, 3)]
    proposal = DraftProposal.from_trees([tree])
    assert proposal.main_path_nodes(0) == [0, 3, 6] and proposal.main_path(0) == [10, 20, 30]
    budget = DraftBudget(8, CURVE, decay=0.0, shadow_decay=0.0)   # decay 0: the gains are the last observation
    seq = SimpleNamespace(row=0, token_ids=[1, 2, 3], finished=False)
    shadows = ShadowDrafts()
    shadows.propose(SimpleNamespace(propose=lambda seqs, ks: proposal), [seq], 8)
    seq.token_ids += [10, 20, 30, 40]
    shadows.score([seq], budget)
    assert {s: budget.gain[s] for s in (1, 2, 3, 4, 6, 8)} == {1: 2.0, 2: 2.0, 3: 2.0, 4: 3.0, 6: 3.0, 8: 4.0}
    chain = DraftBudget(8, CURVE, decay=0.0, shadow_decay=0.0)
    chain.observe_shadow(4, 3)                          # a chain: s tokens at size s
    assert {s: chain.gain[s] for s in (1, 2, 3, 4)} == {1: 2.0, 2: 3.0, 3: 4.0, 4: 4.0}


def test_a_costly_drafter_starts_small_and_its_draft_time_has_no_zero_prior():
    """A drafter with state starts at the size its prior cost predicts best (a draft token at 0.45
    of a step: size 1; nearly free: larger); without a prior, the first measured drafting time is
    taken as it is (not averaged with zero)."""
    costly = DraftBudget(8, CURVE, draft_cost=0.45)
    cheap = DraftBudget(8, CURVE, draft_cost=0.01)
    assert costly.next_size() == 1 and cheap.next_size() >= 3
    budget = DraftBudget(8, CURVE, decay=0.7)
    budget.observe(4, [4], [[0]], verify_seconds=1.3, draft_seconds=2.0, pending=1)
    assert abs(budget.draft_per_node - 0.5) < 1e-9
    budget.observe(4, [4], [[0]], verify_seconds=1.3, draft_seconds=0.0, pending=1)
    assert abs(budget.draft_per_node - 0.35) < 1e-9


def test_a_drafter_that_cannot_pay_even_when_always_right_never_drafts():
    """A draft token costing 0.9 of a step (the 135M model's layer-skip draft: 27 of 30 layers) loses
    to plain decoding at any acceptance: no starting size, no probes. One at 0.75 could pay only if
    nearly every draft were accepted (> 90%): plain, and no probes either (each would first feed the
    draft every token since its last draft). One at 0.6 would pay at 90%: it starts plain (the
    prior acceptance, 0.7, does not pay) and probes."""
    hopeless = DraftBudget(8, CURVE, probe_every=4, draft_cost=0.9)
    assert all(hopeless.next_size() == 0 for _ in range(50))
    unlikely = DraftBudget(8, CURVE, probe_every=4, draft_cost=0.75)
    assert all(unlikely.next_size() == 0 for _ in range(50))
    doubtful = DraftBudget(8, CURVE, probe_every=4, draft_cost=0.6)
    sizes = [doubtful.next_size() for _ in range(8)]
    assert sizes[0] == 0 and any(sizes)


def test_a_step_that_accepts_every_draft_tries_the_next_larger_size():
    budget = DraftBudget(8, CURVE, decay=0.5, explore_every=100, draft_cost=0.45)
    size = budget.next_size()
    assert size == 1
    budget.observe(size, [size], [list(range(size))], verify_seconds=1.05, draft_seconds=0.45, pending=1)
    assert budget.next_size() == 2                      # all accepted: climb now, not in 100 steps
    budget.observe(2, [2], [[0]], verify_seconds=1.175, draft_seconds=0.9, pending=1)
    assert budget.next_size() <= 2                      # a rejection: no climb


def test_a_costly_lookup_shadows_every_few_plain_steps():
    """Shadow drafts cost their lookup on every plain step: at most SHADOW_SHARE of a step's time."""
    from specdecode.engine.shadows import SHADOW_SHARE
    budget = DraftBudget(8, CURVE)
    assert all(budget.shadow_due() for _ in range(5))            # nothing measured yet: every step
    budget.observe_shadow_cost(0.5 * SHADOW_SHARE * interpolate(CURVE, 1))
    assert all(budget.shadow_due() for _ in range(5))            # cheap: every step
    budget.shadow_seconds = 4 * SHADOW_SHARE * interpolate(CURVE, 1)
    assert sum(budget.shadow_due() for _ in range(40)) == 10     # 4x the share: one step in four


def test_a_draft_models_prior_cost_grows_with_the_context_and_prior_gains_are_possible_ones():
    """Until its drafting is measured, a draft model's prior cost per token scales like the target's
    one-row pass (both read a longer context); the optimistic prior of a size's gain never exceeds
    what a step of that size can emit (size + 1), so a costly drafter is not kept on by its prior."""
    budget = DraftBudget(8, CURVE, decay=0.0, draft_cost=0.6)
    budget.observe(0, [0], [[]], verify_seconds=2.0, draft_seconds=0.0, pending=1)   # 2x the start-up curve
    assert abs(budget.scale - 2.0) < 1e-9 and abs(budget.node_seconds() - 1.2) < 1e-9
    costly = DraftBudget(8, CURVE, draft_cost=5.0)
    costly._update(2, 1.0, 2.0)
    assert costly.gain[2] <= 0.7 * 3.0 + 0.3 * 1.0 + 1e-9


def test_probes_that_fail_back_off_and_one_that_pays_restores_the_pace():
    """A drafter with state (a trained head, a draft model) pays for each probe: while probes keep
    failing the wait between them doubles (16, 32, 64, ... up to max_probe_every); a probe whose
    drafts are accepted makes drafting win and the pace goes back to probe_every."""
    budget = DraftBudget(8, CURVE, decay=0.5, probe_every=4, max_probe_every=16, draft_cost=0.05,
                         probe_share=1.0)                # (the floor of costly probes: the next test)
    probes = []
    for step in range(120):
        size = budget.next_size()
        if size:
            probes.append(step)
        budget.observe(size, [size], [[]], verify_seconds=interpolate(CURVE, 1 + size),
                       draft_seconds=0.05 * size, pending=1)
    gaps = [b - a for a, b in zip(probes[1:], probes[2:])]
    assert gaps[:3] == [4, 8, 16], probes               # doubling, capped at 16
    assert all(g == 16 for g in gaps[3:])
    assert budget.probe_interval == 16
    while budget.next_size() == 0:                     # the next probe is accepted whole
        budget.observe(0, [0], [[]], verify_seconds=1.0, draft_seconds=0.0, pending=1)
    size = budget.size
    budget.observe(size, [size], [list(range(size))], verify_seconds=interpolate(CURVE, 1 + size),
                   draft_seconds=0.05 * size, pending=1)
    budget.next_size()
    assert budget.best() > 0 and budget.probe_interval == 4


def test_costly_probes_come_no_more_often_than_their_share_allows():
    """A probe that costs 1.5 plain steps more than the plain step it replaces (a head's catch-up
    on the tokens since its last draft) is spaced so that failed probes take at most probe_share
    of plain decoding's time: 1.5 / 0.01 = 150 steps, in this call and across calls (carried)."""
    budget = DraftBudget(8, CURVE, decay=0.5, probe_every=4, max_probe_every=16, draft_cost=0.05)
    probes = []
    for step in range(800):
        size = budget.next_size()
        if size:
            probes.append(step)
            budget.observe(size, [size], [[]], verify_seconds=interpolate(CURVE, 1), draft_seconds=1.5, pending=1)
        else:
            budget.observe(0, [0], [[]], verify_seconds=interpolate(CURVE, 1), draft_seconds=0.0, pending=1)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps and all(g == 150 for g in gaps[1:]), probes
    later = DraftBudget(8, CURVE, decay=0.5, probe_every=4, max_probe_every=16, draft_cost=0.05)
    later.carry(budget)                                  # the wait goes on across calls
    sizes = [later.next_size() for _ in range(160)]
    assert (800 - probes[-1] - 1) + sizes.index(next(s for s in sizes if s)) + 1 == 150


def test_a_probe_is_priced_net_of_the_tokens_its_accepted_drafts_emit():
    """A probe costs what it takes over the plain steps that would have emitted its tokens: one whose
    drafts are accepted costs less than its time, or nothing, and the floor between probes follows
    (a draft model right ~60% of the time, in a stretch where plain decoding won on noise, was probed
    once per ~70 steps, each probe priced at 0.75 of a step over one plain step)."""
    def first_probe(accepted: int) -> DraftBudget:
        budget = DraftBudget(8, CURVE, decay=0.5, probe_every=4, draft_cost=0.05)
        while (size := budget.next_size()) == 0 or not budget.probed:    # the starting size fails, then plain
            budget.observe(size, [size], [[]], verify_seconds=interpolate(CURVE, 1 + size),
                           draft_seconds=0.1 * size, pending=1)
        # the probe: 2 drafts for 0.8 s, verified in a 3-row pass (1.175 s); plain steps take 1.0 s
        budget.observe(size, [2], [list(range(accepted))], verify_seconds=interpolate(CURVE, 3),
                       draft_seconds=0.8, pending=1)
        return budget
    missed = first_probe(0)                     # 1.975 s for 1 token: 0.975 over one plain step
    assert abs(missed.probe_seconds - 0.975) < 1e-9 and missed.probe_floor() == 98      # 0.975 / 1%
    half = first_probe(1)                       # 2 tokens: 2 plain steps' time less 0.025
    assert abs(half.probe_seconds + 0.025) < 1e-9 and half.probe_floor() == 0
    assert first_probe(2).probe_seconds < half.probe_seconds < missed.probe_seconds


def test_the_first_probe_after_a_failed_start_waits_for_what_a_probe_is_predicted_to_cost():
    """A drafter that pays to try and whose starting size fails: its first probe comes no sooner
    than a probe's predicted cost (its size's step over a plain one, plus a catch-up node) allows
    at probe_share, not after probe_every plain steps."""
    budget = DraftBudget(8, CURVE, decay=0.5, probe_every=4, draft_cost=0.1)
    sizes = []
    for _ in range(400):
        size = budget.next_size()
        sizes.append(size)
        budget.observe(size, [size], [[]], verify_seconds=interpolate(CURVE, 1 + size),
                       draft_seconds=0.1 * size, pending=1)
    start = next(i for i, s in enumerate(sizes) if s == 0)                  # the start stopped paying here
    first_probe = next(i for i, s in enumerate(sizes) if i > start and s)
    # size 2's step over plain (0.175 of the curve, two nodes) and a catch-up node, at ~0.08 s a node
    # measured: ~0.42 s; failed probes at most 1% of plain decoding: one per ~42 plain steps
    assert 38 <= first_probe - start + 1 <= 48, sizes[:60]


def test_a_later_call_starts_from_what_the_earlier_one_measured():
    """A drafter that did not pay in an earlier call starts plain in the next one (no starting
    size; its probes' pace goes on); one that paid starts drafting (the first step at most a
    probe's size, then its best); a budget
    with nothing measured, of another kind (shadowed or not), or of a short first call (fewer than
    CARRY_MIN_STEPS steps: a warm-up) passes nothing on; any later call does."""
    poor = DraftBudget(8, CURVE, decay=0.5, probe_every=4, draft_cost=0.05, probe_share=1.0)
    for _ in range(60):
        size = poor.next_size()
        poor.observe(size, [size], [[]], verify_seconds=interpolate(CURVE, 1 + size),
                     draft_seconds=0.05 * size, pending=1)
    assert poor.best() == 0 and poor.probe_interval > 4
    later = DraftBudget(8, CURVE, decay=0.5, probe_every=4, draft_cost=0.05, probe_share=1.0)
    assert later.size > 0                                   # the prior: start drafting
    later.carry(poor)
    assert later.probe_interval == poor.probe_interval and later.draft_measured
    # probes kept failing (the interval doubled past 2 * probe_every): the wait runs on from where the
    # earlier call left it, at most the probes' cost floor (here 2 * probe_every: probe_share 1)
    wait = min(poor.probe_wait, max(8, later.probe_floor()))
    assert later.probe_wait == wait
    sizes = [later.next_size() for _ in range(9)]
    first = sizes.index(next(s for s in sizes if s))         # plain until then
    assert first == max(wait, 1) - 1 and not any(sizes[:first])

    good = DraftBudget(8, CURVE, decay=0.5, explore_every=2)
    for _ in range(40):
        size = good.next_size()
        good.observe(size, [size], [list(range(size))], verify_seconds=interpolate(CURVE, 1 + size),
                     draft_seconds=0.0, pending=1)
    fresh = DraftBudget(8, CURVE)
    fresh.carry(good)
    # its drafts risk at most a probe's size (the sizes carried are another request's evidence) until one
    # of this request's is accepted; then the carried best
    assert good.best() == 8 and fresh.next_size() == fresh.probe_size() == 2
    fresh.observe(2, [2], [[]], verify_seconds=interpolate(CURVE, 3), draft_seconds=0.0, pending=1)
    assert fresh.next_size() <= 2 and fresh.untried     # rejected: still capped (here: plain)
    accepted = DraftBudget(8, CURVE)
    accepted.carry(good)
    assert accepted.next_size() == 2
    accepted.observe(2, [2], [[0]], verify_seconds=interpolate(CURVE, 3), draft_seconds=0.0, pending=1)
    assert accepted.next_size() == 8 and not accepted.untried
    untouched = DraftBudget(8, CURVE, decay=0.5, probe_every=4, draft_cost=0.05)
    untouched.carry(DraftBudget(8, CURVE))                  # nothing measured
    untouched.carry(DraftBudget(8, CURVE, shadowed=True))
    short = DraftBudget(8, CURVE, decay=0.5, probe_every=4, draft_cost=0.05)     # a warm-up: 8 steps, whose
    for _ in range(8):                                                          # times hold one-time costs
        size = short.next_size()
        short.observe(size, [size], [[]], verify_seconds=5.0, draft_seconds=5.0 * size, pending=1)
    untouched.carry(short)
    assert untouched.gain == {0: 1.0} and untouched.size > 0 and not untouched.seasoned
    second = DraftBudget(8, CURVE, decay=0.5, probe_every=4, draft_cost=0.05)   # the warm-up's next call: short
    second.carry(short)
    for _ in range(8):
        size = second.next_size()
        second.observe(size, [size], [[]], verify_seconds=interpolate(CURVE, 1 + size), draft_seconds=0.05 * size,
                       pending=1)
    third = DraftBudget(8, CURVE, decay=0.5, probe_every=4, draft_cost=0.05)
    third.carry(second)                                     # past the first call: carried, short or not
    assert third.seasoned and third.calls == 2 and third.gain == second.gain


def test_a_short_call_after_a_long_one_passes_on_what_it_was_given():
    """A call of fewer than CARRY_MIN_STEPS steps that started from a long call's budget is past the
    process's one-time costs (`seasoned`): the call after it starts from it, not from the priors
    (a head that did not pay started every call after a short answer at its prior size, and
    explored 1-4 drafts per step for 8-10 steps: 0.87-0.95x on a 36-token code answer)."""
    poor = DraftBudget(8, CURVE, decay=0.5, probe_every=4, draft_cost=0.05, probe_share=1.0)
    for _ in range(60):
        size = poor.next_size()
        poor.observe(size, [size], [[]], verify_seconds=interpolate(CURVE, 1 + size),
                     draft_seconds=0.05 * size, pending=1)
    chain = poor
    for _ in range(3):                                       # short answers, one after the other
        short = DraftBudget(8, CURVE, decay=0.5, probe_every=4, draft_cost=0.05, probe_share=1.0)
        short.carry(chain)
        assert short.seasoned and short.size == 0            # plain from the start
        for _ in range(6):
            size = short.next_size()
            short.observe(size, [size], [[]], verify_seconds=interpolate(CURVE, 1 + size),
                          draft_seconds=0.05 * size, pending=1)
        chain = short
    fresh = DraftBudget(8, CURVE, decay=0.5, probe_every=4, draft_cost=0.05, probe_share=1.0)
    assert fresh.size > 0 and not fresh.seasoned            # the priors: start drafting


def test_a_carried_gain_is_weak_evidence_about_the_new_request():
    """A carried gain weighs CARRIED_WEIGHT against the new call's first step at that size (another
    request's acceptance), the later steps the usual decay."""
    from specdecode.engine.budget import CARRIED_WEIGHT
    earlier = DraftBudget(8, CURVE, decay=0.5, explore_every=2, draft_cost=0.05)
    for _ in range(40):                                     # long drafts, all accepted
        size = earlier.next_size()
        earlier.observe(size, [size], [list(range(size))], verify_seconds=interpolate(CURVE, 1 + size),
                        draft_seconds=0.001 * size, pending=1)
    assert earlier.best() > 0
    later = DraftBudget(8, CURVE, decay=0.5, draft_cost=0.05)
    later.carry(earlier)
    size = later.next_size()
    carried = later.gain[size]
    for expected in (CARRIED_WEIGHT * carried + (1 - CARRIED_WEIGHT), None):
        before = later.gain[size]
        later.observe(size, [size], [[]], verify_seconds=interpolate(CURVE, 1 + size), draft_seconds=0.05 * size,
                      pending=1)                            # this request's drafts: all rejected
        expected = expected if expected is not None else 0.5 * before + 0.5
        assert abs(later.gain[size] - expected) < 1e-9


def test_a_step_that_drafts_fewer_than_its_size_allows_tells_every_larger_size_known():
    """A step whose rows proposed fewer nodes than the size allowed (a short lookup match, a chain
    stopped where the draft was unsure): every larger size would have drafted the same, so the
    larger sizes already known learn from it; sizes never seen are not created by it."""
    budget = DraftBudget(8, CURVE, decay=0.5, explore_every=2)
    for _ in range(40):                                     # long drafts, all accepted: sizes up to 8 known
        size = budget.next_size()
        budget.observe(size, [size], [list(range(size))], verify_seconds=interpolate(CURVE, 1 + size),
                       draft_seconds=0.0, pending=1)
    assert budget.gain[8] > 8.0
    known = set(budget.gain)
    budget.observe(4, [1], [[]], verify_seconds=interpolate(CURVE, 2), draft_seconds=0.0, pending=1)
    assert budget.gain[8] < 5.0 and abs(budget.nodes[8] - (0.5 * 8 + 0.5 * 1)) < 1e-9   # one node, rejected
    assert set(budget.gain) == known
    full = DraftBudget(8, CURVE, decay=0.5, explore_every=2)
    full.gain, full.nodes = dict(budget.gain), dict(budget.nodes)
    before = full.gain[8]
    full.observe(4, [4], [[]], verify_seconds=interpolate(CURVE, 5), draft_seconds=0.0, pending=1)
    assert full.gain[8] == before                            # four of four allowed: larger sizes unknown


def test_a_probe_after_plain_steps_counts_its_catch_up_as_one_node():
    """A drafter with state drafting after plain steps first reads the tokens since (one batched
    pass): that time is one more node, so a probe after a long wait does not make every later
    node look dear (could_pay would then rule out probes for good)."""
    budget = DraftBudget(8, CURVE, decay=0.0, draft_cost=0.05)
    budget.observe(0, [0], [[]], verify_seconds=1.0, draft_seconds=0.0, pending=1)
    budget.observe(2, [2], [[]], verify_seconds=1.05, draft_seconds=0.15, pending=1)   # catch-up + 2 nodes
    assert abs(budget.node_seconds() - 0.05) < 1e-9
    budget.observe(2, [2], [[]], verify_seconds=1.05, draft_seconds=0.1, pending=1)    # right after: 2 nodes
    assert abs(budget.node_seconds() - 0.05) < 1e-9


def test_one_lucky_shadow_does_not_start_drafting_but_a_run_of_them_does():
    """Shadows cost nothing, so their evidence is averaged over ~10 (SHADOW_DECAY): where one
    shadow in ten has its first token right (size 1 buys 0.1 token a step for 0.1 of a step's
    cost, less than MARGIN asks), a lucky one does not make size 1 win (with a real step's 0.7 it
    did, and the steps it started accepted nothing); a run of shadows that come true does."""
    curve = {1: 1.0, 2: 1.1, 4: 1.4, 8: 2.2}
    budget = DraftBudget(4, curve, shadowed=True)
    for step in range(40):                               # every shadow wrong: plain decoding
        budget.observe_shadow(4, 0)
    assert budget.best() == 0
    budget.observe_shadow(4, 1)                          # a lucky first token
    assert budget.best() == 0
    old = DraftBudget(4, curve, shadowed=True, shadow_decay=0.7)
    for step in range(40):
        old.observe_shadow(4, 0)
    old.observe_shadow(4, 1)
    assert old.best() > 0                                # what a real step's average did with it
    for step in range(3):                                # the text starts to repeat itself
        budget.observe_shadow(4, 4)
    assert budget.best() == 4


def test_a_run_of_plain_steps_recomputes_the_choice_only_now_and_then():
    """While plain decoding wins and only the pass-time scale moves, best() runs every
    PLAIN_RECHECK steps (it cost ~20 us of a 2.9 ms step); any gain observed recomputes it at once."""
    from specdecode.engine.budget import PLAIN_RECHECK
    budget = DraftBudget(8, CURVE, decay=0.5, probe_every=10**6, max_probe_every=10**6, draft_cost=0.05)
    for _ in range(20):                                     # drafts never accepted: plain wins
        size = budget.next_size()
        budget.observe(size, [size], [[]], verify_seconds=interpolate(CURVE, 1 + size),
                       draft_seconds=0.05 * size, pending=1)
    assert budget.best() == 0 and budget.last_size == 0
    calls, original = [], budget.best
    budget.best = lambda: calls.append(1) or original()
    for _ in range(4 * PLAIN_RECHECK):
        assert budget.next_size() == 0
        budget.observe(0, [0], [[]], verify_seconds=interpolate(CURVE, 1.0), draft_seconds=0.0, pending=1)
    assert 3 <= len(calls) <= 5
    budget.observe_shadow(4, 4)                              # news of a size: recomputed at the next step
    calls.clear()
    budget.next_size()
    assert calls == [1]


def test_a_low_prior_acceptance_starts_smaller_or_plain():
    """The starting size follows the prior acceptance (a trained head's, from its held-out evaluation):
    where drafts accepted that often would not pay at the known drafting cost, the budget starts plain."""
    default = DraftBudget(8, CURVE, draft_cost=0.004)
    low = DraftBudget(8, CURVE, draft_cost=0.004, prior_acceptance=0.25)
    assert default.size > 0
    assert low.size < default.size
    assert DraftBudget(8, CURVE, draft_cost=0.02, prior_acceptance=0.1).size == 0


def test_the_cost_curve_is_measured_in_rounds_and_never_falls_with_more_rows(monkeypatch):
    """measure_cost_curve times every size once per round (a busy moment slows one pass of each size,
    not every pass of one) and keeps the fastest; a pass over more rows is never taken to cost less
    than one over fewer. A fake model on a fake clock: 1 ms + 0.1 ms a row, and a busy spell (+5 ms)
    over two passes in a row; the 8-row pass measures fast (0.9 ms: noise)."""
    import torch

    from specdecode.engine import costs
    clock = [0.0]
    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])

    class Model:
        device = torch.device("cpu")
        passes = 0

        def run(self, fb, cache):
            rows = fb.tokens.shape[1]
            self.passes += 1
            busy = 5e-3 if 8 <= self.passes <= 9 else 0.0   # two passes in a row (sizes timed one after
                                                                # the other, after 5 warm-ups: the 2-row pass's)
            clock[0] += (0.9e-3 if rows == 8 else 1e-3 + 1e-4 * rows) + busy
            return None

        def logits(self, hidden, index):
            return None

    class Cache:
        def truncate(self, row, length):
            pass

    curve = costs.measure_cost_curve(Model(), Cache(), 9, repeats=2)
    assert list(curve) == [1, 2, 4, 8, 9]
    want = {1: 1.1e-3, 2: 1.2e-3, 4: 1.4e-3, 8: 1.4e-3, 9: 1.9e-3}    # 8 rows: no less than 4
    assert all(abs(curve[r] - want[r]) < 1e-12 for r in want), curve


def test_rows_a_flat_start_up_curve_prices_at_nothing_learn_their_cost_from_the_steps():
    """A start-up curve measured flat (a busy moment, or a host where rows really are nearly free)
    says a draft's rows cost nothing; where they do cost (here 0.2 of a one-row pass each), the steps
    that draft teach what each adds (`row_floor`), instead of being taken for one-row passes that make
    every step dearer alike: drafts right a third of the time were then verified at every one of these
    300 steps, 1-6 nodes each). Where rows really cost nothing, nothing is added."""
    flat = {1: 1.0, 2: 1.0, 4: 1.01, 8: 1.01}

    def run(row_cost: float) -> tuple[DraftBudget, int]:
        budget = DraftBudget(8, flat, decay=0.7)
        drafted = 0
        for step in range(300):
            size = budget.next_size()
            drafted += size > 0
            path = [0] if size and step % 3 == 0 else []          # the first draft right a third of the time
            budget.observe(size, [size], [path], verify_seconds=1.0 + row_cost * size, draft_seconds=0.0,
                           pending=1)
        return budget, drafted

    costly, drafted = run(0.2)
    assert abs(costly.row_floor - 0.2) < 0.02 and abs(costly.pass_seconds(5) - 1.8) < 0.1
    assert abs(costly.step_seconds(0) - 1.0) < 0.02                  # plain steps keep their own cost
    assert drafted <= 80, drafted                                     # probes (taken for one-row passes: all 300)
    free, _ = run(0.0)
    assert abs(free.row_floor) < 1e-9 and abs(free.pass_seconds(5) - free.pass_seconds(1) - 0.01 * free.scale) < 0.02


def test_one_descheduled_step_moves_the_costs_a_bounded_step():
    """A step descheduled on a busy core (100x its time) counts as SPIKE times the estimate it
    updates: the pass-time scale, the drafting cost per node, the cost of a shadow. A lasting
    change is followed all the same, within a few steps."""
    from specdecode.engine.costs import SPIKE
    budget = DraftBudget(8, CURVE, decay=0.7)
    budget.observe(0, [0], [[]], verify_seconds=100.0, draft_seconds=0.0, pending=1)
    assert abs(budget.scale - (0.7 + 0.3 * SPIKE)) < 1e-9
    for _ in range(12):
        budget.observe(0, [0], [[]], verify_seconds=1.0, draft_seconds=0.0, pending=1)
    assert abs(budget.scale - 1.0) < 0.05
    budget.observe(4, [4], [[0, 1, 2, 3]], verify_seconds=1.3, draft_seconds=0.04, pending=1)
    budget.observe(4, [4], [[0, 1, 2, 3]], verify_seconds=1.3, draft_seconds=4.0, pending=1)   # 100x
    assert abs(budget.draft_per_node - 0.01 * (0.7 + 0.3 * SPIKE)) < 1e-9
    for _ in range(10):                           # the machine is now 2x slower for good
        budget.observe(0, [0], [[]], verify_seconds=2.0, draft_seconds=0.0, pending=1)
    assert abs(budget.scale - 2.0) < 0.1
    budget.observe_shadow_cost(0.001)
    budget.observe_shadow_cost(0.1)
    assert abs(budget.shadow_seconds - 0.001 * (0.7 + 0.3 * SPIKE)) < 1e-9


def test_shadow_drafts_measure_the_drafting_cost_while_plain_decoding_runs():
    """A lookup whose first drafting steps were slow (descheduled) is priced from its shadows'
    drafting time while plain decoding runs, and drafts again: one slow start used to set the
    cost per node for good, since no other step drafted (an exact Predicted Output stayed plain
    for 30 steps of a 60-token answer)."""
    budget = DraftBudget(8, CURVE, decay=0.7, shadowed=True)
    size = budget.next_size()                     # every draft accepted, but drafting took 4 steps
    assert size > 0
    budget.observe(size, [size], [list(range(size))], verify_seconds=interpolate(CURVE, 1 + size),
                   draft_seconds=4.0, pending=1)
    assert budget.next_size() == 0
    budget.observe(0, [0], [[]], verify_seconds=1.0, draft_seconds=0.0, pending=1)
    sizes = []
    for _ in range(24):                           # shadows of 8 nodes, drafted in 0.02 of a step, all come true
        budget.observe_shadow(8, 8)
        budget.observe_shadow_cost(0.03, draft_seconds=0.02, rows=1, nodes=8)
        size = budget.next_size()
        sizes.append(size)
        budget.observe(size, [size], [list(range(size))], verify_seconds=interpolate(CURVE, 1 + size),
                       draft_seconds=0.0025 * size, pending=1)
    assert sizes[-1] >= 4 and sizes.index(next(s for s in sizes if s > 0)) < 12


def test_a_chain_rejected_inside_its_draft_tells_every_larger_size():
    """A chain drafter's larger draft has the smaller one as a prefix: a step whose chain was
    rejected inside it would have emitted the same tokens at every larger size, drafting more.
    A new request whose first probe (2 drafts, the first accepted) says so does not go on to the
    large sizes another request paid at (the pair's translation after a summary: 2, then 5, 4,
    5 drafts, 2 of 9 accepted, 0.85x plain); a probe accepted whole does, as does a tree drafter's
    (a larger tree holds other branches)."""
    good = DraftBudget(8, CURVE, decay=0.5, explore_every=2, chains=True)
    for _ in range(40):
        size = good.next_size()
        good.observe(size, [size], [list(range(size))], verify_seconds=interpolate(CURVE, 1 + size),
                     draft_seconds=0.0, pending=1)
    assert good.best() == 8
    for path, chains, most in (([0], True, 2), ([0, 1], True, 8), ([0], False, 8)):
        later = DraftBudget(8, CURVE, chains=chains)
        later.carry(good)
        assert later.next_size() == 2
        later.observe(2, [2], [path], verify_seconds=interpolate(CURVE, 3), draft_seconds=0.0, pending=1)
        assert later.gain[8] < 3 if most == 2 else later.gain[8] > 5
        assert (later.next_size() <= most) if most == 2 else (later.next_size() == 8)


def test_a_lookup_without_a_prediction_starts_plain_and_its_shadows_start_drafting():
    """A shadowed drafter's first step drafts nothing unless asked to open (a prediction: news of
    the answer); its shadows then choose the size (4 rows rejected at the first step of nearly every
    chat answer cost ~0.3 of a step)."""
    opening = DraftBudget(8, CURVE, shadowed=True)
    assert opening.next_size() > 0
    budget = DraftBudget(8, CURVE, shadowed=True, opens=False)
    sizes = []
    for step in range(12):
        size = budget.next_size()
        sizes.append(size)
        budget.observe(size, [size], [list(range(size))], verify_seconds=interpolate(CURVE, 1 + size),
                       draft_seconds=0.0, pending=1)
        if size == 0:                     # a shadow of 8 tokens, all of which came true
            budget.observe_shadow(8, 8)
    assert sizes[0] == 0 and sizes[-1] >= 4
