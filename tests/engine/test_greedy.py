"""Greedy speculative output equals target-only greedy output, token for token, for every
drafter, on tiny random models of both architectures (batched, ragged prompts)."""
import pytest

from specdecode import LLM, SamplingParams

PROMPTS = [
    "the quick brown fox jumps over the lazy dog. the quick brown fox",
    "def add(a, b):\n    return a + b\n",
    "Summarize the following text. The cat sat on the mat.",
    "1 2 3 4 5 6 7 8",
]


def run(llm, k, prompts=PROMPTS, max_tokens=40):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params, num_speculative_tokens=k)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["ngram", "model", "self"])
def test_greedy_equality(tiny_models, arch, method):
    draft = {"ngram": None, "model": tiny_models[arch + "_draft"], "self": tiny_models[arch]}[method]
    llm = LLM(model=str(tiny_models[arch]), draft=str(draft) if draft else None, dtype="fp32", progress=False,
              adaptive=False, method="ngram" if method == "ngram" else "model",
              **({"draft_confidence": 0.0} if method == "self" else {}))
    plain = run(llm, 0)
    for k in (1, 3, 5):
        spec = run(llm, k)
        for p, s in zip(plain, spec):
            assert s.token_ids == p.token_ids, (method, k)
        # batch of one equals the batch
        alone = run(llm, k, prompts=[PROMPTS[1]])[0]
        assert alone.token_ids == plain[1].token_ids
    stats = spec[0].stats
    if method == "self":   # draft == target: everything accepted, k+1 tokens per step
        assert stats["acceptance_rate"] == 1.0
        full_steps = [o.stats for o in spec]
        assert all(st["mean_accepted_length"] >= 5.0 for st in full_steps)
        assert spec[0].stats["acceptance_per_position"] == [1.0] * 5


def test_self_draft_mean_accepted_length_is_k_plus_1(tiny_models):
    # method="model": the draft model alone (the default cascade would rather take free lookups than a
    # draft that costs a whole target step per token, as a self-draft does)
    llm = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama"]), dtype="fp32", progress=False,
              adaptive=False, method="model", draft_confidence=0.0)      # full chains: the random model is unsure
    k = 4
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5 * (k + 1), ignore_eos=True),
                       num_speculative_tokens=k)[0]
    assert out.stats["acceptance_rate"] == 1.0
    assert out.stats["mean_accepted_length"] == k + 1
    assert out.stats["steps"] == 5


def test_a_greedy_row_stops_drafting_after_a_token_its_draft_is_unsure_of(tiny_models):
    """draft_confidence reads the draft's softmax for greedy rows too (their sampling distribution
    is one-hot): a self-draft whose every token is accepted still stops its chain after a token
    below the threshold, and the output stays the target's."""
    target = str(tiny_models["llama"])
    opts = dict(dtype="fp32", progress=False, adaptive=False, method="model")
    plain = run(LLM(model=target, dtype="fp32", progress=False, method="ngram"), 0)
    always = run(LLM(model=target, draft=target, draft_confidence=0.0, **opts), 4)
    gated = run(LLM(model=target, draft=target, draft_confidence=0.9, **opts), 4)   # the random model is unsure
    assert [s.token_ids for s in gated] == [s.token_ids for s in always] == [s.token_ids for s in plain]
    assert sum(s.stats["drafted_tokens"] for s in gated) < sum(s.stats["drafted_tokens"] for s in always)
    assert all(s.stats["acceptance_rate"] == 1.0 for s in gated)


def test_the_target_as_its_own_draft_accepts_every_draft_and_drafts_k_every_step(tiny_models):
    """A draft model that is the target itself (fp32, greedy): every draft is the target's own token,
    and with adaptive=False (draft_confidence off unless given) every step drafts k."""
    target = str(tiny_models["llama"])
    llm = LLM(model=target, draft=target, dtype="fp32", draft_dtype="fp32", progress=False, adaptive=False,
              method="model")
    prompt = " ".join(["the quick brown fox jumps over the lazy dog."] * 12)      # a long prompt (~110 tokens)
    out = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True), num_speculative_tokens=4)[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True), num_speculative_tokens=0)[0]
    assert out.token_ids == plain.token_ids
    assert out.stats["acceptance_rate"] == 1.0 and out.stats["acceptance_per_position"] == [1.0] * 4
    assert out.stats["drafted_tokens"] == 4 * out.stats["steps"]            # k every step


def test_the_draft_model_reads_the_prompt_during_prefill(tiny_models):
    """The draft model's prompt pass runs in the engine's prefill (timed as prefill, so the
    adaptive draft size sees only drafting costs): every proposal then feeds at most the
    bonus token and the last draft."""
    llm = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama_draft"]), dtype="fp32", progress=False,
              adaptive=False, method="model")
    model = llm.drafter.model
    widths = []
    run_ = model.run

    def run(fb, cache, **kw):
        widths.append(fb.tokens.shape[1])
        return run_(fb, cache, **kw)
    model.run = run
    try:
        plain = llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True), num_speculative_tokens=0)
        widths.clear()
        spec = llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True), num_speculative_tokens=3)
    finally:
        model.run = run_
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    longest = max(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert widths[0] == longest - 1                    # the prefill pass: every prompt but its last token
    assert max(widths[1:]) <= 2                 # proposals: the unseen bonus (+ last draft), then drafts


def test_cascade_suffix_lookup_keeps_greedy_outputs(tiny_models):
    """The cascade over a draft model with suffix-index lookup (long repeats) in front: outputs equal
    plain decoding, and both kinds of steps occur on a text that repeats itself."""
    target = str(tiny_models["llama"])
    prompt = "one two three four five six seven eight nine ten one two three four five six seven eight"
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    llm = LLM(model=target, draft=target, dtype="fp32", progress=False, adaptive=False, method="cascade",
              lookup="suffix", lookup_min_tokens=2)
    plain = llm.generate([prompt], params, num_speculative_tokens=0)[0].token_ids
    out = llm.generate([prompt], params, num_speculative_tokens=4)[0]
    assert out.token_ids == plain
    assert llm.drafter.lookup_steps > 0 and llm.drafter.head_steps > 0
    with pytest.raises(Exception, match="lookup must be one of"):
        LLM(model=target, draft=target, dtype="fp32", progress=False, method="cascade", lookup="trie")
    with pytest.raises(Exception, match="lookup_min_tokens"):
        LLM(model=target, draft=target, dtype="fp32", progress=False, method="cascade", lookup_min_tokens=-1)


def test_a_cascade_offers_its_lookups_where_the_controller_plans_plain(tiny_models, monkeypatch):
    """Rows the controller keeps plain (their draft model's drafts do not pay) still verify the
    cascade's free lookups where a copy is predicted to pay: drafts accepted, the head never asked,
    the output plain decoding's."""
    from specdecode.engine.controller import SpeculationController
    target = str(tiny_models["llama"])
    prompt = "one two three four five six seven eight nine ten one two three four five six seven eight"
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    llm = LLM(model=target, draft=target, dtype="fp32", progress=False, method="cascade")
    plain = llm.generate([prompt, PROMPTS[0]], params, num_speculative_tokens=0)
    monkeypatch.setattr(SpeculationController, "plan", lambda self, rows, pending: [0] * len(rows))
    outs = llm.generate([prompt, PROMPTS[0]], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.stats["accepted_tokens"] for o in outs) > 0 and llm.drafter.head_steps == 0


def test_a_next_turn_prefills_only_what_the_earlier_turns_blocks_do_not_cover_in_both_caches(tiny_models):
    """The prefix cache keeps the draft model's blocks too: a chat's next turn (the earlier turn's text
    and more) is prefilled only after the cached blocks, in the target's cache and the draft's; with
    a self-draft every draft is still accepted (the kept entries are right), and the output is the
    target's own."""
    target = str(tiny_models["llama"])
    llm = LLM(model=target, draft=target, dtype="fp32", progress=False, adaptive=False, method="model")
    plain = LLM(model=target, dtype="fp32", progress=False, method="ngram", prefix_cache=False)
    fed = {"target": [], "draft": []}
    for name, model in (("target", llm.target.model), ("draft", llm.drafter.model)):
        def counting(fb, cache, *args, inner=model.run, name=name, **kwargs):
            fed[name].append(fb.tokens.shape[1])
            return inner(fb, cache, *args, **kwargs)
        model.run = counting
    first = llm.tokenizer.encode(PROMPTS[0] * 3)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    out = llm.generate(first, params, num_speculative_tokens=3)[0]
    turn = first + out.token_ids + llm.tokenizer.encode(" and then")       # the next turn
    fed["target"].clear(), fed["draft"].clear()
    again = llm.generate(turn, params, num_speculative_tokens=3)[0]
    cached = (len(first) + len(out.token_ids) - 1) // 16 * 16              # the earlier turn's full blocks
    assert cached >= 32 and again.stats["cached_tokens"] == cached
    assert fed["target"][0] == fed["draft"][0] == len(turn) - 1 - cached    # the prefill passes: the rest only
    assert again.token_ids == plain.generate(turn, params, num_speculative_tokens=0)[0].token_ids
    assert again.stats["acceptance_rate"] == 1.0
