"""Layer-skip self-speculation: the target's own layers with some skipped draft for it. Greedy
output identical with and without it (batched, alone, fixed and calibrated layer sets, fp32 and
bf16, fused native and eager); the calibration picks layers by measured agreement and reports them; the target's
cache is never written by the draft; bad options name themselves."""
import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.drafters.base import DrafterError
from specdecode.drafters.layer_skip import SkipView, choose_skip_layers, top1_agreement

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox",
           "def add(a, b):\n    return a + b\n", "1 2 3 4 5 6 7 8", "x"]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch,options", [("llama", {"skip_layers": [1]}), ("qwen2", {"skip_layers": "0"}),
                                          ("llama", {"min_agreement": 0.0, "skip_ratio": 0.7})])
def test_greedy_equals_plain(tiny_models, arch, options):
    llm = LLM(model=str(tiny_models[arch]), method="layer-skip", dtype="fp32", progress=False, adaptive=False,
              draft_confidence=0.0, **options)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    for k in (1, 4):
        spec = llm.generate(PROMPTS, params, num_speculative_tokens=k)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain], k
        alone = llm.generate([PROMPTS[0]], params, num_speculative_tokens=k)[0]
        assert alone.token_ids == plain[0].token_ids
    summary = llm.drafter.summary()
    assert summary["skip_layers"] and summary["num_layers"] == llm.target.model.config.num_layers


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_skip_pass_matches_eager(tiny_models, arch):
    """With layers skipped the pass runs in the fused native decoder over the kept layers (built
    once per set) and equals the eager pass that leaves the same layers out."""
    from specdecode.forward import ForwardBatch
    from specdecode.models.loader import load_model
    fast = load_model(str(tiny_models[arch]), dtype="fp32", progress=False, fast=True).model
    eager = load_model(str(tiny_models[arch]), dtype="fp32", progress=False, fast=False).model
    if fast.fused is None:
        pytest.skip("no fused decoder on this machine")
    tokens = torch.randint(0, fast.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    for skip in (frozenset({1}), frozenset({0, 2}), frozenset({-1})):
        got = [m.logits(m.run(ForwardBatch.chain(tokens, 0), m.new_cache(1, 16), skip=skip)) for m in (fast, eager)]
        torch.testing.assert_close(got[0], got[1], atol=1e-4, rtol=1e-4)
        assert fast._skip_decoders[skip] is not None
    full = fast.logits(fast.run(ForwardBatch.chain(tokens, 0), fast.new_cache(1, 16)))
    assert torch.equal(got[0], full)                     # {-1} skips nothing: the full model, bitwise
    assert not torch.allclose(fast.logits(fast.run(ForwardBatch.chain(tokens, 0), fast.new_cache(1, 16),
                                                   skip=frozenset({1}))), full)


def test_sampled_runs_seeded(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), method="layer-skip", dtype="fp32", progress=False,
              skip_layers=[2])
    params = SamplingParams(temperature=0.8, max_tokens=20, seed=3, ignore_eos=True)
    a, b = llm.generate(PROMPTS[:2], params), llm.generate(PROMPTS[:2], params)
    assert [x.token_ids for x in a] == [x.token_ids for x in b] and all(len(x.token_ids) == 20 for x in a)


def test_calibration_measures_agreement(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), method="none", dtype="fp32", progress=False)
    model = llm.target.model
    ids = llm.encode(PROMPTS[0], chat=False)
    tokens = torch.tensor([ids])
    reference = model.logits(model.run(__import__("specdecode").forward.ForwardBatch.chain(tokens, 0),
                                       model.new_cache(1, len(ids)), skip=frozenset({-1}))).argmax(-1)
    assert top1_agreement(model, tokens, reference, frozenset()) == 1.0
    skip, agreement = choose_skip_layers(model, ids, skip_ratio=0.7, min_agreement=0.0)
    assert len(skip) == 2 and 0.0 <= agreement <= 1.0                 # int(0.7 * 3) layers, any agreement
    assert agreement == top1_agreement(model, tokens, reference, skip)
    none, _ = choose_skip_layers(model, ids, skip_ratio=0.7, min_agreement=1.01 - 1e-9)
    assert none == frozenset()                                          # nothing keeps a perfect agreement


def test_draft_never_writes_the_target_cache(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), method="layer-skip", dtype="fp32", progress=False,
              skip_layers=[1], adaptive=False)
    seen = []
    original = llm.drafter.propose

    def spy(seqs, max_tokens):
        before = llm.core.runner.cache.keys[0].clone()
        out = original(seqs, max_tokens)
        seen.append(torch.equal(before, llm.core.runner.cache.keys[0]))
        return out
    llm.drafter.propose = spy
    llm.generate([llm.encode(PROMPTS[0], chat=False)], SamplingParams(max_tokens=12, ignore_eos=True),
                 num_speculative_tokens=4)
    assert seen and all(seen)
    assert isinstance(llm.drafter.model, SkipView) and llm.drafter.model.skip == frozenset({1})


@pytest.mark.parametrize("options,match", [({"skip_layers": [7]}, "skip_layers"),
                                           ({"skip_layers": [0, 1, 2]}, "skip_layers"),
                                           ({"skip_layers": "a,b"}, "skip_layers"), ({"skip_ratio": 1.5}, "skip_ratio"),
                                           ({"min_agreement": -1}, "min_agreement"),
                                           ({"calibration_tokens": 2}, "calibration_tokens")])
def test_bad_options(tiny_models, options, match):
    with pytest.raises(DrafterError, match=match):
        LLM(model=str(tiny_models["llama"]), method="layer-skip", dtype="fp32", progress=False, **options)
