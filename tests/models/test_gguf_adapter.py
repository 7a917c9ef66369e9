"""GGUF files of architectures without a native decoder run through the transformers adapter
(converted once by transformers, then HFAdapter); files neither can read, and damaged files, are
one clear error naming the file."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.models.config import ModelError

sys.path.insert(0, str(Path(__file__).parents[1]))
from gguf_writer import write_gguf  # noqa: E402

EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private conversion cache for this module (models/gguf.py cache_root)."""
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(folder))
        yield folder


def tiny_gpt2(folder: Path, skip: tuple[str, ...] = ()) -> tuple[Path, torch.nn.Module]:
    from conftest import make_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel
    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    torch.manual_seed(0)
    # n_positions: transformers' GGUF reader maps context_length to n_ctx, which GPT2Config ignores
    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=1024, n_embd=32, n_layer=2, n_head=2,
                                       eos_token_id=2, bos_token_id=None)).eval()
    return write_gguf(folder / "tiny-gpt2.gguf", model, "gpt2", folder / "tokenizer.json", EOS, skip=skip), model


@pytest.fixture(scope="module")
def gpt2_gguf(tmp_path_factory, cache) -> Path:
    return tiny_gpt2(tmp_path_factory.mktemp("gpt2"))[0]


def cli(model: Path, cache_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPECDECODE_CACHE=str(cache_dir), PYTHONPATH=str(Path(__file__).parents[2]))
    return subprocess.run([sys.executable, "-m", "specdecode.cli", "generate", "hi", "--model", str(model),
                           "--max-tokens", "2", "--threads", "1"], capture_output=True, text=True, timeout=300, env=env)


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("specdecode: error:")]
    assert len(lines) == 1, proc.stderr
    assert all(w in lines[0] for w in words), lines[0]


def test_gpt2_gguf_runs_through_the_adapter(gpt2_gguf, capsys):
    llm = LLM(model=str(gpt2_gguf), method="ngram", num_speculative_tokens=4, dtype="fp32", progress=False)
    err = capsys.readouterr().err
    assert "note:" in err and "gpt2" in err and "transformers adapter" in err and "converting" in err
    assert not llm.target.native
    prompts = ["the quick brown fox jumps over the lazy dog. the quick", "1 2 3 4 5 6 7 8"]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
    # the same greedy tokens as transformers' own model read from the same file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ref = AutoModelForCausalLM.from_pretrained(str(gpt2_gguf.parent), gguf_file=gpt2_gguf.name,
                                               dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(str(gpt2_gguf.parent), gguf_file=gpt2_gguf.name)
    for prompt, out in zip(prompts, plain):
        assert ref_tok(prompt)["input_ids"] == out.prompt_token_ids
        ids = torch.tensor([out.prompt_token_ids])
        expected = ref.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, ids.shape[1]:]
        assert expected.tolist() == out.token_ids
    # a second load reads the cached conversion
    LLM(model=str(gpt2_gguf), method="none", dtype="fp32", progress=False)
    err = capsys.readouterr().err
    assert "transformers adapter" in err and "converting" not in err


def test_adapter_gguf_refuses_native_only_options(gpt2_gguf):
    with pytest.raises(ModelError, match=r"--weights native: .*tiny-gpt2.gguf is a gpt2 GGUF file"):
        LLM(model=str(gpt2_gguf), weights="native", progress=False)


def test_unknown_architecture_is_refused(tmp_path, cache):
    import gguf
    import numpy as np
    path = tmp_path / "madeup.gguf"
    writer = gguf.GGUFWriter(str(path), "madeup")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from specdecode.models.gguf import NATIVE_ARCHS
    assert {"llama", "gemma3", "gemma4", "qwen3moe"} <= set(NATIVE_ARCHS)
    with pytest.raises(ModelError, match=r"madeup.gguf: GGUF architecture 'madeup' is not supported "
                                         rf"\(native: {', '.join(NATIVE_ARCHS)}; "
                                         r"through transformers: .*gpt2"):
        LLM(model=str(path), progress=False)


def test_missing_tensors_in_an_adapter_file(tmp_path, cache):
    path, _ = tiny_gpt2(tmp_path, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelError, match=r"tiny-gpt2.gguf is missing tensors: .*c_fc.weight"):
        LLM(model=str(path), dtype="fp32", progress=False)


def test_damaged_files_are_one_line(tmp_path, gpt2_gguf, cache):
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("just some text, not a model\n")
    data = gpt2_gguf.read_bytes()
    cut_data = tmp_path / "cut-data.gguf"          # header whole, tensor data cut off
    cut_data.write_bytes(data[:len(data) * 3 // 4])
    cut_header = tmp_path / "cut-header.gguf"      # cut inside the metadata
    cut_header.write_bytes(data[:200])
    for path, words in ((not_gguf, ("notes.gguf", "is not a GGUF file")),
                        (cut_data, ("cut-data.gguf", "is truncated", "tensor")),
                        (cut_header, ("cut-header.gguf", "damaged GGUF file"))):
        with pytest.raises(ModelError) as info:
            LLM(model=str(path), progress=False)
        assert all(w in str(info.value) for w in words), str(info.value)
    assert_one_line_error(cli(cut_data, cache), "cut-data.gguf", "is truncated")
    assert_one_line_error(cli(not_gguf, cache), "notes.gguf", "is not a GGUF file")


def test_missing_tensors_in_a_native_file(tmp_path, cache):
    from conftest import make_model
    from transformers import AutoModelForCausalLM
    folder = make_model(tmp_path / "llama", "llama", seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    whole = write_gguf(tmp_path / "llama.gguf", model, "llama", folder / "tokenizer.json", EOS, permute_qk=True)
    holed = write_gguf(tmp_path / "holed.gguf", model, "llama", folder / "tokenizer.json", EOS, permute_qk=True,
                       skip=("blk.1.ffn_gate.weight",))
    # the writer's llama file loads natively and computes what the HF model does
    llm = LLM(model=str(whole), dtype="fp32", method="none", progress=False)
    assert llm.target.native
    ids = [5, 6, 7, 8, 9]
    out = llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    expected = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 5:]
    assert out.token_ids == expected.tolist()
    assert_one_line_error(cli(holed, cache), "holed.gguf", "is missing tensors", "blk.1.ffn_gate.weight")
