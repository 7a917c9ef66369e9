"""End to end: speculative sampling draws the first three tokens from exactly the plain
sampling distribution (spec: chi-square p > 1e-3 and total variation < 0.01 at 10^5 samples).

Set-up: a dedicated tiny Llama target and a different tiny draft model (acceptance ~0.6, so
accepted drafts, recovered tokens from the residual and bonus tokens all occur often),
temperature 1 and top_k = 4, so at most 4^3 = 64 three-token continuations have mass. Their
exact probabilities come from the target itself, one forward pass per prefix, through the same
logits transform the engine uses (`transform_logits` + `probs_from_logits`). 10^5 speculative
samples (k = 2, i.e. every draft position of a 3-token budget) are drawn as batches of 2000
rows, each row with its own seed: ~25-35 s on 2 idle cores. Noise alone gives TV ~0.006 here
(checked in the fixture), so the 0.01 bound has margin; the controls use 0.01 * sqrt(10^5 / n).

Negative controls show that the same test rejects biased samplers: the draft model's own
distribution, and speculative sampling with the classic bug of drawing the token after a
rejection from the target distribution instead of the residual max(0, p - q).
"""
from __future__ import annotations

import math
from collections import Counter

import conftest
import pytest
import torch
from conftest import compare_samples, null_tv

from specdecode import LLM, SamplingParams
from specdecode.engine import offline
from specdecode.sampling import probs_from_logits, transform_logits

NUM_SAMPLES = 100_000           # the spec's sample count
NUM_CONTROL = 5_000             # per negative control: the biases are gross (TV > 0.2), 5000 suffice
ROWS_PER_CALL = 2_000
K = 2                           # with max_tokens = 3 the engine never drafts more than 2
PROMPT = "the quick brown fox"
P_MIN = 1e-3                    # chi-square p-value threshold
TV_MAX = 0.01                   # total-variation threshold at NUM_SAMPLES (scaled as 1/sqrt(n) below)



pytestmark = pytest.mark.usefixtures("one_thread")

def params(seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=seed)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    target = conftest.make_model(root / "target", "llama", seed=11, layers=2)
    draft = conftest.make_model(root / "draft", "llama", seed=12, layers=1)
    opts = dict(dtype="fp32", progress=False, adaptive=False)
    return {"spec": LLM(model=str(target), draft=str(draft), method="model", **opts),
            "draft": LLM(model=str(draft), **opts)}


def exact_joint(llm: LLM, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(first three tokens) under plain sampling, from the target itself."""
    model, p = llm.target.model, params()

    def next_probs(prefix: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + prefix])
        logits = model.forward(ids, model.new_cache(1, ids.shape[1] + 1), 0)[:, -1:]
        return probs_from_logits(transform_logits(logits, [p]), [p])[0, 0].double()
    return conftest.exact_joint(next_probs, 3)


def draw(llm: LLM, prompt: list[int], n: int, k: int, seed0: int) -> tuple[Counter, float]:
    """n samples of the first three tokens (row i seeded seed0 + i) and the acceptance rate."""
    return conftest.draw_samples(llm, prompt, params, n, k, seed0, ROWS_PER_CALL)


def tv_bound(n: int) -> float:
    return TV_MAX * math.sqrt(NUM_SAMPLES / n)


def drafter_sampling(setup, method: str, seed0: int, min_acceptance: float, **options) -> LLM:
    """The set-up's LLM with drafter `method` (built with `options`) draws 2x10^4 samples of the
    first tokens: drafts are accepted (above `min_acceptance`), nothing falls outside the exact
    joint, and chi-square / TV keep the target's distribution. Returns that LLM."""
    from specdecode.drafters.registry import build_drafter
    llm, prompt, exact = setup
    spec = LLM.__new__(LLM)
    spec.__dict__.update(llm.__dict__)
    spec.drafter = build_drafter(method, llm.target, **options)
    spec.method = method
    spec.core = offline.offline_core(llm.target, spec.drafter, llm.num_speculative_tokens, adaptive=False)
    n = 20_000
    counts, acceptance = draw(spec, prompt, n, K, seed0=seed0)
    p_value, tv, outside = compare_samples(counts, exact)
    assert acceptance > min_acceptance, acceptance
    assert outside == 0
    assert p_value > P_MIN, (p_value, tv)
    assert tv < tv_bound(n), (p_value, tv)
    return spec


@pytest.fixture(scope="module")
def setup(models):
    llm = models["spec"]
    prompt = llm.encode(PROMPT, False)
    exact = exact_joint(llm, prompt)
    assert 27 <= len(exact) <= 64 and abs(sum(exact.values()) - 1) < 1e-4
    # the thresholds are meaningful: noise alone gives TV well under the bound
    assert null_tv(exact, NUM_SAMPLES) < 0.7 * TV_MAX
    return llm, prompt, exact


def test_speculative_sampling_matches_plain_distribution(setup):
    llm, prompt, exact = setup
    counts, acceptance = draw(llm, prompt, NUM_SAMPLES, K, seed0=1_000_000)
    p_value, tv, outside = compare_samples(counts, exact)
    assert 0.2 < acceptance < 0.95, acceptance          # both accepted and rejected drafts are common
    assert outside == 0
    assert p_value > P_MIN, (p_value, tv)
    assert tv < TV_MAX, (p_value, tv)


def test_cascade_with_draft_model_sampling_matches_plain_distribution(setup, models):
    """The cascade over the draft model: lookup rows (one-hot) and draft-model rows (its sampled
    distribution) in the same runs keep the target's distribution."""
    spec = drafter_sampling(setup, "cascade", 4_000_000, 0.01, draft=setup[0].draft, lookup="ngram",
                            ngram_min=1, ngram_max=2)
    assert spec.drafter.lookup_steps > 0 and spec.drafter.head_steps > 0


def test_cascade_suffix_lookup_sampling_matches_plain_distribution(setup, models):
    """The default over a draft model: suffix-index lookup rows (point masses) and draft-model rows."""
    spec = drafter_sampling(setup, "cascade", 4_500_000, 0.01, draft=setup[0].draft, lookup_min_tokens=1)
    assert spec.drafter.suffix is not None
    assert spec.drafter.lookup_steps > 0 and spec.drafter.head_steps > 0


def test_reduced_draft_head_sampling_matches_plain_distribution(setup, models):
    """A draft model whose LM head keeps 160 token ids (head_vocab): every other token has draft
    probability 0, and the target's distribution is kept (residual sampling recovers them)."""
    drafter_sampling(setup, "model", 5_000_000, 0.01, draft=setup[0].draft, head_vocab=160, head_rank="id")


def test_detects_draft_distribution(setup, models):
    """Negative control 1: plain sampling from the draft model is rejected."""
    _, prompt, exact = setup
    counts, _ = draw(models["draft"], prompt, NUM_CONTROL, 0, seed0=2_000_000)
    p_value, tv, outside = compare_samples(counts, exact)
    assert p_value < P_MIN and tv > tv_bound(NUM_CONTROL), (p_value, tv, outside)


def test_detects_wrong_residual(setup, monkeypatch):
    """Negative control 2: after a rejection, sampling from p instead of normalize(max(0, p - q))
    over-weights the draft's favourite tokens; the same test must catch it (same support)."""
    import specdecode.verify as verify_module
    llm, prompt, exact = setup
    monkeypatch.setattr(verify_module, "_residual_probs", lambda target, draft: target)
    counts, _ = draw(llm, prompt, NUM_CONTROL, K, seed0=3_000_000)
    p_value, tv, outside = compare_samples(counts, exact)
    assert outside == 0
    assert p_value < P_MIN and tv > tv_bound(NUM_CONTROL), (p_value, tv)



@pytest.mark.parametrize("method,options", [("eagle", {}), ("eagle", {"min_confidence": 0.05}),
                                            ("cascade", {"ngram_min": 1, "ngram_max": 2}),
                                            ("eagle2", {"tree_topk": 2, "tree_depth": 2}),
                                            ("medusa", {"tree_topk": 2})])
def test_eagle_sampling_matches_plain_distribution(setup, models, tmp_path_factory, method, options):
    """The EAGLE drafter's proposals (a head on the target's features, reduced draft vocabulary:
    tokens outside it have draft probability 0) pass the same test at 2x10^4 samples; so does the
    cascade, whose batches mix lookup rows (one-hot draft distributions) with head rows, and so do
    untrained Medusa heads (point-mass trees from the target's feature)."""
    from specdecode.drafters.format import save_eagle, save_medusa
    from specdecode.drafters.head import EagleHead
    from specdecode.drafters.medusa import MedusaConfig, MedusaHeads
    llm = setup[0]
    torch.manual_seed(5)
    vocab = torch.arange(0, llm.target.model.vocab_size, 2)           # every other token
    c = llm.target.model.config
    if method == "medusa":         # W = 0: every head predicts what the target's LM head does
        head = MedusaHeads(MedusaConfig(c.hidden_size, 2, vocab.numel(), c.vocab_size), vocab)
        path = save_medusa(head, tmp_path_factory.mktemp("medusa_e2e"), llm.target, {})
    else:
        head = EagleHead.from_target(llm.target.model, vocab)
        with torch.no_grad():      # fc = [0 | identity]: the untrained head acts as one more target
            d = c.hidden_size      # layer, so its drafts are accepted now and then
            head.fc.weight.zero_()
            head.fc.weight[:, d:].copy_(torch.eye(d))
        path = save_eagle(head, tmp_path_factory.mktemp("eagle_e2e"), llm.target, {})
    # drafts are accepted (a few %) and rejected
    spec = drafter_sampling(setup, method, 3_000_000, 0.01, drafter_path=str(path), **options)
    if method == "cascade":                              # both kinds of rows occurred
        assert spec.drafter.lookup_steps > 0 and spec.drafter.head_steps > 0


def test_lookahead_sampling_matches_plain_distribution(setup):
    """Lookahead's drafts (pool n-grams and Jacobi window cells, point masses in one tree) pass
    the same test at 2x10^4 samples; with 2-grams every window column is one node, so the 2-node
    budget of this set-up holds a window."""
    drafter_sampling(setup, "lookahead", 4_000_000, 0.005, lookahead_window=2, lookahead_ngram=2,
                     window_min_yield=0.0)                  # the window every step


def test_layer_skip_sampling_matches_plain_distribution(setup):
    """Layer-skip drafts (the target with a layer left out, sampled with the shared transform)
    pass the same test at 2x10^4 samples."""
    drafter_sampling(setup, "layer-skip", 5_000_000, 0.05, skip_layers=[0], draft_confidence=0.0)


def test_constrained_sampling_matches_plain_constrained_distribution(setup, models):
    """Under a grammar (letters and spaces only, at least 12 characters), speculative sampling with
    the draft model draws the first three tokens from exactly the masked target distribution plain
    constrained sampling uses (exact joint through the same Constraint and transform), 2x10^4
    samples; drafts outside the grammar are common, so rejections by the mask occur."""
    from specdecode.structured import Structured, grammar_tokenizer
    llm, prompt, _ = setup
    structured = Structured("regex", "[a-z ]{12,60}")
    tokens = grammar_tokenizer(llm.target)
    model, base = llm.target.model, params()

    def constrained(seed=None):
        return SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=seed,
                              structured=structured)

    exact: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == 3:
            exact[tuple(prefix)] = prob
            return
        ids = torch.tensor([prompt + prefix])
        logits = model.forward(ids, model.new_cache(1, ids.shape[1] + 1), 0)[:, -1:]
        c = tokens.constraint(structured)
        c.consume(prefix)
        allowed = c.allowed()[None, None]
        probs = probs_from_logits(transform_logits(logits, [base], allowed=allowed), [base])[0, 0]
        for t in torch.nonzero(probs > 0).flatten().tolist():
            walk(prefix + [t], prob * float(probs[t]))

    walk([], 1.0)
    assert abs(sum(exact.values()) - 1) < 1e-4 and len(exact) >= 20
    n = 20_000
    counts: Counter = Counter()
    drafted = accepted = 0
    for start in range(0, n, ROWS_PER_CALL):
        seeded = [constrained(5_000_000 + start + i) for i in range(ROWS_PER_CALL)]
        outs = llm.generate([prompt] * ROWS_PER_CALL, seeded, num_speculative_tokens=K)
        counts.update(tuple(o.token_ids) for o in outs)
        drafted += sum(o.stats["drafted_tokens"] for o in outs)
        accepted += sum(o.stats["accepted_tokens"] for o in outs)
    p_value, tv, outside = compare_samples(counts, exact)
    assert 0.05 < accepted / drafted < 0.95, accepted / drafted
    assert outside == 0
    assert p_value > P_MIN, (p_value, tv)
    assert tv < tv_bound(n), (p_value, tv)
