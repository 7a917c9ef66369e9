"""Models named by Hugging Face id (specdecode/models/hub.py), against a local cache laid out as
huggingface_hub writes it (tests/conftest.py: hub_cache, offline_hub): no network exists here, so
the online answers the Hub would give (unknown, gated, unreachable) are raised by stand-ins for
huggingface_hub's calls."""
from __future__ import annotations

import subprocess
import sys

import pytest

from specdecode import LLM, SamplingParams
from specdecode.models.config import ModelError
from specdecode.models.hub import HubId, parse_id
from specdecode.models.loader import default_model_path, load_model, model_path

GGUF_NAME = "SmolLM2-135M-Instruct.{}.gguf"


def one_line_error(spec: str) -> str:
    with pytest.raises(ModelError) as caught:
        model_path(spec)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


def test_what_spells_an_id():
    assert parse_id("org/name") == HubId("org/name")
    assert parse_id("Org-1/Name_2.5:q4_k_m") == HubId("Org-1/Name_2.5", quant="q4_k_m")
    assert parse_id("org/name/sub/file-Q8_0.gguf") == HubId("org/name", file="sub/file-Q8_0.gguf")
    for path in ("./org/name", "/org/name", "~/org/name", "org", "org/name.gguf", "a/b/c", "org/../name",
                 "org/name:", "-org/name", "org--x/name"):
        assert parse_id(path) is None, path


def test_a_quant_tag_chooses_the_file_in_any_case(offline_hub):
    for tag in ("Q4_1", "q4_1", "Q8_0"):
        path = model_path(f"test-org/tiny-gguf:{tag}")
        assert path.name == GGUF_NAME.format(tag.upper()) and path.is_relative_to(offline_hub), path
    named = model_path(f"test-org/tiny-gguf/{GGUF_NAME.format('Q8_0')}")
    assert named == model_path("test-org/tiny-gguf:Q8_0")
    assert named.read_bytes()[:4] == b"GGUF"


def test_several_files_and_no_choice_list_the_quants_to_pick(offline_hub):
    message = one_line_error("test-org/tiny-gguf")
    assert "test-org/tiny-gguf:QUANT" in message, message
    assert "test-org/tiny-gguf:Q4_1" in message and "test-org/tiny-gguf:Q8_0" in message, message
    assert "HF_HUB_OFFLINE" in message and str(offline_hub) in message, message


def test_a_quant_or_file_that_matches_nothing_lists_what_there_is(offline_hub):
    message = one_line_error("test-org/tiny-gguf:Q5_K_M")
    assert "no GGUF file tagged Q5_K_M" in message and "test-org/tiny-gguf:Q4_1" in message, message
    message = one_line_error("test-org/tiny-gguf:Q4")          # a tag matches whole, not a prefix
    assert "no GGUF file tagged Q4" in message, message
    message = one_line_error("test-org/tiny-gguf/model-Q4_1.gguf")
    assert "no file model-Q4_1.gguf" in message and GGUF_NAME.format("Q8_0") in message, message


def test_an_unknown_id_offline_names_the_setting_and_the_cache(offline_hub):
    message = one_line_error("test-org/missing")
    assert message.startswith("model not found: test-org/missing"), message
    assert "HF_HUB_OFFLINE" in message and str(offline_hub) in message, message


def test_an_unknown_id_on_the_command_line_is_one_line(offline_hub, capsys):
    from specdecode.cli import main
    assert main(["generate", "hi", "--model", "test-org/missing"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdecode: error: model not found: test-org/missing"), err
    assert len(err.strip().splitlines()) == 1 and "HF_HUB_OFFLINE" in err, err


def test_a_split_gguf_and_a_quant_on_a_checkpoint_are_refused(offline_hub):
    message = one_line_error("test-org/split-gguf")
    assert "split GGUF" in message and "llama-gguf-split --merge" in message, message
    message = one_line_error("test-org/tiny-llama:Q4_1")
    assert "Hugging Face checkpoint" in message and "give test-org/tiny-llama alone" in message, message


def test_an_existing_path_wins_over_an_id(offline_hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "test-org" / "tiny-gguf").mkdir(parents=True)
    assert model_path("test-org/tiny-gguf").resolve() == (tmp_path / "test-org" / "tiny-gguf").resolve()


def test_a_safetensors_repository_loads_as_its_directory(offline_hub, tiny_models):
    by_id = load_model("test-org/tiny-llama", dtype="fp32", progress=False, fast=False)
    by_dir = load_model(str(tiny_models["llama"]), dtype="fp32", progress=False, fast=False)
    assert by_id.path.is_relative_to(offline_hub) and by_id.name == "test-org/tiny-llama"
    assert by_id.fingerprint == by_dir.fingerprint
    assert {p.name for p in by_id.path.iterdir()} == {p.name for p in tiny_models["llama"].iterdir()}


def http_client():
    """The HTTP client module huggingface_hub is built on (httpx, or httpx2 in its later versions)."""
    from huggingface_hub import errors
    return sys.modules[errors.Response.__module__.split(".")[0]]


def hub_error(cls, status: int):
    """An error of huggingface_hub's HTTP kind, as its calls raise for a Hub answer."""
    http = http_client()
    request = http.Request("GET", "https://huggingface.co/api/models/test-org/x")
    return cls(f"{status} answer", response=http.Response(status, request=request))


def test_the_hubs_answers_online_are_one_line_each(offline_hub, monkeypatch):
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unknown(self, repo_id, **kwargs):
        raise hub_error(RepositoryNotFoundError, 401)
    monkeypatch.setattr(HfApi, "model_info", unknown)
    message = one_line_error("test-org/private")
    assert message.startswith("model not found: test-org/private") and "HF_TOKEN" in message, message

    def gated(self, repo_id, **kwargs):
        raise hub_error(GatedRepoError, 403)
    monkeypatch.setattr(HfApi, "model_info", gated)
    message = one_line_error("test-org/gated")
    assert "gated" in message and "HF_TOKEN" in message and "hf auth login" in message, message


def test_an_unreachable_hub_falls_back_to_the_cache(offline_hub, monkeypatch):
    from huggingface_hub import HfApi, constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def no_network(self, repo_id, **kwargs):
        raise http_client().ConnectError("[Errno -2] Name or service not known")
    monkeypatch.setattr(HfApi, "model_info", no_network)
    assert model_path("test-org/tiny-gguf:Q4_1").name == GGUF_NAME.format("Q4_1")
    message = one_line_error("test-org/missing")
    assert "cannot be reached" in message and "ConnectError" in message and str(offline_hub) in message, message


@pytest.mark.slow
def test_an_id_generates_as_its_file_does_as_target_and_draft(offline_hub):
    params = SamplingParams(max_tokens=12)
    prompt = "The capital of France is"
    reference = LLM(model=str(default_model_path()), method="none", progress=False).generate(prompt, params)[0]
    by_id = LLM(model="test-org/tiny-gguf:Q4_1", draft="test-org/tiny-gguf:Q8_0", method="model",
                num_speculative_tokens=3, progress=False)
    assert by_id.target.name == "test-org/tiny-gguf:Q4_1" and by_id.draft.name == "test-org/tiny-gguf:Q8_0"
    assert by_id.generate(prompt, params)[0].token_ids == reference.token_ids


@pytest.mark.slow
def test_generate_by_id_on_the_command_line_prints_text(offline_hub):
    """As a user runs it: a child process that reads HF_HUB_CACHE and HF_HUB_OFFLINE from its environment."""
    run = subprocess.run([sys.executable, "-m", "specdecode.cli", "generate", "The capital of France is",
                          "--model", "test-org/tiny-gguf:Q4_1", "--max-tokens", "8", "-k", "0", "--threads", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
    assert "Traceback" not in run.stderr, run.stderr
