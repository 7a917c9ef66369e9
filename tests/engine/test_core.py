"""The engine core (engine/core.py) under the Python front: a call's outputs do not depend on how
many prompts it holds, rows that never draft never reach the drafter, shadow drafts are one call,
a pinned (seeded, sampled) row repeats its text whatever the batch, and the engine grows between
calls without losing its prefix cache."""
from __future__ import annotations

import pytest
from conftest import run_engine

from specdecode import LLM, SamplingParams
from specdecode.drafters.base import Drafter, DrafterCapabilities, DraftProposal
from specdecode.engine import offline
from specdecode.engine.config import EngineConfig
from specdecode.engine.controller import SpeculationController
from specdecode.engine.sequence import Finished, Request, Tokens

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox",
           "def add(a, b):\n    return a + b\n",
           "Summarize the following text. The cat sat on the mat.",
           "1 2 3 4 5 6 7 8",
           "speculative decoding drafts tokens and verifies them"]


class Spy(Drafter):
    """A stateless drafter that drafts wrong tokens and records whom it saw."""
    name = "spy"
    capabilities = DrafterCapabilities()

    def __init__(self) -> None:
        self.proposed: list[list[str]] = []
        self.committed: set = set()
        self.prefilled: set = set()

    def prefill(self, seqs):
        self.prefilled |= {s.request_id for s in seqs}

    def propose(self, seqs, sizes):
        self.proposed.append([s.request_id for s in seqs])
        return DraftProposal.from_lists([[3] * n for n in sizes])

    def commit(self, seqs, proposal, num_accepted):
        self.committed |= {s.request_id for s in seqs}


def submit_all(core, jobs):
    """Submit (prompt ids, params, speculate) jobs, run until idle; per job (token ids, finished)."""
    out = [[[], None] for _ in jobs]
    for i, (ids, params, speculate) in enumerate(jobs):
        def sink(event, i=i):
            if isinstance(event, Tokens):
                out[i][0] += event.ids
            elif isinstance(event, Finished):
                out[i][1] = event
        core.submit(Request(ids, params, sink, speculate=speculate, id=f"job{i}"))
    core.run_until_idle()
    return out


def test_a_calls_outputs_do_not_depend_on_how_many_prompts_it_holds(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama_draft"]), dtype="fp32",
              progress=False, method="model")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in PROMPTS]
    for count in (1, 3, 4, 5):
        together = llm.generate(PROMPTS[:count], params)
        assert [o.token_ids for o in together] == alone[:count], count
    assert [o.token_ids for o in llm.generate(PROMPTS, params, num_speculative_tokens=0)] == alone


def test_rows_that_never_draft_never_reach_the_drafter_and_shadows_are_one_call(tiny_models, monkeypatch):
    llm = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False, method="none")
    monkeypatch.setattr(SpeculationController, "shadow_due", lambda self, seconds, young=False: True)
    spy = Spy()
    core = offline.offline_core(llm.target, spy, 4)
    offline.prepare(core, 3, 64)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    out = submit_all(core, [(ids[0], params, None), (ids[1], params, False), (ids[2], params, None)])
    assert all(len(tokens) == 12 for tokens, _ in out)
    seen = {r for call in spy.proposed for r in call}
    assert seen == {"job0", "job2"} and "job1" not in spy.committed | spy.prefilled
    # wrong drafts: a row's first proposal is verified (the prior), then it decodes plain and every
    # step drafts its shadows in one call
    assert 0 < out[0][1].speculation["drafted_tokens"] <= 4
    assert max(len(call) for call in spy.proposed) == 2 and len(spy.proposed) >= 10


def test_no_drafts_in_a_batch_larger_than_spec_max_batch_size(tiny_models):
    """The controller's rows draft only while the batch holds at most spec_max_batch_size rows
    (a request that asks for speculation, `speculate: true`, drafts anyway)."""
    llm = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False, method="ngram")
    config = EngineConfig(max_batch_size=4, max_model_len=128, spec_max_batch_size=1)
    core = llm.serve_core(config)
    ids = llm.tokenizer.encode(PROMPTS[0])
    answer = llm.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True), num_speculative_tokens=0)[0]
    predicted = SamplingParams(max_tokens=24, ignore_eos=True, prediction=answer.text)   # drafts from the start
    together = submit_all(core, [(ids, predicted, None), (ids, predicted, None)])
    assert all(f.speculation["drafted_tokens"] == 0 for _, f in together)
    alone = submit_all(core, [(ids, predicted, None)])
    assert alone[0][1].speculation["drafted_tokens"] > 0 and alone[0][0] == together[0][0] == answer.token_ids
    forced = submit_all(core, [(ids, predicted, True), (ids, predicted, True)])
    assert all(f.speculation["drafted_tokens"] > 0 for _, f in forced)


def test_a_pinned_row_repeats_its_text_alone_or_in_a_batch(tiny_models):
    """Seeded sampling with a draft model (which samples its drafts from the row's generator): the
    row's sizes depend on its own acceptance only, so the seed gives the same text alone, in a batch,
    and again."""
    target, draft = str(tiny_models["llama"]), str(tiny_models["llama_draft"])
    llm = LLM(model=target, draft=draft, dtype="fp32", progress=False, method="model")
    seeded = SamplingParams(max_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
    other = SamplingParams(max_tokens=30, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded)[0].token_ids
    batched = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [other, seeded, other])[1].token_ids
    fresh = LLM(model=target, draft=draft, dtype="fp32", progress=False, method="model")
    assert alone == batched == fresh.generate([PROMPTS[0]], seeded)[0].token_ids


def test_the_engine_grows_between_calls_and_keeps_its_prefix_cache(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False, method="ngram")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    long_prompt = llm.tokenizer.encode(PROMPTS[0] * 3)
    first = llm.generate([long_prompt], params)[0]
    rows, blocks = llm.core.runner.rows, llm.core.runner.cache.num_blocks
    many = llm.generate([long_prompt] + PROMPTS[1:], SamplingParams(max_tokens=60, ignore_eos=True))
    assert llm.core.runner.rows > rows and llm.core.runner.cache.num_blocks > blocks
    assert many[0].stats["cached_tokens"] == (len(long_prompt) - 1) // 16 * 16       # the first call's blocks
    assert many[0].token_ids[:8] == first.token_ids


def test_the_embedded_model_as_its_own_draft_accepts_every_draft():
    """`specdecode generate --draft EMBEDDED --method model -k 4 --no-adaptive --dtype fp32
    --draft-dtype fp32` on a long prompt: the draft reads the whole context, so every draft is the
    target's own token, and k are drafted every step."""
    from specdecode.datasets import load
    from specdecode.models.loader import default_model_path
    prompt = next(p.text for p in load("summarization") if len(p.text) > 2000)
    llm = LLM(draft=str(default_model_path()), method="model", num_speculative_tokens=4, adaptive=False, dtype="fp32",
              draft_dtype="fp32", progress=False)
    out = llm.generate(prompt, SamplingParams(max_tokens=25, ignore_eos=True), chat=True)[0]
    assert out.stats["acceptance_rate"] == 1.0
    assert out.stats["steps"] == 5 and out.stats["drafted_tokens"] == 4 * 5


def test_run_engine_helper_matches_llm_generate(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False, method="ngram")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    got = run_engine(llm.target, llm.drafter, 5, ids, [params] * 2)
    assert [s.output_ids for s in got] == [o.token_ids for o in llm.generate(ids, params)]


def test_one_core_per_llm_the_server_runs_on_it_and_calls_join_its_batch(tiny_models):
    """`serve` runs on the LLM's own core (a draft model's cache handed over once), a call made
    while it serves joins its batch, and after it stops the next call runs on a fresh offline core."""
    from specdecode.serve.server import build_state
    llm = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama_draft"]), dtype="fp32",
              progress=False, method="model")
    ids = llm.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    alone = llm.generate([ids], params)[0].token_ids
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=128), check_budget=False)
    assert state.engine is llm.core and state.engine.runner.drafter_state is state.engine.runner.draft_cache
    state.engine.start()
    try:
        assert llm.generate([ids, PROMPTS[1]], params)[0].token_ids == alone
        assert state.engine.thread.is_alive()
    finally:
        state.engine.stop()
    assert llm.generate([ids], params)[0].token_ids == alone and llm.core is not state.engine


def test_a_stale_cost_curve_is_measured_again_between_steps(tiny_models, monkeypatch):
    """A curve the steps show was measured under load (`StepCosts.stale`) is measured again on a
    free row, at most every REMEASURE_STEPS steps; the text does not change."""
    from specdecode.engine import core as core_module
    llm = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False, method="ngram")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    first = llm.generate([PROMPTS[0], PROMPTS[1]], params)[0].token_ids
    measured = []
    monkeypatch.setattr(llm.core.runner, "cost_curve", lambda row, rows: measured.append(rows) or {1: 1.0, 2: 1.1})
    monkeypatch.setattr(type(llm.core.costs), "stale", property(lambda costs: costs.scale < 10.0))   # always
    llm.core.curve_age = core_module.REMEASURE_STEPS
    assert llm.generate([PROMPTS[0], PROMPTS[1]], params)[0].token_ids == first
    assert measured == [llm.core.curve_rows] and llm.core.curve_age < core_module.REMEASURE_STEPS
