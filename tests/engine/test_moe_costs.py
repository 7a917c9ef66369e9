"""What a mixture-of-experts pass costs (engine/costs.py: ExpertCosts, measure_pass_costs) and how the
controller plans with it, on fake costs and a fake clock (no timings); the tiny random Qwen3-MoE end to
end (slow)."""
import random
from types import SimpleNamespace

import pytest
from conftest import make_qwen3_moe

from specdecode.engine import costs as costs_module
from specdecode.engine.controller import AUTO, SpeculationController, expected_tokens
from specdecode.engine.costs import ExpertCosts, StepCosts, measure_pass_costs

DENSE = {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4, 16: 2.0}    # rows of one token: a one-row pass's experts
USED, EXPERTS = 8, 128


def random_union(rows: float) -> float:
    """Distinct experts of `rows` rows routed at random, k of E each (the worst case)."""
    return EXPERTS * (1 - (1 - USED / EXPERTS) ** rows)


def moe_costs(per_expert: float = 0.08, spread: float = 1.0) -> StepCosts:
    """The 8-layer Qwen3-30B-A3B shape's pass against its rows (RESULTS.md): 2 rows ~1.65 steps, 8 ~4.9."""
    costs = StepCosts(dict(DENSE))
    costs.price_experts(ExpertCosts(USED, EXPERTS, per_expert, {r: random_union(r) for r in DENSE}, spread))
    return costs


def test_a_pass_costs_its_rows_and_the_experts_they_add():
    costs = moe_costs(per_expert=0.01)
    assert costs.moe.added(1) == 0.0 and costs.pass_seconds(1) == pytest.approx(1.0)
    for rows in (2, 4, 8):
        experts = random_union(rows) - USED
        assert costs.pass_seconds(rows) == pytest.approx(costs.curve[rows] + 0.01 * experts)
        assert costs.pass_shape(rows) == pytest.approx(costs.curve[rows] + 0.01 * experts)
    assert costs.moe.distinct(1000) == EXPERTS                      # never more than the layer has
    dense = StepCosts(dict(DENSE))
    assert dense.pass_seconds(8) == pytest.approx(DENSE[8]) and dense.pass_shape(8) == pytest.approx(DENSE[8])


def test_correlated_routing_teaches_a_smaller_union_and_cheaper_rows():
    costs = moe_costs(per_expert=0.01)
    before = costs.pass_seconds(4)
    for _ in range(30):                                              # real rows: half the random union's growth
        union = USED + 0.5 * (random_union(4) - USED)
        costs.observe_pass(4, DENSE[4] + 0.01 * (union - USED), experts=union)
    assert costs.moe.spread == pytest.approx(0.5, abs=0.02)
    assert costs.moe.distinct(4) == pytest.approx(USED + 0.5 * (random_union(4) - USED), rel=0.02)
    assert costs.pass_seconds(4) < before
    assert costs.row_scale == pytest.approx(1.0, abs=0.02)           # the experts' seconds are not the rows'
    assert costs.moe.passes == 30 and costs.moe.rows_seen == 120


def test_measured_again_the_expert_costs_keep_what_the_passes_taught():
    costs = moe_costs(per_expert=0.01)
    costs.observe_pass(2, 2.0, experts=USED + 0.2 * (random_union(2) - USED))
    spread, passes = costs.moe.spread, costs.moe.passes
    costs.price_experts(ExpertCosts(USED, EXPERTS, 0.02, {1: USED, 2: random_union(2)}))
    assert costs.moe.seconds == 0.02 and costs.moe.spread == spread and costs.moe.passes == passes


def test_the_expert_cost_is_what_distinct_rows_add_over_rows_of_one_token(monkeypatch):
    """measure_pass_costs on a fake model and clock: a pass costs 1 + 0.1 per row past the first +
    0.03 per distinct expert past a one-row pass's; rows of one token route alike, distinct rows apart."""
    torch = pytest.importorskip("torch")
    clock = [0.0]
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: clock[0])
    seen = {}

    class Model:
        device, vocab_size = torch.device("cpu"), 1000

        def run(self, fb, cache):
            tokens = fb.tokens[0].tolist()
            union = USED if len(set(tokens)) == 1 else min(USED * len(tokens), EXPERTS)
            seen["union"] = union
            clock[0] += 1.0 + 0.1 * (len(tokens) - 1) + 0.03 * (union - USED)
            return None

        def logits(self, hidden, index):
            return None

    cache = SimpleNamespace(truncate=lambda row, n: None)
    counter = SimpleNamespace(used=USED, experts=EXPERTS, share=0.0, read=lambda: float(seen["union"]))
    curve, moe = measure_pass_costs(Model(), cache, 0, [1, 2, 4, 8], repeats=2, counter=counter)
    assert curve == pytest.approx({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7})
    assert moe.seconds == pytest.approx(0.03) and moe.used == USED
    assert moe.union == {1: USED, 2: 2 * USED, 4: 4 * USED, 8: 8 * USED}
    plain, none = measure_pass_costs(Model(), cache, 0, [1, 2], repeats=1)
    assert none is None and plain == pytest.approx({1: 1.0, 2: 1.1})
    counter.share = 0.05                                              # one expert more: 5% of the bytes a step reads
    _, moe = measure_pass_costs(Model(), cache, 0, [1, 2, 4], repeats=1, counter=counter)
    assert moe.seconds == pytest.approx(0.05)


def test_a_measurement_that_shows_no_expert_cost_still_prices_the_bytes_they_read(monkeypatch):
    """A pass another process delayed can hide what distinct rows add: each expert then costs at least
    its share of the weights a one-row pass reads."""
    torch = pytest.importorskip("torch")
    clock = [0.0]
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: clock[0])
    seen = {}

    class Model:                                   # distinct rows read 8x the experts and take no longer
        device, vocab_size = torch.device("cpu"), 1000

        def run(self, fb, cache):
            tokens = fb.tokens[0].tolist()
            seen["union"] = USED if len(set(tokens)) == 1 else min(USED * len(tokens), EXPERTS)
            clock[0] += 2.0 + 0.1 * (len(tokens) - 1)
            return None

        def logits(self, hidden, index):
            return None

    counter = SimpleNamespace(used=USED, experts=EXPERTS, share=0.04, read=lambda: float(seen["union"]))
    _, moe = measure_pass_costs(Model(), SimpleNamespace(truncate=lambda row, n: None), 0, [1, 2, 4], 1, counter)
    assert moe.seconds == pytest.approx(2.0 * 0.04)


def lookups(costs: StepCosts, accept: float, seed: int, truth: StepCosts | None = None, steps: int = 300, k: int = 4
            ) -> float:
    """A stateless drafter's greedy row (lookups) whose drafts are each accepted with probability `accept`,
    driven as the engine drives it (shadows while plain), planned with `costs`, its passes costing what
    `truth` says (default: `costs`). Returns its speed against plain decoding's."""
    truth = truth or costs
    rng = random.Random(seed)
    ctrl = SpeculationController(SimpleNamespace(has_state=False, drafts_trees=False, relative_cost=0.0,
                                                 prior_acceptance=None, copies=True), costs)
    row = ctrl.new_row(k)
    tokens = seconds = 0.0
    for _ in range(steps):
        (size,) = ctrl.plan([row], [1])
        if size == 0 and ctrl.shadow_due(1.0, True):
            matched = next((i for i in range(k) if rng.random() >= accept), k)
            row.observe_shadow(k, matched, None)
        a = next((i for i in range(size) if rng.random() >= accept), size)
        step = truth.pass_seconds(1 + size)
        ctrl.observe([row], [size], [size], [list(range(a))], 1 + size, step, 0.0,
                     experts=truth.moe.distinct(1 + size) if truth.moe is not None else None)
        tokens += a + 1
        seconds += step
    return tokens / seconds / (steps / (steps * truth.pass_seconds(1)))


def mean_speed(accept: float, costs=None, truth=None) -> float:
    """`lookups`' speed against plain decoding, the mean over five seeds (the shadows' luck)."""
    return sum(lookups(costs() if costs else moe_costs(), accept, seed, truth) for seed in range(5)) / 5


@pytest.mark.parametrize("accept", [0.3, 0.55, 0.65, 0.75])
def test_lookups_accepted_half_the_time_never_run_slower_than_plain_on_moe(accept):
    """Half the drafts accepted keeps a dense row drafting (RowSpec.kept) and wins there; on MoE, where
    each row brings ~7 experts of its own (a pass of 5 rows ~3.4 steps), the same drafts stay plain
    unless they pay. Priced as before (the curve of rows of one token, no experts), they lose."""
    assert mean_speed(accept) >= 0.97
    if accept >= 0.55:
        assert mean_speed(accept, costs=lambda: StepCosts(dict(DENSE))) > 1.05     # the dense model wins with them
    if 0.55 <= accept <= 0.65:
        assert mean_speed(accept, costs=lambda: StepCosts(dict(DENSE)), truth=moe_costs()) < 0.95


@pytest.mark.parametrize("accept", [0.9, 0.97])
def test_well_accepted_lookups_still_pay_on_moe(accept):
    assert mean_speed(accept) > 1.1


def kept_row(ctrl: SpeculationController, accept: float):
    """A row of 4 lookups whose measured steps accepted each draft with probability `accept`."""
    row = ctrl.new_row(4)
    row.carried.clear()
    for s in row.levels[1:]:
        row.gain[s], row.nodes[s] = expected_tokens(accept, s), float(s)
    row.keep()
    return row


def test_a_row_kept_by_half_its_drafts_accepted_goes_plain_only_where_experts_price_them():
    lookup = SimpleNamespace(has_state=False, drafts_trees=False, relative_cost=0.0, prior_acceptance=None,
                             copies=False)
    dense = SpeculationController(lookup, StepCosts(dict(DENSE)))
    moe = SpeculationController(lookup, moe_costs())
    assert kept_row(dense, 0.7).kept == kept_row(moe, 0.7).kept == 3 and kept_row(moe, 0.7).mode == AUTO
    assert dense._kept_size(kept_row(dense, 0.7), 1) == 3
    assert moe._kept_size(kept_row(moe, 0.7), 1) == 0                # 2.5 tokens for a pass of ~2.8 steps
    assert moe._kept_size(kept_row(moe, 0.97), 1) == 4
    predicted = moe.new_row(4, predicted=True)                       # a prediction is news: its first size stays
    assert moe._kept_size(predicted, 1) == predicted.kept == 4


@pytest.mark.slow
def test_a_moe_target_prices_its_passes_by_the_experts_they_read(tmp_path):
    """The tiny random Qwen3-MoE: the start-up measurement prices its experts, every step's pass
    reports its union, and the greedy output stays plain decoding's."""
    from specdecode import LLM, SamplingParams
    make_qwen3_moe(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="fp32", progress=False)
    if llm.core is None or getattr(llm.target.model, "fused", None) is None:
        pytest.skip("no fused decoder here (the experts are counted by its native passes)")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = "Repeat: one two three one two three one two three"
    plain = llm.generate(prompt, params, num_speculative_tokens=0)[0].token_ids
    assert llm.generate(prompt, params)[0].token_ids == plain
    moe = llm.core.costs.moe
    assert moe is not None and moe.used == 2 and moe.experts == 8 and moe.passes > 0
    assert 2 <= moe.experts_seen / moe.passes <= 8
    assert moe.union[1] == 2 and max(moe.union.values()) > 2          # distinct rows read more experts


def test_a_climb_on_moe_assumes_the_acceptance_measured_not_every_node():
    lookup = SimpleNamespace(has_state=False, drafts_trees=False, relative_cost=0.0, prior_acceptance=None,
                             copies=True)
    for costs, expected in ((StepCosts(dict(DENSE)), 4.0), (moe_costs(), expected_tokens(0.7, 3))):
        ctrl = SpeculationController(lookup, costs)
        row = kept_row(ctrl, 0.7)
        row.size = 2
        assert ctrl._climb_gain(row, 3) == pytest.approx(expected, rel=1e-4)


@pytest.mark.slow
def test_qwen35_moe_counts_its_experts_in_the_eager_mlps(tmp_path):
    """Qwen3.5-MoE's MoE MLPs run eagerly (models/moe.py): each leaves its distinct experts, which the
    engine reads as a fused decoder's count; its MTP head (the default drafter) plans with that price."""
    from conftest import make_qwen35_moe

    from specdecode import LLM, SamplingParams
    make_qwen35_moe(tmp_path, mtp=True)
    llm = LLM(model=str(tmp_path), dtype="fp32", progress=False)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = llm.generate("one two three", params, num_speculative_tokens=0)[0].token_ids
    assert llm.generate("one two three", params)[0].token_ids == plain
    moe = llm.core.costs.moe
    assert llm.method == "mtp" and moe is not None and moe.used == 2 and moe.passes > 0
    assert 2 <= moe.experts_seen / moe.passes <= 8 and max(moe.union.values()) > 2


def test_only_a_moe_model_has_an_expert_counter_and_its_share_is_one_expert_of_a_tokens_weights():
    from specdecode.engine.costs import ExpertCounter
    dense = SimpleNamespace(config=SimpleNamespace(moe=None), fused=None, layers=[])
    assert ExpertCounter.of(dense) is None
    config = SimpleNamespace(moe={"used": 2, "experts": 8, "intermediate": 4}, moe_layers=(True, True), hidden_size=16,
                             weight_count=lambda: 3840)
    layers = [{"router": 0, "distinct": 3}, {"router": 0, "distinct": 5}, {"mlp": 0}]
    counter = ExpertCounter.of(SimpleNamespace(config=config, fused=None, layers=layers))   # eager MoE MLPs
    assert counter.read() == 4.0 and counter.used == 2 and counter.experts == 8
    assert counter.share == pytest.approx(3 * 16 * 4 * 2 / 3840)
    fused = SimpleNamespace(moe_count=SimpleNamespace(tolist=lambda: [6, 8, 0]))               # the fused decoder's
    assert ExpertCounter.of(SimpleNamespace(config=config, fused=fused, layers=layers)).read() == 7.0
