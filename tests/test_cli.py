"""The command line, run as users run it: `python -m specdecode.cli generate ...` in a
subprocess against the tiny model directories. Good runs print the documented JSON / the
streamed text; bad arguments exit with code 2 and a one-line error, never a traceback.

Every subprocess pays for importing torch, so all commands are started up front, two at a
time (one torch thread each), and the tests read their results."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from specdecode import SamplingParams

ENV = {k: v for k, v in os.environ.items() if k != "SPECDECODE_DEBUG"}
ENV.update(OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
JSON_KEYS = {"text", "tokens", "tokens_per_s", "acceptance_rate", "mean_accepted_length"}
COMPARE_KEYS = {"baseline_tokens_per_s", "speedup", "identical"}
MAX_TOKENS = 16


class Run:
    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        self.returncode = proc.returncode
        # bytes -> str by hand: text mode would turn a generated "\r" into "\n"
        self.stdout = proc.stdout.decode("utf-8")
        self.stderr = proc.stderr.decode("utf-8")


def cli(args: list[str], stdin: str | None = None) -> Run:
    proc = subprocess.run([sys.executable, "-m", "specdecode.cli", "generate", *args], env=ENV,
                          input=None if stdin is None else stdin.encode(), capture_output=True, timeout=300)
    return Run(proc)


@pytest.fixture(scope="module")
def paths(tiny_models, tmp_path_factory):
    txt = tmp_path_factory.mktemp("cli") / "model.txt"
    txt.write_text("not a model")
    return {"model": str(tiny_models["llama"]), "draft": str(tiny_models["llama_draft"]), "txt": str(txt),
            "missing": str(txt.parent / "no_such_model")}


def commands(paths) -> dict[str, tuple[list[str], str | None]]:
    model = paths["model"]
    common = ["--model", model, "--max-tokens", str(MAX_TOKENS), "--dtype", "fp32", "--threads", "1", "--eager"]
    return {
        # good runs
        "json_compare": (["the quick brown fox", "--no-chat", "--json", "--compare", "--draft", paths["draft"],
                          "-k", "3", *common], None),
        "json_chat": (["hello there", "--chat", "--json", *common], None),
        "stream_chat": (["hello there", "--chat", "--compare", *common], None),
        "stdin_no_stream": (["-", "--no-chat", "--no-stream", "--method", "none", *common], "1 2 3 4 5"),
        "default_path": (["the quick brown fox", "--no-chat", "--json", "--model", model, "--max-tokens", "6"], None),
        # our own errors: one line "specdecode: error: ..."
        "missing_model": (["hi", "--model", paths["missing"]], None),
        "txt_model": (["hi", "--model", paths["txt"]], None),
        "model_without_draft": (["hi", "--model", model, "--method", "model"], None),
        "temperature": (["hi", "--model", model, "--temperature", "-1"], None),
        "top_p": (["hi", "--model", model, "--top-p", "2"], None),
        "dtype_int8": (["hi", "--model", model, "--dtype", "int8"], None),   # models/dtypes.py DtypeAction
        # argparse usage errors
        "k_99": (["hi", "--model", model, "-k", "99"], None),
        "k_40": (["hi", "--model", model, "-k", "40"], None),                  # the default drafter: chains
        "k_40_none": (["hi", "--model", model, "-k", "40", "--method", "none"], None),
        "k_40_tree": (["hi", "--model", paths["missing"], "-k", "40", "--method", "suffix"], None),  # passes
        "max_tokens_0": (["hi", "--model", model, "--max-tokens", "0"], None),
    }


@pytest.fixture(scope="module")
def runs(paths) -> dict[str, Future]:
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(cli, args, stdin) for name, (args, stdin) in commands(paths).items()}
    yield futures
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def reference(paths):
    """Plain greedy decoding in-process, what the CLI's outputs must equal."""
    import torch

    from specdecode import LLM
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(model=paths["model"], dtype="fp32", progress=False)
        params = SamplingParams(max_tokens=MAX_TOKENS)
        return {"fox": llm.generate("the quick brown fox", params, num_speculative_tokens=0)[0],
                "chat": llm.generate("hello there", params, chat=True, num_speculative_tokens=0)[0],
                "digits": llm.generate("1 2 3 4 5", params, num_speculative_tokens=0)[0]}
    finally:
        torch.set_num_threads(threads)


def ok(run: Run) -> Run:
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    return run


def test_json_with_compare(runs, reference):
    run = ok(runs["json_compare"].result())
    assert len(run.stdout.strip().splitlines()) == 1           # one JSON object on stdout, nothing else
    out = json.loads(run.stdout)
    assert JSON_KEYS | COMPARE_KEYS <= set(out)
    assert out["identical"] is True                           # greedy: speculation changes nothing
    assert out["method"] == "cascade" and out["k"] == 3                # the default with --draft
    assert out["tokens"] == reference["fox"].token_ids and out["text"] == reference["fox"].text
    assert out["tokens_per_s"] > 0 and out["baseline_tokens_per_s"] > 0 and out["speedup"] > 0
    low, high = out["speedup_spread"]                         # alternating pairs, their spread printed too
    assert out["timed_runs"] >= 3 and 0 < low <= high and isinstance(out["within_noise"], bool)
    assert 0.0 <= out["acceptance_rate"] <= 1.0 and 1.0 <= out["mean_accepted_length"] <= 4.0


def test_json_chat(runs, reference):
    out = json.loads(ok(runs["json_chat"].result()).stdout)
    assert JSON_KEYS <= set(out) and not COMPARE_KEYS & set(out)
    assert out["method"] == "ngram"
    assert out["tokens"] == reference["chat"].token_ids      # the chat template was applied
    assert out["tokens"] != reference["fox"].token_ids


def test_streaming_prints_the_text(runs):
    text = json.loads(ok(runs["json_chat"].result()).stdout)["text"]
    run = ok(runs["stream_chat"].result())
    assert run.stdout == text + "\n"
    assert "identical output: yes" in run.stderr and "tok/s" in run.stderr
    assert "alternating runs each, pairs" in run.stderr


def test_prompt_from_stdin_without_streaming(runs, reference):
    run = ok(runs["stdin_no_stream"].result())
    assert run.stdout == reference["digits"].text + "\n"
    assert "[none] " in run.stderr and "k=" not in run.stderr       # no k where nothing drafts


def test_default_path(runs):
    """Without --eager / --threads / --dtype (the fast kernels, bf16)."""
    run = runs["default_path"].result()
    if run.returncode != 0 and "specdecode.fast" in run.stderr and "ImportError" in run.stderr:
        pytest.skip(f"fast kernels not available yet: {run.stderr.strip()}")
    out = json.loads(ok(run).stdout)
    assert JSON_KEYS <= set(out) and 1 <= len(out["tokens"]) <= 6


@pytest.mark.parametrize("name,words", [
    ("missing_model", ["no_such_model"]),
    ("txt_model", ["model.txt", ".gguf"]),
    ("model_without_draft", ["--draft"]),
    ("temperature", ["--temperature", "-1"]),
    ("top_p", ["--top-p", "2"]),
    ("dtype_int8", ["--dtype", "'int8'", "bfloat16 (bf16)"]),
])
def test_bad_argument_is_one_line(runs, name, words):
    run = runs[name].result()
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdecode: error:"), run.stderr
    assert all(w in lines[0] for w in words), lines[0]


@pytest.mark.parametrize("name,option", [
    ("k_99", "-k 99: at most 64"),
    ("k_40", "-k 40: method 'ngram' drafts chains of at most 32"),
    ("k_40_none", "-k 40: --method none drafts nothing"),
    ("max_tokens_0", "--max-tokens"),
])
def test_bad_argument_usage_error(runs, name, option):
    run = runs[name].result()
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
    lines = run.stderr.splitlines()
    assert lines[0].startswith("usage: specdecode generate")
    assert "error:" in lines[-1] and option in lines[-1], lines[-1]


def test_k_within_a_tree_drafters_limit_passes_the_parser(runs, paths):
    """-k 40 with a tree drafter is within its limit: the run goes on to load the (missing) model."""
    run = runs["k_40_tree"].result()
    assert run.returncode == 2 and "model not found" in run.stderr and "-k" not in run.stderr, run.stderr


def test_the_stats_line_says_why_the_answer_ended(runs):
    """A --max-tokens cut is said on the stats line (it was silent), as the JSON's finish_reason."""
    stats = ok(runs["stream_chat"].result()).stderr.splitlines()
    finish = json.loads(ok(runs["json_chat"].result()).stdout)["finish_reason"]
    line = next(line for line in stats if line.startswith("[ngram k=5]"))
    assert f"finish_reason {finish}" in line, line
    assert ("cut at --max-tokens 16" in line) == (finish == "length"), line


def test_version_and_python_m():
    """`specdecode --version` and `python -m specdecode` (specdecode/__main__.py)."""
    import re
    from pathlib import Path

    import specdecode
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    assert specdecode.__version__ == version
    run = subprocess.run([sys.executable, "-m", "specdecode", "--version"], env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"specdecode {version}", run
    run = subprocess.run([sys.executable, "-m", "specdecode", "generate", "hi", "-k", "99"], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "usage: specdecode generate" in run.stderr, run.stderr


def test_api_refuses_bad_inputs_by_name():
    """Unknown drafter options, prompts and sampling_params of the wrong type, chat messages without
    content and text that is not valid UTF-8 are one ParamError / DrafterError naming them."""
    from specdecode import LLM
    from specdecode.drafters.base import DrafterError
    from specdecode.params import ParamError
    with pytest.raises(DrafterError, match="'ngram_max' is not one of method 'suffix'"):
        LLM(method="suffix", ngram_max=3, progress=False)
    with pytest.raises(DrafterError, match="needs a drafter"):
        LLM(method="none", ngram_max=3, progress=False)
    llm = LLM(progress=False)
    for args, match in [((None,), "prompts must be"), ((123,), "prompts must be"),
                        (("Hi", {"max_tokens": 4}), "sampling_params must be a SamplingParams"),
                        (([{"role": "user"}],), "chat message 0"), (("Hi \udcff",), "not valid UTF-8"),
                        (([1, "a"],), "prompt 0 must be text, a list of token ids"),
                        (([[1, "a"]],), "prompt 0 must be text, a list of token ids"),
                        (("Hi", None, False, None, 5), "on_tokens must be a callable")]:
        with pytest.raises(ParamError, match=match):
            llm.generate(*args)
    plain = LLM(num_speculative_tokens=0, progress=False)          # no drafter built: k > 0 later is an error
    with pytest.raises(ParamError, match="num_speculative_tokens=5 needs a drafter"):
        plain.generate("Hi", num_speculative_tokens=5)


def test_a_broken_model_directory_is_one_clear_error(tiny_models, tmp_path):
    """A config.json that is not JSON or misses a field, weights that are not safetensors: a
    ModelError naming the file (was an internal error naming only the exception's type)."""
    import shutil

    from specdecode import LLM
    from specdecode.models.config import ModelError
    good = tiny_models["llama"]
    for name, damage, match in [
            ("notjson", lambda d: (d / "config.json").write_text("{bad"), r"config.json is not JSON"),
            ("nofield", lambda d: (d / "config.json").write_text(json.dumps(
                {k: v for k, v in json.loads((good / "config.json").read_text()).items()
                 if k != "num_attention_heads"})), r"config.json has no 'num_attention_heads'"),
            ("garbage", lambda d: (d / "model.safetensors").write_bytes(b"garbage" * 10),
             r"model.safetensors is not a readable safetensors file")]:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        damage(folder)
        with pytest.raises(ModelError, match=match):
            LLM(model=str(folder), progress=False, dtype="fp32")


def test_cli_bad_inputs_are_one_line_errors(tmp_path):
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe")
    bad_schema = tmp_path / "bad.json"
    bad_schema.write_text('{"type": "objec"}')
    for args, match in [(["--drafter-option", "ngram_max=abc", "hi"], "ngram_max must be an integer"),
                        (["--json-schema", str(binary), "hi"], "is not UTF-8 text"),
                        (["--json-schema", "-", "-"], "cannot both be read from stdin"),
                        (["--prediction", "-", "-"], "cannot both be read from stdin"),
                        (["--method", "ngram", "--draft", "x.gguf", "hi"],
                         "--draft x.gguf: method 'ngram' does not use"),
                        (["--method", "suffix", "--drafter", "d", "hi"], "--drafter d: method 'suffix' does not use"),
                        (["--json-schema", str(bad_schema), "hi"], "--json-schema: invalid json_schema: Invalid type"),
                        (["--max-tokens", "8000", "hi " * 400], "--max-tokens (8000) exceeds")]:
        r = cli(["--threads", "1", *args], stdin="x")
        assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_a_missing_flagship_file_says_how_to_get_it(capsys, monkeypatch, tmp_path):
    """The Qwen2.5-Coder pair the docs run is not shipped: its "model not found" names the script that
    fetches it (and that script fetches exactly those files)."""
    from pathlib import Path

    from specdecode.cli import main
    from specdecode.models.loader import FETCHED_MODELS
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    root = Path(__file__).resolve().parent.parent
    script = root / "scripts" / "setup" / "get_models.sh"
    if not script.parent.is_dir():                    # until scripts/ is regrouped (docs/layout.md)
        script = root / "scripts" / "get_models.sh"
    assert all(name in script.read_text() for name in FETCHED_MODELS)
    for name in FETCHED_MODELS:
        assert main(["generate", "hi", "--model", str(tmp_path / "models" / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("specdecode: error: model not found:") and len(err.splitlines()) == 1, err
        assert "bash scripts/setup/get_models.sh" in err and str(tmp_path / "models") in err, err
    assert main(["generate", "hi", "--model", str(tmp_path / "mine.gguf")]) == 2
    err = capsys.readouterr().err
    assert "model not found" in err and "get_models" not in err, err
