"""Fill-in-the-middle (specdecode/fim.py): the format found in a vocabulary, the prompt it builds,
the middle ending at the format's stop tokens, speculation on and off giving the same middle."""
from __future__ import annotations

import json

import pytest
from conftest import FIM_SPECIALS, make_model, make_tokenizer

from specdecode import fim
from specdecode.params import ParamError, SamplingParams
from specdecode.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("fim") / "qwen", "qwen2", seed=21, layers=2, tie=False,
                      specials=tuple(FIM_SPECIALS))


def tokenizer_with(tmp_path, specials) -> Tokenizer:
    make_tokenizer(tmp_path, specials=tuple(specials))
    return Tokenizer(tmp_path)


@pytest.mark.parametrize("specials, name, suffix_first", [
    (FIM_SPECIALS, "qwen", False),
    (["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|file_separator|>"], "codegemma", False),
    (["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>", "<repo_name>"], "starcoder", False),
    (["▁<PRE>", "▁<MID>", "▁<SUF>", "▁<EOT>"], "codellama", False),
    (["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], "deepseek", False),
    (["[PREFIX]", "[SUFFIX]"], "codestral", True),
])
def test_each_family_is_detected_and_laid_out(tmp_path, specials, name, suffix_first):
    tok = tokenizer_with(tmp_path, specials)
    fmt = fim.detect(tok, eos_token_ids=(2,))
    assert fmt is not None and fmt.name == name and fmt.suffix_first == suffix_first
    assert 2 in fmt.stop_token_ids                      # the model's own end of text ends a middle too
    ids = fmt.prompt_ids(tok, "def add(a, b):\n", "\nprint(add(1, 2))\n")
    pre, suf = tok.encode("def add(a, b):\n", add_special=False), tok.encode("\nprint(add(1, 2))\n", add_special=False)
    if suffix_first:
        assert ids == [fmt.suffix] + suf + [fmt.prefix] + pre
    else:
        assert ids == [fmt.prefix] + pre + [fmt.suffix] + suf + [fmt.middle]


def test_no_fim_tokens_is_none(tmp_path):
    assert fim.detect(tokenizer_with(tmp_path, [])) is None


def test_other_files_go_before_the_current_one(tmp_path):
    tok = tokenizer_with(tmp_path, FIM_SPECIALS)
    fmt = fim.detect(tok)
    ids = fmt.prompt_ids(tok, "x = ", "\n", [("util.py", "def f(): pass\n")], filename="main.py")
    text = tok.decode(ids, skip_special=False)
    assert text == ("<|repo_name|>repo\n<|file_sep|>util.py\ndef f(): pass\n<|file_sep|>main.py\n"
                    "<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>")
    assert fmt.stop_token_ids[:2] == (tok.token_id("<|fim_pad|>"), tok.token_id("<|endoftext|>"))


def test_input_extra_is_checked():
    assert fim.check_extra([{"filename": "a.py", "text": "x"}]) == [("a.py", "x")]
    for bad in ([{"filename": "a.py"}], "x", [{"text": 3}], [{"text": "x"}] * (fim.MAX_EXTRA_FILES + 1)):
        with pytest.raises(ParamError, match="input_extra"):
            fim.check_extra(bad)


def test_infill_is_the_same_with_and_without_speculation(fim_model):
    from specdecode import LLM
    prefix, suffix = "def add(a, b):\n    return a + b\n\n", "\n\ndef add(a, b):\n    return a + b\n"
    params = SamplingParams(max_tokens=24, temperature=0)
    plain = LLM(model=str(fim_model), method="none", dtype="fp32", progress=False).infill(prefix, suffix, params)
    spec = LLM(model=str(fim_model), method="ngram", dtype="fp32", progress=False, adaptive=False)
    assert spec.infill(prefix, suffix, params).token_ids == plain.token_ids
    ids, stops = spec.fim_prompt(prefix, suffix)
    assert ids[0] == spec.tokenizer.token_id("<|fim_prefix|>") and ids[-1] == spec.tokenizer.token_id("<|fim_middle|>")
    # the middle ends at a FIM stop token, which the text leaves out
    pad = spec.tokenizer.token_id("<|fim_pad|>")
    out = spec.infill(prefix, suffix, SamplingParams(max_tokens=8, temperature=0, logit_bias={pad: 100}))
    assert out.token_ids == [pad] and out.finish_reason == "stop" and out.text == "" and pad in stops


def test_infill_without_fim_tokens_names_the_model(tiny_models):
    from specdecode import LLM
    llm = LLM(model=str(tiny_models["llama"]), method="none", dtype="fp32", progress=False)
    with pytest.raises(ParamError, match="no fill-in-the-middle tokens"):
        llm.infill("a", "b")


def test_stop_token_ids_end_the_output_even_with_ignore_eos(tiny_models):
    from specdecode import LLM
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False)
    free = llm.generate("the quick brown fox", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop = free.token_ids[3]
    cut = llm.generate("the quick brown fox", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                             stop_token_ids=[stop]))[0]
    assert cut.token_ids == free.token_ids[:free.token_ids.index(stop) + 1] and cut.finish_reason == "stop"
    with pytest.raises(ParamError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])


def test_generate_suffix_option(fim_model, tmp_path, capsys):
    from specdecode.cli import main
    (tmp_path / "after.py").write_text("\nprint(add(1, 2))\n")
    assert main(["generate", "def add(a, b):\n", "--model", str(fim_model), "--suffix", f"@{tmp_path / 'after.py'}",
                 "--max-tokens", "4", "--json", "--dtype", "fp32"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_tokens"] >= 1
    assert main(["generate", "x", "--suffix", "@/nonexistent/file.py"]) == 2
    assert "--suffix @/nonexistent/file.py: cannot read it" in capsys.readouterr().err
