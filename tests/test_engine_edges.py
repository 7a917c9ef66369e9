"""Edge cases of the speculative loop, each checked against plain decoding (k = 0):
empty drafts, all drafts accepted (bonus token), EOS / stop strings / max_tokens inside an
accepted draft, the context limit, ragged batches, every sampling parameter under greedy,
seeded reproducibility, and the errors bad input must raise."""
from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch

from specdecode import LLM, ParamError, SamplingParams
from specdecode.drafters.base import DrafterError
from specdecode.models.config import ModelError

EOS = 2          # <|im_end|> in the tiny tokenizer (conftest)
PROMPTS = [
    "the quick brown fox jumps over the lazy dog. the quick brown fox",
    "def add(a, b):\n    return a + b\n",
    "Summarize the following text. The cat sat on the mat.",
    "1 2 3 4 5 6 7 8",
]
DRAFTERS = ["ngram", "model", "self"]



pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def llms(tiny_models):
    """Plain / ngram / draft-model / self-draft engines over the same tiny Llama target."""
    target = str(tiny_models["llama"])
    opts = dict(dtype="fp32", progress=False, adaptive=False)
    return {
        "ngram": LLM(model=target, method="ngram", **opts),
        "model": LLM(model=target, draft=str(tiny_models["llama_draft"]), method="model", **opts),
        "self": LLM(model=target, draft=target, method="model", draft_confidence=0.0, **opts),   # full chains
    }


_PLAIN: dict[str, list] = {}


def plain(llms, prompts, params):
    """Plain decoding (k = 0) of the target, memoized: many tests compare to the same runs."""
    key = repr((prompts, params))
    if key not in _PLAIN:
        _PLAIN[key] = llms["ngram"].generate(prompts, params, num_speculative_tokens=0)
    return _PLAIN[key]


def step_sizes(llm, prompts, params, k):
    """Run and record how many tokens each step appended, per row."""
    sizes: dict[int, list[int]] = {}

    def on_tokens(seq, tokens):
        sizes.setdefault(seq.request_id, []).append(len(tokens))
    out = llm.generate(prompts, params, num_speculative_tokens=k, on_tokens=on_tokens)
    return out, [sizes[i] for i in range(len(out))]


# --------------------------------------------------------------------------- drafts
def test_empty_draft_advances_one_token_per_step(tiny_models):
    """n-gram drafting that never finds a match: every step is a plain step (1 token)."""
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", ngram_min=16, ngram_max=16,
              dtype="fp32", progress=False)
    ids = list(range(3, 23))                       # 20 distinct tokens: no 16-gram can repeat
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    base = llm.generate([ids], params, num_speculative_tokens=0)[0]
    out, sizes = step_sizes(llm, [ids], params, k=5)
    assert out[0].token_ids == base.token_ids
    assert sizes[0] == [1] * 12
    assert out[0].stats["steps"] == 12 and out[0].stats["drafted_tokens"] == 0
    assert out[0].stats["mean_accepted_length"] == 1.0


def test_empty_and_full_drafts_in_one_batch(llms):
    """Rows with and without an n-gram match in the same step (ragged k) equal plain."""
    ids = [list(range(3, 23)), llms["ngram"].encode(PROMPTS[0], False)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    base = plain(llms, ids, params)
    out, sizes = step_sizes(llms["ngram"], ids, params, k=5)
    assert [o.token_ids for o in out] == [b.token_ids for b in base]
    assert sizes[0][0] == 1                        # no match for row 0 in the first step
    assert out[1].stats["drafted_tokens"] > 0


@pytest.mark.parametrize("k", [1, 5, 8])
def test_all_drafts_accepted_give_bonus_token(llms, k):
    """Self-draft: every draft is accepted, each step emits k drafts + 1 bonus token."""
    params = SamplingParams(max_tokens=3 * (k + 1), ignore_eos=True)
    base = plain(llms, PROMPTS, params)
    out, sizes = step_sizes(llms["self"], PROMPTS, params, k=k)
    for o, b, s in zip(out, base, sizes):
        assert o.token_ids == b.token_ids
        assert s == [k + 1] * 3
        assert o.stats["acceptance_rate"] == 1.0 and o.stats["steps"] == 3


# --------------------------------------------------------------------------- EOS
def eos_bias(llm, ids, positions=(2, 3, 4)):
    """A logit_bias on EOS that makes greedy decoding emit EOS exactly at output index j
    (one of `positions`, all inside a first draft of k = 5), or None."""
    n = max(positions) + 1
    tokens = llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True), num_speculative_tokens=0)[0].token_ids
    if EOS in tokens:
        return None
    model = llm.target.model
    logits = model.forward(torch.tensor([ids + tokens]), model.new_cache(1, len(ids) + n + 1), 0)[0]
    gaps = [float(logits[len(ids) - 1 + j].max() - logits[len(ids) - 1 + j, EOS]) for j in range(n)]
    for j in positions:
        before = min(gaps[:j])
        if before - gaps[j] > 0.01:              # EOS overtakes the argmax first at index j
            return j, (before + gaps[j]) / 2
    return None


@pytest.fixture(scope="module")
def eos_case(llms):
    for prompt in ["1 2 3 4 5", "the quick brown fox", "Summarize the following text.", "hello world"]:
        for chat in (False, True):
            ids = llms["ngram"].encode(prompt, chat)
            found = eos_bias(llms["ngram"], ids)
            if found:
                return ids, found[0], found[1]
    pytest.fail("no prompt lets a logit_bias place EOS inside the first draft")


@pytest.mark.parametrize("method", DRAFTERS)
def test_eos_inside_accepted_draft_stops_there(llms, eos_case, method):
    ids, j, bias = eos_case
    params = SamplingParams(max_tokens=30, logit_bias={EOS: bias})
    base = plain(llms, [ids], params)[0]
    assert base.token_ids[-1] == EOS and len(base.token_ids) == j + 1 and base.finish_reason == "stop"
    out, sizes = step_sizes(llms[method], [ids], params, k=5)
    assert out[0].token_ids == base.token_ids
    assert out[0].finish_reason == "stop" and out[0].text == base.text
    if method == "self":                           # EOS was draft j of the first (fully accepted) step
        assert sizes[0] == [j + 1] and out[0].stats["steps"] == 1
        assert out[0].stats["accepted_tokens"] == j + 1
    # ignore_eos: generation runs on past the EOS, still identical to plain
    params = SamplingParams(max_tokens=12, logit_bias={EOS: bias}, ignore_eos=True)
    assert (llms[method].generate([ids], params, num_speculative_tokens=5)[0].token_ids
            == plain(llms, [ids], params)[0].token_ids)


# --------------------------------------------------------------------------- stop strings
DIVERSE = dict(frequency_penalty=2.0, repetition_penalty=1.5)   # greedy output with varied tokens


@pytest.fixture(scope="module")
def stop_cases(llms):
    """(stop string, index of the token completing it, expected text) for stops that complete
    inside the first step of a k = 5 self-draft: one single-token and one two-token stop."""
    tok = llms["ngram"].tokenizer
    params = SamplingParams(max_tokens=20, ignore_eos=True, **DIVERSE)
    tokens = plain(llms, [PROMPTS[0]], params)[0].token_ids
    full = tok.decode(tokens)
    cases = {}
    for j in range(1, 6):
        for width in (1, 2):
            if width in cases or j - width + 1 < 0:
                continue
            head = tok.decode(tokens[:j - width + 1])
            piece = tok.decode(tokens[:j + 1])[len(head):]
            if (piece.strip() and piece.isprintable() and "\ufffd" not in piece
                    and full.startswith(head) and full.find(piece) == len(head)):
                cases[width] = (piece, j, head)
    assert set(cases) == {1, 2}, f"no stop strings found in {full!r}"
    return cases


@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("method", DRAFTERS)
def test_stop_string_inside_accepted_draft(llms, stop_cases, method, width):
    stop, j, expected_text = stop_cases[width]
    params = SamplingParams(max_tokens=20, stop=["@@never@@", stop], **DIVERSE)
    base = plain(llms, [PROMPTS[0]], params)[0]
    assert base.finish_reason == "stop" and base.text == expected_text and len(base.token_ids) == j + 1
    out, sizes = step_sizes(llms[method], [PROMPTS[0]], params, k=5)
    assert out[0].token_ids == base.token_ids
    assert out[0].text == expected_text and stop not in out[0].text
    assert out[0].finish_reason == "stop"
    if method == "self":
        assert sizes[0] == [j + 1]


# --------------------------------------------------------------------------- max_tokens
@pytest.mark.parametrize("method", DRAFTERS)
def test_max_tokens_reached_mid_draft(llms, method):
    base = plain(llms, PROMPTS, SamplingParams(max_tokens=7, ignore_eos=True))
    for max_tokens in range(1, 8):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        out, sizes = step_sizes(llms[method], PROMPTS, params, k=5)
        for o, b, s in zip(out, base, sizes):
            assert o.token_ids == b.token_ids[:max_tokens], (method, max_tokens)
            assert o.finish_reason == "length" and sum(s) == max_tokens
            assert o.stats["num_tokens"] == max_tokens
        if method == "self":
            assert sizes[0] == [min(6, max_tokens)] + ([max_tokens - 6] if max_tokens > 6 else [])
    # all seven budgets as rows of one batch (rows finish at different steps)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in range(1, 8)]
    out = llms[method].generate([PROMPTS[0]] * 7, params, num_speculative_tokens=5)
    assert [o.token_ids for o in out] == [base[0].token_ids[:m] for m in range(1, 8)]


# --------------------------------------------------------------------------- context limit
@pytest.mark.parametrize("method", DRAFTERS)
def test_prompt_near_context_limit(llms, method):
    llm = llms[method]
    context = llm.target.model.max_len
    assert context == 256
    rng = random.Random(0)
    ids = [rng.randrange(3, 290) for _ in range(250)]
    params = SamplingParams(max_tokens=context - len(ids), ignore_eos=True)
    base = plain(llms, [ids], params)[0]
    assert len(base.token_ids) == 6
    for k in (5, 8, 32):                            # k larger than the room left
        out = llm.generate([ids], params, num_speculative_tokens=k)[0]
        assert out.token_ids == base.token_ids, k
        assert out.finish_reason == "length"
    # the same row next to a short one (the batch context is set by the long row)
    short = SamplingParams(max_tokens=20, ignore_eos=True)
    out = llm.generate([ids, PROMPTS[1]], [params, short], num_speculative_tokens=8)
    assert out[0].token_ids == base.token_ids
    assert out[1].token_ids == plain(llms, [PROMPTS[1]], short)[0].token_ids
    too_long = SamplingParams(max_tokens=context - len(ids) + 1, ignore_eos=True)
    with pytest.raises(ParamError) as err:
        llm.generate([ids], too_long, num_speculative_tokens=5)
    assert "250" in str(err.value) and "7" in str(err.value) and "256" in str(err.value)


# --------------------------------------------------------------------------- ragged batches
@pytest.mark.parametrize("method", DRAFTERS)
def test_rows_finishing_at_different_times(llms, eos_case, method):
    eos_ids, j, bias = eos_case
    prompts = PROMPTS + [eos_ids, PROMPTS[0]]
    params = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=17, ignore_eos=True),
              SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=9, ignore_eos=True),
              SamplingParams(max_tokens=30, logit_bias={EOS: bias}),            # stops on EOS
              SamplingParams(max_tokens=11, ignore_eos=True, **DIVERSE)]        # penalties in one row
    out = llms[method].generate(prompts, params, num_speculative_tokens=4)
    for prompt, p, o in zip(prompts, params, out):
        alone = llms[method].generate([prompt], p, num_speculative_tokens=4)[0]
        assert o.token_ids == alone.token_ids
        assert o.token_ids == plain(llms, [prompt], p)[0].token_ids
        assert o.finish_reason == alone.finish_reason
    assert [len(o.token_ids) for o in out] == [3, 17, 1, 9, j + 1, 11]


# --------------------------------------------------------------------------- every parameter
GREEDY_VARIANTS = {
    "repetition_penalty": dict(repetition_penalty=1.3),
    "presence_penalty": dict(presence_penalty=0.5),
    "frequency_penalty": dict(frequency_penalty=0.3),
    "logit_bias": dict(logit_bias={16: -4.0, 23: -4.0, 201: 2.5, 40: 3.0}),
    "min_p": dict(min_p=0.2, top_k=3, top_p=0.5),   # filters are no-ops under greedy
    "all": dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                logit_bias={16: -4.0, 201: 2.5}, min_p=0.1),
}


@pytest.mark.parametrize("variant", list(GREEDY_VARIANTS))
@pytest.mark.parametrize("method", DRAFTERS)
def test_greedy_lossless_for_every_parameter(llms, method, variant):
    params = SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY_VARIANTS[variant])
    base = plain(llms, PROMPTS, params)
    for k in (2, 5):
        out = llms[method].generate(PROMPTS, params, num_speculative_tokens=k)
        assert [o.token_ids for o in out] == [b.token_ids for b in base], (method, variant, k)
    if method == "self":
        assert all(o.stats["acceptance_rate"] == 1.0 for o in out)


def test_mixed_parameters_in_one_batch(llms):
    """Rows with and without penalties / bias side by side, each equal to its plain run."""
    params = [SamplingParams(max_tokens=25, ignore_eos=True, **v) for v in GREEDY_VARIANTS.values()]
    prompts = (PROMPTS * 2)[:len(params)]
    for method in DRAFTERS:
        out = llms[method].generate(prompts, params, num_speculative_tokens=4)
        for prompt, p, o in zip(prompts, params, out):
            assert o.token_ids == plain(llms, [prompt], p)[0].token_ids, method


# --------------------------------------------------------------------------- seeded sampling
@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("method", ["ngram", "model"])
def test_seeded_sampling_is_reproducible(llms, method, k):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    first = llms[method].generate(PROMPTS, params, num_speculative_tokens=k)
    again = llms[method].generate(PROMPTS, params, num_speculative_tokens=k)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    other = llms[method].generate(PROMPTS, dataclasses.replace(params, seed=99), num_speculative_tokens=k)
    assert [o.token_ids for o in first] != [o.token_ids for o in other]


# --------------------------------------------------------------------------- bad input
BAD_PARAMS = [
    ("temperature", -1.0), ("temperature", float("nan")), ("temperature", "1"), ("temperature", 101.0),
    ("top_k", -1), ("top_k", 1.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("inf")),
    ("min_p", -0.1), ("min_p", 1.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", 11.0), ("repetition_penalty", float("nan")),
    ("presence_penalty", 2.5), ("presence_penalty", float("inf")),
    ("frequency_penalty", -2.5), ("frequency_penalty", "x"),
    ("logit_bias", [1, 2]), ("logit_bias", {-1: 1.0}), ("logit_bias", {"x": 1.0}), ("logit_bias", {1: 200.0}),
    ("logit_bias", {1: float("nan")}),
    ("seed", -1), ("seed", 2**63), ("seed", 1.5), ("seed", "7"),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0), ("max_tokens", True),
    ("stop", [""]), ("stop", ["a"] * 17), ("stop", [1]),
    ("stop", 5), ("ignore_eos", "yes"), ("structured", {"type": "object"}), ("structured", "json"),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("prediction", ""), ("prediction", 3),
]


def test_bad_params_cover_every_field():
    assert {name for name, *_ in (p.values if hasattr(p, "values") else p for p in BAD_PARAMS)} == \
        {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("name,value", BAD_PARAMS)
def test_bad_sampling_param_names_the_parameter(name, value):
    with pytest.raises(ParamError) as err:
        SamplingParams(**{name: value})
    assert name in str(err.value)


@pytest.mark.parametrize("k", [-1, 33, 2.0, "5"])
def test_bad_num_speculative_tokens(tiny_models, llms, k):
    with pytest.raises(ParamError, match="num_speculative_tokens"):
        LLM(model=str(tiny_models["llama"]), num_speculative_tokens=k, dtype="fp32", progress=False)
    with pytest.raises(ParamError, match="num_speculative_tokens"):
        llms["ngram"].generate(PROMPTS[0], SamplingParams(max_tokens=2), num_speculative_tokens=k)


@pytest.mark.parametrize("k", [0, 5])
def test_unknown_method(tiny_models, k):
    with pytest.raises(DrafterError, match="nosuch"):
        LLM(model=str(tiny_models["llama"]), method="nosuch", num_speculative_tokens=k, dtype="fp32", progress=False)


def test_method_model_needs_a_draft(tiny_models):
    with pytest.raises(DrafterError, match="draft"):
        LLM(model=str(tiny_models["llama"]), method="model", dtype="fp32", progress=False)


def _vocab(folder):
    from specdecode.tokenizer import Tokenizer
    return Tokenizer(folder).vocab_fingerprint()


@pytest.fixture(scope="module")
def other_tokenizer_models(tiny_models, tmp_path_factory):
    """Drafts whose tokenizer differs from the targets': one trained on another corpus
    (same size), one trained on the same corpus with vocab_size 280."""
    import conftest
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    root = tmp_path_factory.mktemp("other_tok")
    other = conftest.make_model(root / "other_corpus", "llama", seed=5, layers=1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["zebras eat grass in the zoo, " * 5, "xylophones play 9 8 7 6 5 quietly"] * 4, trainer)
    tok.save(str(other / "tokenizer.json"))
    small = conftest.make_model(root / "vocab280", "llama", seed=6, layers=1)
    conftest.make_tokenizer(small, vocab_size=280)     # model keeps 300 embedding rows
    return {"other_corpus": other, "vocab280": small}


@pytest.mark.parametrize("which", ["other_corpus", "vocab280"])
def test_draft_with_another_tokenizer(tiny_models, other_tokenizer_models, which):
    target, draft = tiny_models["llama"], other_tokenizer_models[which]
    with pytest.raises(DrafterError) as err:
        LLM(model=str(target), draft=str(draft), dtype="fp32", progress=False)
    message = str(err.value)
    assert str(target) in message and str(draft) in message
    a, b = _vocab(target), _vocab(draft)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is not None:
        assert f"token {first} " in message and repr(a[first]) in message and repr(b[first]) in message
    else:
        assert f"{len(b)} vs {len(a)}" in message
    if which == "other_corpus":
        assert first is not None


def test_draft_with_padded_embedding_table(tiny_models, tmp_path):
    """Same tokenizer, different embedding-table sizes (e.g. Qwen2.5-0.5B 151936 rows vs
    Qwen2.5-7B 152064): works, and greedy output equals plain, both ways round."""
    from safetensors.torch import load_file, save_file
    import shutil
    results = {}
    for rows in (320, 296):                        # 296 < 300: the draft cannot embed tokens 296..299
        folder = tmp_path / f"rows{rows}"
        shutil.copytree(tiny_models["llama_draft"], folder)
        config = json.loads((folder / "config.json").read_text())
        config["vocab_size"] = rows
        (folder / "config.json").write_text(json.dumps(config))
        weights = load_file(str(folder / "model.safetensors"))
        embed = weights["model.embed_tokens.weight"]
        weights["model.embed_tokens.weight"] = torch.cat(
            [embed, torch.randn(max(0, rows - embed.shape[0]), embed.shape[1]) * 0.05])[:rows].contiguous()
        weights.pop("lm_head.weight", None)
        save_file(weights, str(folder / "model.safetensors"))
        llm = LLM(model=str(tiny_models["llama"]), draft=str(folder), dtype="fp32", progress=False,
                  adaptive=False)          # drafts every step (tiny draft ~ the target: the budget would not)
        ids = [[3, 299, 297, 296, 298, 10, 299], llm.encode(PROMPTS[0], False)]   # tokens >= 296 included
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        out = llm.generate(ids, params, num_speculative_tokens=4)
        base = llm.generate(ids, params, num_speculative_tokens=0)
        assert [o.token_ids for o in out] == [b.token_ids for b in base]
        sampled = llm.generate(ids, SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True,
                                                   logit_bias={299: 1.0}), num_speculative_tokens=4)
        assert all(len(o.token_ids) == 12 and max(o.token_ids) < 300 for o in sampled)
        results[rows] = out[1].stats["drafted_tokens"]
    assert all(n > 0 for n in results.values())


def test_missing_model_path(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ModelError, match="no_such_model"):
        LLM(model=str(missing), dtype="fp32", progress=False)


def test_text_file_as_model(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("not a model")
    with pytest.raises(ModelError, match="weights.txt"):
        LLM(model=str(path), dtype="fp32", progress=False)


def test_missing_draft_path(tiny_models, tmp_path):
    with pytest.raises(ModelError, match="nodraft"):
        LLM(model=str(tiny_models["llama"]), draft=str(tmp_path / "nodraft"), dtype="fp32", progress=False)


def test_logit_bias_outside_vocab(llms):
    vocab = llms["ngram"].target.model.config.vocab_size
    with pytest.raises(ParamError) as err:
        llms["ngram"].generate(PROMPTS[0], SamplingParams(max_tokens=3, logit_bias={vocab: 1.0}))
    assert str(vocab) in str(err.value) and "logit_bias" in str(err.value)
    # the last id is fine
    llms["ngram"].generate(PROMPTS[0], SamplingParams(max_tokens=3, logit_bias={vocab - 1: 1.0}))


def test_bad_prompts(llms):
    llm = llms["model"]
    with pytest.raises(ParamError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=3))
    with pytest.raises(ParamError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=3))
    with pytest.raises(ParamError, match="at least one prompt"):
        llm.generate([], SamplingParams(max_tokens=3))
    with pytest.raises(ParamError, match="vocabulary"):
        llm.generate([[5, 300]], SamplingParams(max_tokens=3))
    with pytest.raises(ParamError, match="vocabulary"):
        llm.generate([[-1, 5]], SamplingParams(max_tokens=3))
    with pytest.raises(ParamError, match="sampling_params"):
        llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=3)])


def test_single_token_id_prompt(llms):
    """A bare list of token ids is one prompt (not a list of prompts)."""
    ids = llms["ngram"].encode(PROMPTS[1], False)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    one = llms["model"].generate(ids, params)
    assert len(one) == 1 and one[0].prompt_token_ids == ids
    assert one[0].token_ids == llms["model"].generate([ids], params)[0].token_ids


def test_max_tokens_one_with_draft_model(tiny_models):
    """First call of a fresh drafter where no step has room for drafts (max_tokens = 1)."""
    llm = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama_draft"]), dtype="fp32", progress=False)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    out = llm.generate(PROMPTS, params, num_speculative_tokens=5)
    assert [len(o.token_ids) for o in out] == [1] * len(PROMPTS)
    assert math.isclose(out[0].stats["mean_accepted_length"], 1.0)


@pytest.mark.parametrize("top", [1, 3])
def test_a_drafter_reading_the_targets_top_k_gets_it_at_every_position(tiny_models, top):
    """A drafter that declares needs_target_topk gets, every step, the target's top-k token ids at
    each scored position, best first; for greedy rows the top-1 is the argmax the step already took
    (not scanned again: a scan cost lookahead ~20 us a step), and it is the token the step emits."""
    from specdecode.drafters.base import DraftProposal, Drafter, DrafterCapabilities
    from specdecode.drafters.registry import register, unregister

    class TopRecorder(Drafter):
        capabilities = DrafterCapabilities(needs_target_topk=top, relative_cost=0.01)
        seen: list[torch.Tensor] = []

        def __init__(self, target, **_) -> None:
            pass

        def propose(self, seqs, max_tokens):
            return DraftProposal.empty(len(seqs))

        def observe_topk(self, seqs, proposal, topk_ids):
            TopRecorder.seen.append(topk_ids.clone())

    register("top-recorder")(TopRecorder)
    try:
        llm = LLM(model=str(tiny_models["llama"]), method="top-recorder", num_speculative_tokens=2, dtype="fp32",
                  progress=False, adaptive=False)
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    finally:
        unregister("top-recorder")
    seen = TopRecorder.seen
    assert len(seen) == 6 and all(t.shape == (1, 1, top) for t in seen)
    assert [int(t[0, 0, 0]) for t in seen] == out.token_ids            # position 0's best: the emitted token
