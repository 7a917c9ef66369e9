"""--drafter-option KEY=VALUE / LLM(**options): values parsed, keys checked against the method's
drafter (an unknown key names the accepted ones), passed through to the drafter."""
import argparse

import pytest
import torch

from specdecode.cli_common import CliError, drafter_option, drafter_options
from specdecode.drafters.base import DrafterError
from specdecode.drafters.registry import check_drafter_options, drafter_option_names


@pytest.mark.parametrize("text,expected", [("tree_topk=8", ("tree_topk", 8)),
                                           ("min_confidence=0.25", ("min_confidence", 0.25)),
                                           ("fast=false", ("fast", False)),
                                           ("drafter_path=/x/y", ("drafter_path", "/x/y")),
                                           (" ngram_max = 4", ("ngram_max", 4))])
def test_values_are_parsed(text, expected):
    key, value = drafter_option(text)
    assert (key, value) == expected and type(value) is type(expected[1])


@pytest.mark.parametrize("text", ["tree_topk", "=3", "9x=1", "a b=1"])
def test_malformed_pairs_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        drafter_option(text)


def test_names_follow_the_class_hierarchy():
    names = drafter_option_names("eagle2")
    assert {"tree_topk", "tree_depth", "min_confidence", "drafter_path"} <= set(names)
    assert "target" not in names
    check_drafter_options("eagle2", {"tree_topk": 4})
    with pytest.raises(DrafterError, match="'bogus' is not one of method 'eagle2'.*tree_topk"):
        check_drafter_options("eagle2", {"bogus": 1})


def test_cli_checks_against_the_method():
    args = argparse.Namespace(method="ngram", drafter_options=[("ngram_max", 3)])
    assert drafter_options(args) == {"ngram_max": 3}
    with pytest.raises(CliError, match="tree_topk"):
        drafter_options(argparse.Namespace(method="ngram", drafter_options=[("tree_topk", 3)]))
    # no --method: checked against the default drafter (ngram; cascade with --draft)
    assert drafter_options(argparse.Namespace(method=None, drafter_options=[("ngram_max", 3)])) == {"ngram_max": 3}
    assert drafter_options(argparse.Namespace(method=None, draft="d.gguf", drafter=None,
                                              drafter_options=[("head_vocab", 32768)])) == {"head_vocab": 32768}
    with pytest.raises(CliError, match="'head_vocab' is not one of method 'ngram'"):
        drafter_options(argparse.Namespace(method=None, drafter_options=[("head_vocab", 3)]))
    with pytest.raises(CliError, match="needs a drafter"):
        drafter_options(argparse.Namespace(method="none", drafter_options=[("ngram_max", 3)]))
    assert drafter_options(argparse.Namespace(method=None, drafter_options=[])) == {}


def test_options_reach_the_drafter(tiny_models):
    from specdecode import LLM
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False, ngram_max=2)
    assert llm.drafter.ngram_max == 2


@pytest.mark.parametrize("rank", ["id", "corpus"])
def test_draft_head_over_frequent_ids_is_lossless(tiny_models, tmp_path, monkeypatch, rank):
    """head_vocab: the draft model's LM head over the most frequent token ids only (head_rank: id
    order, or counts over a text the user names); the end-of-generation id is always kept, draft
    probabilities live on the kept ids only, greedy output stays the target's; a size that is not a
    multiple of 32 within the vocabulary, or a corpus that does not exist, is refused by name."""
    from specdecode import LLM, SamplingParams
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 50)
    target, draft = str(tiny_models["llama"]), str(tiny_models["llama_draft"])
    head_rank = "id" if rank == "id" else str(tmp_path / "corpus.txt")
    llm = LLM(model=target, draft=draft, method="model", dtype="fp32", progress=False, head_vocab=64,
              head_rank=head_rank)
    kept = set(llm.drafter.head_rows.ids.tolist())
    assert len(kept) == 64 and set(llm.drafter.draft.eos_token_ids) <= kept
    if rank == "id":
        assert kept - set(llm.drafter.draft.eos_token_ids) <= set(range(64))
    else:
        assert set(llm.tokenizer.encode("the quick brown fox jumps over the lazy dog.")) <= kept
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["hello world", "the quick brown fox"]
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    spec = llm.generate(prompts, params, num_speculative_tokens=4)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    with pytest.raises(DrafterError, match="head_vocab must be 0"):
        LLM(model=target, draft=draft, method="model", dtype="fp32", progress=False, head_vocab=100)
    with pytest.raises(DrafterError, match="head_rank"):
        LLM(model=target, draft=draft, method="model", dtype="fp32", progress=False, head_vocab=64,
            head_rank=str(tmp_path / "missing.txt"))


def test_frequent_ids_ranks_by_counts_and_keeps_the_end(tmp_path, monkeypatch):
    """frequent_ids: the ids the corpus uses most, then unseen ids in id order; the ids to keep are
    always in; ascending; the counts are cached per vocabulary and corpus (a second call reads no
    text); the default corpus is the standard library with pydoc's English topics first."""
    from conftest import make_tokenizer

    from specdecode.drafters import vocab_rank
    from specdecode.tokenizer import Tokenizer
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    make_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("zebra " * 200 + "hello world " * 100)
    common = set(tok.encode("zebra hello world zebra"))
    ids = vocab_rank.frequent_ids(tok, tok.vocab_size, 32, str(corpus), keep=(2,))
    assert ids.tolist() == sorted(ids.tolist()) and len(ids) == 32
    assert common | {2} <= set(ids.tolist())
    counts = vocab_rank.token_counts(tok, tok.vocab_size, str(corpus))
    unseen = [i for i in range(tok.vocab_size) if counts[i] == 0 and i != 2]
    assert set(ids.tolist()) - common - {2} == set(unseen[:32 - len(common | {2})])
    reads = []
    monkeypatch.setattr(type(corpus), "read_bytes", lambda self: reads.append(self) or b"")
    assert torch.equal(vocab_rank.token_counts(tok, tok.vocab_size, str(corpus)), counts) and not reads
    assert vocab_rank.frequent_ids(tok, tok.vocab_size, 64, "id").tolist() == list(range(64))
    files = vocab_rank.default_corpus()
    assert files and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
