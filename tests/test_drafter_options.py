"""--drafter-option KEY=VALUE / LLM(**options): values parsed, keys checked against the method's
drafter (an unknown key names the accepted ones), passed through to the drafter."""
import argparse

import pytest

from specdecode.cli_common import CliError, drafter_option, drafter_options
from specdecode.drafters.base import DrafterError
from specdecode.drafters.registry import check_drafter_options, drafter_option_names


@pytest.mark.parametrize("text,expected", [("tree_topk=8", ("tree_topk", 8)), ("min_confidence=0.25", ("min_confidence", 0.25)),
                                           ("fast=false", ("fast", False)), ("drafter_path=/x/y", ("drafter_path", "/x/y")),
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
    with pytest.raises(CliError, match="needs --method"):
        drafter_options(argparse.Namespace(method=None, drafter_options=[("ngram_max", 3)]))
    assert drafter_options(argparse.Namespace(method=None, drafter_options=[])) == {}


def test_options_reach_the_drafter(tiny_models):
    from specdecode import LLM
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False, ngram_max=2)
    assert llm.drafter.ngram_max == 2


def test_draft_head_over_frequent_ids_is_lossless(tiny_models):
    """head_vocab: the draft model's LM head over the first token ids only; greedy output stays the
    target's, and a value that is not a multiple of 32 within the vocabulary is refused by name."""
    from specdecode import LLM, SamplingParams
    target, draft = str(tiny_models["llama"]), str(tiny_models["llama_draft"])
    llm = LLM(model=target, draft=draft, method="model", dtype="fp32", progress=False, head_vocab=64)
    assert llm.drafter.head_vocab == 64
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["hello world", "the quick brown fox"]
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    spec = llm.generate(prompts, params, num_speculative_tokens=4)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    with pytest.raises(DrafterError, match="head_vocab must be 0"):
        LLM(model=target, draft=draft, method="model", dtype="fp32", progress=False, head_vocab=100)
