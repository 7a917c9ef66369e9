"""A draft model with another tokenizer (drafters/cross_tokenizer.py): its drafts go through text.

Drafts: the tiny Llama target's own weights over a vocabulary of other ids (three more special tokens
first, so every id moves and three merges are missing: a draft that agrees with the target through
text only), and a random Qwen2 draft with a tokenizer trained on another corpus. Greedy and seeded
sampled outputs equal plain decoding, in batches too; sampled continuations keep the target's
distribution; a rejected draft rolls the draft cache back by characters."""
from __future__ import annotations

import json
import math
import shutil
from collections import Counter

import pytest
import torch
from conftest import PROMPTS, make_seq, run_engine

from specdecode import LLM, SamplingParams
from specdecode.drafters.base import DrafterError
from specdecode.drafters.registry import build_drafter
from specdecode.sampling import probs_from_logits, transform_logits

pytestmark = pytest.mark.usefixtures("one_thread")
OPTS = dict(dtype="fp32", progress=False)


def remap_vocabulary(target, draft) -> None:
    """Give `draft` (a folder with its own tokenizer) the target's weights, each embedding / LM-head row
    moved to the id its token has in the draft's vocabulary (tokens the target lacks: zero rows)."""
    from safetensors.torch import load_file, save_file

    from specdecode.tokenizer import Tokenizer
    old = {t: i for i, t in enumerate(Tokenizer(target).vocab_fingerprint())}
    new = Tokenizer(draft).vocab_fingerprint()
    weights = load_file(str(target / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            rows = torch.zeros_like(weights[name])
            for i, token in enumerate(new):
                if token in old:
                    rows[i] = weights[name][old[token]]
            weights[name] = rows
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(target / "config.json", draft / "config.json")


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory):
    import conftest
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    root = tmp_path_factory.mktemp("xtok")
    same = root / "same_weights"
    same.mkdir()
    conftest.make_tokenizer(same, specials=("<a>", "<b>", "<c>"))
    remap_vocabulary(tiny_models["llama"], same)
    other = conftest.make_model(root / "other", "qwen2", seed=7, layers=1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=conftest.SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["zebras eat grass in the zoo, " * 5, "def sub(x, y): return x - y"] * 4, trainer)
    tok.save(str(other / "tokenizer.json"))
    return {"same": same, "other": other}


@pytest.fixture(scope="module")
def xllm(tiny_models, drafts):
    """The tiny Llama with its remapped-vocabulary copy as draft (chosen by default), k drafted every step."""
    return LLM(model=str(tiny_models["llama"]), draft=str(drafts["same"]), method="text-model", adaptive=False, **OPTS)


def test_vocabularies_differ_and_default_picks_text_drafts(tiny_models, drafts):
    target = str(tiny_models["llama"])
    for draft in drafts.values():
        with pytest.raises(DrafterError, match="text-model"):
            LLM(model=target, draft=str(draft), method="model", **OPTS)
    llm = LLM(model=target, draft=str(drafts["other"]), **OPTS)
    assert llm.method == "cascade" and type(llm.drafter.head).__name__ == "TextModelDrafter"
    with pytest.raises(DrafterError, match="head_vocab must be 0"):
        LLM(model=target, draft=str(drafts["other"]), head_vocab=40, **OPTS)


def test_a_reduced_draft_head_drafts_from_its_own_frequent_ids(tiny_models, drafts):
    """head_vocab cuts the draft's LM head to ITS most used token ids: drafts only from those, the
    output still plain decoding's."""
    llm = LLM(model=str(tiny_models["llama"]), draft=str(drafts["same"]), method="text-model", adaptive=False,
              head_vocab=128, **OPTS)
    drafter = llm.drafter
    kept = set(drafter.head_rows.ids.tolist())
    assert len(kept) == 128
    seen = []
    real = drafter._pass
    drafter._pass = lambda state, rows, feed: seen.append(real(state, rows, feed)) or seen[-1]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(PROMPTS, params, num_speculative_tokens=0)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == plain
    best = {int(i) for logits in seen for i in logits.argmax(-1)}
    assert seen and best <= kept


@pytest.mark.parametrize("which", ["same", "other"])
def test_greedy_equals_plain_decoding_alone_and_batched(tiny_models, drafts, which):
    llm = LLM(model=str(tiny_models["llama"]), draft=str(drafts[which]), method="text-model", adaptive=False, **OPTS)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(PROMPTS, params, num_speculative_tokens=0)]
    for prompt, want in zip(PROMPTS, plain):                       # one row at a time
        assert llm.generate(prompt, params)[0].token_ids == want
    outs = llm.generate(PROMPTS, params)                           # a batch of rows
    assert [o.token_ids for o in outs] == plain
    accepted = sum(o.stats["accepted_tokens"] for o in outs)
    if which == "same":                                            # the target's weights: drafts agree often
        assert accepted > 0.5 * sum(o.stats["drafted_tokens"] for o in outs) > 0


def test_cascade_over_text_drafts_equals_plain(tiny_models, drafts):
    llm = LLM(model=str(tiny_models["llama"]), draft=str(drafts["same"]), adaptive=False, **OPTS)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(PROMPTS, params, num_speculative_tokens=0)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == plain
    assert llm.drafter.head_steps > 0


def test_seeded_sampling_equals_speculation_off(xllm):
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in range(4)]
    off = xllm.generate(PROMPTS, params, num_speculative_tokens=0)
    on = xllm.generate(PROMPTS, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert sum(o.stats["accepted_tokens"] for o in on) > 0


def test_chat_prompt_equals_plain(xllm):
    chat = [{"role": "user", "content": "def add(a, b):"}]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = xllm.generate(chat, params, num_speculative_tokens=0)[0].token_ids
    assert xllm.generate(chat, params)[0].token_ids == plain


def exact_joint(llm: LLM, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first three tokens) under plain sampling, every prefix with mass enumerated."""
    model, out = llm.target.model, {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == 3:
            out[tuple(prefix)] = prob
            return
        ids = torch.tensor([prompt + prefix])
        logits = model.forward(ids, model.new_cache(1, ids.shape[1] + 1), 0)[:, -1:]
        probs = probs_from_logits(transform_logits(logits, [params]), [params])[0, 0].double()
        for token in torch.nonzero(probs).flatten().tolist():
            walk(prefix + [token], prob * float(probs[token]))
    walk([], 1.0)
    return out


def test_sampled_continuations_keep_the_target_distribution(xllm, monkeypatch):
    """4000 seeded samples of three tokens (top_k 4) with text drafts: total variation from the exact
    joint within a bound that the same samples fail when the verifier accepts every point-mass draft."""
    prompt = xllm.encode("the quick brown fox", False)
    exact = exact_joint(xllm, prompt, SamplingParams(temperature=1.0, top_k=4, max_tokens=3))
    n = 4000
    bound = 0.5 * sum(math.sqrt(2 * q * (1 - q) / (math.pi * n)) for q in exact.values()) * 2   # twice the noise

    def tv(llm) -> tuple[float, float]:
        outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True,
                                                          seed=9000 + i) for i in range(n)], num_speculative_tokens=2)
        counts = Counter(tuple(o.token_ids) for o in outs)
        accepted = sum(o.stats["accepted_tokens"] for o in outs) / max(1, sum(o.stats["drafted_tokens"] for o in outs))
        return 0.5 * sum(abs(counts.get(s, 0) / n - exact.get(s, 0.0)) for s in set(exact) | set(counts)), accepted
    distance, acceptance = tv(xllm)
    assert distance < bound < 0.1 and 0.2 < acceptance < 0.95, (distance, bound, acceptance)
    from specdecode import verify_tree

    def accept_all(draft_tokens, parents, num_draft, target_probs, *args, **kwargs):   # a broken verifier
        result = real(draft_tokens, parents, num_draft, target_probs, *args, **kwargs)
        for b, n in enumerate(num_draft.tolist()):         # every draft kept, then the real last token
            last = result.tokens[b, int(result.num_accepted[b])].clone()
            result.tokens[b, :n], result.tokens[b, n] = draft_tokens[b, :n], last
            result.accepted_nodes[b, :n] = torch.arange(n)
        result.num_accepted[:] = num_draft
        result.num_emitted[:] = num_draft + 1
        return result
    real = verify_tree.verify_point_mass
    monkeypatch.setattr(verify_tree, "verify_point_mass", accept_all)
    assert tv(xllm)[0] > 2 * bound


def test_rollback_by_characters(tiny_models, drafts):
    """A proposal of which the target keeps a part: the draft cache keeps exactly the draft tokens
    inside the committed text, and the next proposal catches up on the rest and drafts after it."""
    from specdecode.models.loader import load_model
    target = load_model(str(tiny_models["llama"]), dtype="fp32", progress=False)
    draft = load_model(str(drafts["same"]), dtype="fp32", progress=False)
    drafter = build_drafter("text-model", target, draft=draft, draft_confidence=0.0)
    state = drafter.prepare(1, 128)
    tok, dtok = target.tokenizer, draft.tokenizer
    s = make_seq(1, tok.encode("the quick brown fox jumps over"), SamplingParams(), drafter_state=state)
    drafter.prefill([s])
    row = state.rows[0]
    assert row.dtext == row.text == "the quick brown fox jumps over" and state.cache.lengths[0] == len(row.ids)
    proposal = drafter.propose([s], [4])
    drafted = proposal.main_path(0)
    assert len(drafted) == 4
    assert tok.decode(s.token_ids + drafted).startswith(row.dtext)        # drafted text continues the cache's
    assert len(row.dtext) > len(row.text)                                 # the draft tokens fed are cached
    # the target keeps one draft and emits a token of its own that no draft token spells
    s.token_ids += drafted[:1] + [tok.encode("Z")[0]]
    drafter.commit([s], proposal, [1])
    committed = tok.decode(s.token_ids)
    assert row.text == committed and committed.startswith(row.dtext)
    assert state.cache.lengths[0] == len(row.ids) and dtok.decode(row.ids) == row.dtext
    assert len(row.dtext) >= len("the quick brown fox jumps over")        # the prompt's tokens stay
    kept = len(row.ids)
    nxt = drafter.propose([s], [3])
    assert dtok.decode(row.ids[:kept]) + committed[len(dtok.decode(row.ids[:kept])):] == committed
    assert row.text == committed and (row.dtext.startswith(committed) or committed.startswith(row.dtext))
    assert tok.decode(s.token_ids + nxt.main_path(0)).startswith(committed)
    assert state.cache.lengths[0] == len(row.ids) and dtok.decode(row.ids) == row.dtext
    state.reset(0)
    assert state.rows[0].ids == [] and state.cache.lengths[0] == 0


def test_the_draft_reads_a_long_prompt_s_recent_text_only(tiny_models, drafts):
    """A prompt longer than draft_context: the draft cache holds its last draft_context tokens (the
    text before them dropped from the row), drafts continue the prompt, and output equals plain."""
    from specdecode.models.loader import load_model
    target = load_model(str(tiny_models["llama"]), dtype="fp32", progress=False)
    draft = load_model(str(drafts["same"]), dtype="fp32", progress=False)
    with pytest.raises(DrafterError, match="draft_context must be an integer >= 8"):
        build_drafter("text-model", target, draft=draft, draft_context=4)
    drafter = build_drafter("text-model", target, draft=draft, draft_context=16)
    state = drafter.prepare(1, 256)
    tok, dtok = target.tokenizer, draft.tokenizer
    prompt = "the quick brown fox jumps over the lazy dog and " * 4
    s = make_seq(1, tok.encode(prompt), SamplingParams(), drafter_state=state)
    drafter.prefill([s])
    row = state.rows[0]
    assert len(row.ids) == state.cache.lengths[0] <= 17                # (a BOS where the draft adds one)
    assert prompt.endswith(row.text) and row.dtext == row.text and len(row.text) < len(prompt) // 2
    assert dtok.decode(row.ids, skip_special=True) == row.text
    assert tok.decode(s.token_ids + drafter.propose([s], [3]).main_path(0)).startswith(prompt)
    llm = LLM(model=str(tiny_models["llama"]), draft=str(drafts["same"]), method="text-model", adaptive=False,
              draft_context=16, **OPTS)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = llm.generate([prompt], params, num_speculative_tokens=0)[0].token_ids
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == plain and out.stats["accepted_tokens"] > 0


def test_vocabulary_overlap_in_info(tiny_models, drafts, capsys):
    from specdecode.cli import main
    assert main(["info", "--json", "--model", str(tiny_models["llama"]), "--draft", str(drafts["same"])]) == 0
    shared = json.loads(capsys.readouterr().out)["draft"]["vocabulary"]
    assert shared["target_tokens"] == shared["draft_tokens"] == 300
    vocab = [set(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
             for folder in (tiny_models["llama"], drafts["same"])]   # byte-level both: token strings are text
    assert shared["shared"] == len(vocab[0] & vocab[1]) == 297         # three specials, three merges apart


@pytest.mark.slow
def test_smollm2_target_with_a_tiny_draft_of_another_tokenizer(smollm2, drafts):
    """The embedded model as target, a tiny random draft of another vocabulary: identical output."""
    from specdecode.models.loader import load_model
    draft = load_model(str(drafts["other"]), dtype="fp32", progress=False)
    drafter = build_drafter("text-model", smollm2, draft=draft)
    tok = smollm2.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special=False)
               for q in ("Write a Python function that adds two numbers.", "What is the capital of France?")]
    params = [SamplingParams(max_tokens=24)] * 2
    plain = run_engine(smollm2, None, 0, prompts, params)
    spec = run_engine(smollm2, drafter, 4, prompts, params, adaptive=False)
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
    assert sum(s.stats.drafted for s in spec) > 0
