"""A draft model (drafters/model.py) needs the target's tokenizer: one with another tokenizer is
refused naming both models and the first token that differs (method text-model drafts through text:
test_cross_tokenizer.py); the same tokenizer with an embedding
table of another size works, greedy output equal to plain decoding both ways round."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import PROMPTS, check_seeded_alone_as_batched

from specdecode import LLM, SamplingParams
from specdecode.drafters.base import DrafterError

pytestmark = pytest.mark.usefixtures("one_thread")


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
        LLM(model=str(target), draft=str(draft), method="model", dtype="fp32", progress=False)
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
    import shutil

    from safetensors.torch import load_file, save_file
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


def test_seeded_sampled_request_same_alone_and_in_a_batch(tiny_models):
    """A draft model samples each row's drafts from the row's own generator, one number per draft the
    row keeps: a seeded sampled request gives the same text alone and beside a request whose draft
    size differs (its own shrinks near its max_tokens while the other's does not)."""
    llm = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama_draft"]), method="model", dtype="fp32",
              progress=False, adaptive=False)     # the draft model alone (cascade would mix in lookups)
    check_seeded_alone_as_batched(llm, PROMPTS)


def test_two_cores_sharing_a_draft_model_keep_their_own_rows(tiny_models):
    """The drafter keeps no per-row state of its own: each engine core's rows carry their core's
    draft cache (Sequence.drafter_state), so a second core built around the same drafter neither
    redirects the first's drafting nor receives its rows' entries."""
    from specdecode.engine import offline
    llm = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama_draft"]), dtype="fp32",
              progress=False, method="model", adaptive=False)
    ids = llm.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def run(core):
        return offline.run(core, [ids], [params])[0]
    first = offline.offline_core(llm.target, llm.drafter, 4, adaptive=False)
    alone = run(first)
    second = offline.offline_core(llm.target, llm.drafter, 4, adaptive=False)
    offline.prepare(second, 1, len(ids) + 16)       # made (and its caches handed out) after the first's
    again = run(first)
    counts = lambda out: (out.stats.steps, out.stats.drafted, out.stats.accepted_per_position)   # noqa: E731
    assert again.token_ids == alone.token_ids and counts(again) == counts(alone)     # drafted the same way
    assert alone.stats.accepted > 0
    draft = second.runner.draft_cache
    assert draft is not first.runner.draft_cache and draft.lengths == [0] * len(draft.lengths)
