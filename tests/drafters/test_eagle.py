"""EAGLE-style drafter: lossless with any head (even an untrained one), batched and alone; the
saved format records its target and warns on a mismatch; bad drafter paths give clear errors."""
import dataclasses
import json
import warnings

import pytest
import torch
from conftest import assert_drafts_accepted_and_exact

from specdecode import LLM, SamplingParams
from specdecode.drafters.base import DrafterError
from specdecode.drafters.format import DrafterMismatchWarning, save_eagle
from specdecode.drafters.head import EagleHead
from specdecode.models.loader import load_model

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox",
           "def add(a, b):\n    return a + b\n", "1 2 3 4 5 6 7 8", "x"]


@pytest.fixture(scope="module")
def heads(tiny_models, tmp_path_factory, one_thread):
    """An untrained head per architecture, saved in the drafter format."""
    out = {}
    for arch in ("llama", "qwen2"):
        target = load_model(str(tiny_models[arch]), "fp32", progress=False)
        torch.manual_seed(0)
        vocab = torch.arange(target.model.vocab_size // 2, target.model.vocab_size)  # a reduced draft vocab
        head = EagleHead.from_target(target.model, vocab)
        with torch.no_grad():      # fc = [0 | identity]: the head acts as one more target layer and
            d = target.model.config.hidden_size     # its drafts are accepted often enough to test with
            head.fc.weight.zero_()
            head.fc.weight[:, d:].copy_(torch.eye(d))
        out[arch] = save_eagle(head, tmp_path_factory.mktemp(f"eagle_{arch}"), target, {"note": "untrained"})
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eagle_greedy_equals_plain(tiny_models, heads, arch):
    llm = LLM(model=str(tiny_models[arch]), method="eagle", drafter_path=str(heads[arch]), dtype="fp32",
              progress=False, adaptive=False)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    for k in (1, 3, 5):
        spec = llm.generate(PROMPTS, params, num_speculative_tokens=k)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain], k
        alone = llm.generate([PROMPTS[1]], params, num_speculative_tokens=k)[0]
        assert alone.token_ids == plain[1].token_ids
        assert spec[0].stats["steps"] < 30     # it drafted and the loop advanced


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eagle2_tree_greedy_equals_plain(tiny_models, heads, arch):
    """EAGLE-2 dynamic trees from the same head: identical greedy output batched and alone, for
    several frontier widths and node budgets, and the drafts are accepted."""
    llm = LLM(model=str(tiny_models[arch]), method="eagle2", drafter_path=str(heads[arch]), dtype="fp32",
              progress=False, adaptive=False, tree_topk=3, tree_depth=4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    for k in (1, 4, 12, 40):
        spec = llm.generate(PROMPTS, params, num_speculative_tokens=k)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain], k
        alone = llm.generate([PROMPTS[1]], params, num_speculative_tokens=k)[0]
        assert alone.token_ids == plain[1].token_ids
        assert spec[0].stats["steps"] < 30     # it drafted and the loop advanced
    assert llm.drafter.capabilities.drafts_trees


def test_eagle2_tree_shape_and_bad_options(tiny_models, heads):
    from specdecode.drafters.registry import build_drafter
    from specdecode.tree import validate
    llm = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False, method="none")
    for bad in ({"tree_topk": 0}, {"tree_topk": 17}, {"tree_depth": 0}, {"tree_topk": 1}, {"tree_depth": 2.5}):
        with pytest.raises(DrafterError, match="tree_"):
            build_drafter("eagle2", llm.target, drafter_path=str(heads["llama"]), **bad)
    drafter = build_drafter("eagle2", llm.target, drafter_path=str(heads["llama"]), tree_topk=4, tree_depth=3)
    from conftest import run_engine
    seen = []
    original = drafter.propose

    def spy(seqs, max_tokens):
        proposal = original(seqs, max_tokens)
        seen.append((proposal, list(max_tokens)))
        return proposal
    drafter.propose = spy
    ids = llm.encode(PROMPTS[0], chat=False)
    run_engine(llm.target, drafter, 20, [ids, ids[:5]], [SamplingParams(max_tokens=10, ignore_eos=True)] * 2,
               adaptive=False)
    assert seen
    for proposal, budgets in seen:
        assert proposal.is_tree
        validate(proposal.parents, proposal.num_tokens)
        assert all(n <= b for n, b in zip(proposal.num_tokens.tolist(), budgets))
        from specdecode.tree import depths
        live = torch.arange(proposal.k)[None] < proposal.num_tokens[:, None]
        assert int(torch.where(live, depths(proposal.parents), 0).max()) <= 3
        for b in range(proposal.tokens.shape[0]):            # siblings carry distinct tokens
            n = int(proposal.num_tokens[b])
            pairs = list(zip(proposal.parents[b, :n].tolist(), proposal.tokens[b, :n].tolist()))
            assert len(set(pairs)) == len(pairs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cascade_greedy_equals_plain(tiny_models, heads, arch):
    """Lookup rows and head rows in one batch (the repetitive prompts match, "x" does not)."""
    llm = LLM(model=str(tiny_models[arch]), method="cascade", drafter_path=str(heads[arch]), dtype="fp32",
              progress=False, ngram_min=2, ngram_max=4, adaptive=False)
    assert_cascade_greedy_equals_plain(llm)


def assert_cascade_greedy_equals_plain(llm):
    """k = 1 and 4 give plain decoding's tokens on PROMPTS, and both kinds of rows drafted."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    for k in (1, 4):
        spec = llm.generate(PROMPTS, params, num_speculative_tokens=k)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain], k
    assert llm.drafter.lookup_steps > 0 and llm.drafter.head_steps > 0


def test_eagle_early_stop_is_exact_and_drafts_less(tiny_models, heads):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True, seed=4)
    drafted, outs = {}, {}
    for threshold in (0.0, 0.6):
        llm = LLM(model=str(tiny_models["llama"]), method="eagle", drafter_path=str(heads["llama"]), dtype="fp32",
                  progress=False, min_confidence=threshold, adaptive=False)   # sizes not chosen by timings
        plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
        spec = llm.generate(PROMPTS, params, num_speculative_tokens=6)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
        drafted[threshold] = sum(s.stats["drafted_tokens"] for s in spec)
        outs[threshold] = [s.token_ids for s in llm.generate(PROMPTS, sampled, num_speculative_tokens=6)]
    assert drafted[0.6] < drafted[0.0]
    assert all(len(t) == 30 for t in outs[0.6])
    with pytest.raises(DrafterError, match="min_confidence"):
        LLM(model=str(tiny_models["llama"]), method="eagle", drafter_path=str(heads["llama"]), dtype="fp32",
            progress=False, min_confidence=1.5)


def test_eagle_sampling_runs_seeded(tiny_models, heads):
    llm = LLM(model=str(tiny_models["llama"]), method="eagle", drafter_path=str(heads["llama"]), dtype="fp32",
              progress=False)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=3, ignore_eos=True)
    a = llm.generate(PROMPTS[:2], params)
    b = llm.generate(PROMPTS[:2], params)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert all(len(x.token_ids) == 20 for x in a)


def test_a_head_without_a_recorded_evaluation_takes_the_budgets_prior(tiny_models, heads):
    from specdecode.drafters.format import prior_acceptance
    llm = LLM(model=str(tiny_models["llama"]), method="eagle", drafter_path=str(heads["llama"]), dtype="fp32",
              progress=False)
    assert llm.drafter.capabilities.prior_acceptance is None         # saved with training {"note": ...}
    assert prior_acceptance({"training": {"final_eval": {"accept_depth": [0.6, 0.3]}}}) == pytest.approx(0.3)
    assert prior_acceptance({"training": {"final_eval": {"accept_depth": [7]}}}) is None


def test_eagle_format_and_mismatch(tiny_models, heads, tmp_path):
    meta = json.loads((heads["llama"] / "drafter.json").read_text())
    assert meta["format"] == "specdecode-drafter" and meta["version"] == 1 and meta["kind"] == "eagle"
    target = load_model(str(tiny_models["llama"]), "fp32", progress=False)
    assert meta["target"]["fingerprint"] == target.fingerprint
    # other weights, same shapes: a clear warning, still works and stays exact
    meta["target"]["fingerprint"] = "0" * 16
    moved = tmp_path / "other"
    moved.mkdir()
    (moved / "model.safetensors").write_bytes((heads["llama"] / "model.safetensors").read_bytes())
    (moved / "drafter.json").write_text(json.dumps(meta))
    with pytest.warns(DrafterMismatchWarning, match="trained for target"):
        llm = LLM(model=str(tiny_models["llama"]), method="eagle", drafter_path=str(moved), dtype="fp32",
                  progress=False)
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 8


def test_eagle_bad_paths(tiny_models, heads, tmp_path):
    with pytest.raises(DrafterError, match="not a specdecode drafter"):
        LLM(model=str(tiny_models["llama"]), method="eagle", drafter_path=str(tmp_path), dtype="fp32", progress=False)
    with pytest.raises(DrafterError, match="width"):      # qwen2 tiny has the same width: fake a different one
        meta = json.loads((heads["qwen2"] / "drafter.json").read_text())
        meta["target"]["hidden_size"] = 4096
        (tmp_path / "drafter.json").write_text(json.dumps(meta))
        LLM(model=str(tiny_models["llama"]), method="eagle", drafter_path=str(tmp_path), dtype="fp32", progress=False)
    with pytest.raises(DrafterError, match="no EAGLE drafter"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            LLM(model=str(tiny_models["llama"]), method="eagle", dtype="fp32", progress=False)


@pytest.mark.slow
def test_shipped_drafter_for_the_embedded_model(smollm2):
    """The drafter shipped in the package is found by the embedded target's fingerprint, is
    trained (its drafts are accepted) and stays exact; n-gram stays the default method."""
    from specdecode.api import default_method
    from specdecode.drafters.format import shipped_drafter
    from specdecode.drafters.registry import build_drafter
    assert shipped_drafter(smollm2, "eagle") is not None
    assert default_method(None, smollm2) == "ngram"
    drafter = build_drafter("eagle", smollm2)
    assert drafter.matches_target
    assert_drafts_accepted_and_exact(smollm2, drafter, "What is the capital of France?", 40)
    # the draft budget's priors: a head pass's share of the target's weight bytes, and half its held-out
    # acceptance (recorded in drafter.json by distill)
    from specdecode.drafters.format import HELD_OUT_SHARE, read_meta
    from specdecode.footprint import weights_bytes
    meta = read_meta(shipped_drafter(smollm2, "eagle"), "eagle")
    caps = drafter.capabilities
    assert caps.prior_acceptance == HELD_OUT_SHARE * meta["training"]["final_eval"]["accept_depth"][0]
    c = drafter.config
    layer = c.hidden_size * (2 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                             + c.num_heads * c.head_dim + 3 * c.intermediate_size)
    head_bytes = (layer + c.draft_vocab_size * c.hidden_size) * drafter.embed.element_size()
    assert caps.relative_cost == pytest.approx(head_bytes / weights_bytes(smollm2.model), rel=0.01)
    assert 0.03 < caps.relative_cost < 0.3


def test_eagle2_reads_the_features_of_the_accepted_path(tiny_models, heads):
    """After tree steps the head's features are the target's hidden states at the path's positions
    (the verify pass wrote node i's at slot root+1+i: commit moves the accepted ones)."""
    from specdecode.forward import ForwardBatch
    llm = LLM(model=str(tiny_models["llama"]), method="eagle2", drafter_path=str(heads["llama"]), dtype="fp32",
              progress=False, adaptive=False, tree_topk=3, tree_depth=4)
    drafter, model = llm.drafter, llm.target.model
    checked = []
    original = drafter.propose

    def spy(seqs, max_tokens):
        state = seqs[0].drafter_state    # the engine's, kept with its rows
        state.pending.flush()            # what propose reads first
        for s in seqs:
            ids = torch.tensor([s.token_ids])
            reference = model.run(ForwardBatch.chain(ids, 0), model.new_cache(1, ids.shape[1]))[0]   # [L, D]
            end = len(s.token_ids) - 1
            torch.testing.assert_close(state.features[s.row, :end], reference[:end], atol=1e-4, rtol=1e-4)
            checked.append(end)
        return original(seqs, max_tokens)
    drafter.propose = spy
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, ignore_eos=True), num_speculative_tokens=12)[0]
    assert len(checked) > 3 and out.stats["steps"] < 30


def test_cascade_with_a_draft_model_greedy_equals_plain(tiny_models):
    """With --draft the cascade's second drafter is that model (lookup rows and model rows in one
    batch; a row the model skipped catches up on its next draft); greedy output stays the target's."""
    llm = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama_draft"]), method="cascade",
              dtype="fp32", progress=False, ngram_min=2, ngram_max=4, adaptive=False, head_vocab=64)
    assert llm.drafter.draft_model() is not None and llm.drafter.capabilities.relative_cost > 0.05
    assert_cascade_greedy_equals_plain(llm)


def test_cascade_takes_a_lookup_where_it_is_predicted_to_give_more(tiny_models):
    """Lookup path or draft model, per row: the expected accepted tokens of each from its measured
    acceptance, the model's less its drafting time. A costly draft loses to a shorter path than a
    nearly free one; a source that keeps being right (or wrong) moves the choice; lookup_min_tokens
    keeps a fixed length threshold."""
    from specdecode.drafters.base import DraftProposal

    llm = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama_draft"]), method="cascade",
              dtype="fp32", progress=False)
    cascade = llm.drafter
    cost = cascade.head.capabilities.relative_cost
    shortest = next(n for n in range(1, 6) if cascade.lookup_pays(n, 5))     # at the priors (0.8 vs 0.6)
    cascade.head.capabilities = dataclasses.replace(cascade.head.capabilities, relative_cost=0.0)
    assert next(n for n in range(1, 6) if cascade.lookup_pays(n, 5)) >= shortest
    cascade.head.capabilities = dataclasses.replace(cascade.head.capabilities, relative_cost=0.5)
    assert cascade.lookup_pays(1, 5)                     # 5 draft tokens at half a step each cannot pay
    cascade.head.capabilities = dataclasses.replace(cascade.head.capabilities, relative_cost=cost)
    before = cascade.acceptance("lookup", 4)
    lookup_row = DraftProposal.from_lists([[1, 2, 3, 4]])           # no step_state: a lookup row
    for _ in range(20):
        cascade.commit([], lookup_row, [0])                         # every lookup draft rejected
    assert cascade.acceptance("lookup", 4) < 0.2 < before
    cascade.head.capabilities = dataclasses.replace(cascade.head.capabilities, relative_cost=0.01)
    assert not cascade.lookup_pays(4, 5)                 # a nearly free model right 60% of the time
    cascade.lookup_min_tokens = 3
    assert cascade.lookup_pays(3, 5) and not cascade.lookup_pays(2, 5)


def test_a_long_catch_up_computes_only_the_window_and_never_reads_before_it(tiny_models, heads):
    """A head far behind (a whole prompt) computes only its last `catch_up_window` slots, and no
    later pass attends to the slots it skipped: whatever they hold, the drafts are the same; greedy
    output stays plain decoding's, batched with rows of other lengths and alone."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=3)
    plain = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False, method="none")
    llm = LLM(model=str(tiny_models["llama"]), method="eagle", drafter_path=str(heads["llama"]), dtype="fp32",
              progress=False, adaptive=False, catch_up_window=3)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params, num_speculative_tokens=4)] == expected
    assert llm.generate([PROMPTS[0]], params, num_speculative_tokens=4)[0].token_ids == expected[0]
    assert all(len(o.token_ids) == 30 for o in llm.generate(PROMPTS, sampled, num_speculative_tokens=4))
    from conftest import make_seq

    from specdecode.forward import ForwardBatch
    drafter, model = llm.drafter, llm.target.model
    widths, original = [], drafter._pass

    def spy(st, rows, starts, tokens, features, fb=None):
        widths.append(tokens.shape[1])
        return original(st, rows, starts, tokens, features, fb)
    drafter._pass = spy
    ids = llm.encode(PROMPTS[0], False)
    hidden = model.run(ForwardBatch.chain(torch.tensor([ids]), 0), model.new_cache(1, len(ids)))   # [1, L, D]
    drafts = []
    for fill in (0.0, 1e4):      # what the skipped slots hold: zeros, or values that would swamp any output
        state = drafter.prepare(1, 128)
        for cache in (state.cache.keys[0], state.cache.values[0]):
            cache.fill_(fill)
        seq = make_seq(0, ids, params, (), row=0, drafter_state=state)
        drafter.observe([seq], [0], hidden)
        widths.clear()
        drafts.append(drafter.propose([seq], [4]).tokens.tolist())
        assert widths[0] == 3 < len(ids) - 1 and int(state.head_from[0]) == len(ids) - 4
    assert drafts[0] == drafts[1]
    for bad in (0, -3, 2.5, True):
        with pytest.raises(DrafterError, match="catch_up_window"):
            LLM(model=str(tiny_models["llama"]), method="eagle", drafter_path=str(heads["llama"]), dtype="fp32",
                progress=False, catch_up_window=bad)


def test_the_one_row_pass_equals_the_general_pass(tiny_models, heads):
    """A single row's chain takes `_pass_one` (a view of its cache, no mask at one slot): its
    predicted features equal the general pass's (copied rows, a mask over every slot), at a
    catch-up after a window and at one slot."""
    from specdecode.forward import ForwardBatch
    llm = LLM(model=str(tiny_models["llama"]), method="eagle", drafter_path=str(heads["llama"]), dtype="fp32",
              progress=False, adaptive=False)
    drafter = llm.drafter
    state = drafter.prepare(2, 64)
    torch.manual_seed(1)
    state.head_from[1] = 3                   # slots 0-2 never computed: both passes must ignore them
    state.cache.keys[0].normal_()
    state.cache.values[0].normal_()
    rows = torch.tensor([1])
    for start, num in ((3, 6), (9, 1), (10, 1)):
        tokens = torch.randint(0, llm.target.model.vocab_size, (1, num))
        features = torch.randn(1, num, llm.target.model.config.hidden_size)
        batch = ForwardBatch.chain(tokens, torch.tensor([start]), rows)
        general = drafter._pass(state, rows, [start], tokens, features, batch)
        one = drafter._pass(state, rows, [start], tokens, features)
        torch.testing.assert_close(one, general)


def test_pending_features_are_written_as_the_passes_wrote_them():
    """PendingFeatures keeps the passes' outputs and writes them when read: after any sequence of
    passes (runs of single positions, verify passes that rewrite earlier positions, a row reset to
    a new prompt), every position within `keep` of a row's newest equals what writing each pass at
    once gives."""
    from specdecode.drafters.eagle import PendingFeatures
    torch.manual_seed(0)
    keep, dim = 4, 3
    eager = torch.zeros(2, 64, dim)
    lazy = PendingFeatures(torch.zeros(2, 64, dim), keep)
    newest = [0, 0]
    for step in range(300):
        row = step % 3 % 2
        if step % 97 == 5:
            start, width = 0, 9                                  # a new prompt in the row
        elif step % 29 == 0:
            start, width = max(0, newest[row] - 3), 4            # a verify pass: back over rejected drafts
        else:
            start, width = newest[row], 1                        # a plain step
        if start + width > 64:
            start, width = 0, 9
        hidden = torch.randn(width, dim)
        eager[row, start:start + width] = hidden
        lazy.add(row, start, hidden)
        newest[row] = start + width
        if step % 37 == 0:                                       # a propose reads them
            lazy.flush()
            for r in range(2):
                low = max(0, newest[r] - keep)
                assert torch.equal(lazy.features[r, low:newest[r]], eager[r, low:newest[r]]), step


def test_a_catch_up_after_a_gap_reads_only_the_features_observed_since(tiny_models, heads):
    """While the controller keeps a row off, the engine hands its drafter no features (a gap); the
    probe's catch-up then starts after the gap, whatever the features tensor holds inside it."""
    from conftest import make_seq

    from specdecode.forward import ForwardBatch
    llm = LLM(model=str(tiny_models["llama"]), method="eagle", drafter_path=str(heads["llama"]), dtype="fp32",
              progress=False)
    drafter, model = llm.drafter, llm.target.model
    ids = llm.encode(" ".join(PROMPTS), False)[:40]
    hidden = model.run(ForwardBatch.chain(torch.tensor([ids]), 0), model.new_cache(1, len(ids)))   # [1, L, D]
    cut, resumed = len(ids) // 2, len(ids) - 4          # features of cut .. resumed - 1 never observed
    widths, original = [], drafter._pass

    def spy(st, rows, starts, tokens, features, fb=None):
        widths.append(tokens.shape[1])
        return original(st, rows, starts, tokens, features, fb)
    drafter._pass = spy
    drafts = []
    for fill in (0.0, 1e4):      # what the unobserved features hold: zeros, or values that would swamp any output
        state = drafter.prepare(1, 128)
        state.features.fill_(fill)
        seq = make_seq(0, ids, SamplingParams(max_tokens=8), (), row=0, drafter_state=state)
        drafter.observe([seq], [0], hidden[:, :cut])
        drafter.observe([seq], [resumed], hidden[:, resumed:])
        widths.clear()
        drafts.append(drafter.propose([seq], [4]).tokens.tolist())
        assert widths[0] == len(ids) - 1 - resumed and int(state.head_from[0]) == resumed
    assert drafts[0] == drafts[1]
