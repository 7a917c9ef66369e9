"""`specdecode distill` end to end on a tiny target: corpus, features, training with held-out
evaluation, a saved drafter that the engine uses losslessly; resume; bad options."""
import json

import pytest

from specdecode import LLM, SamplingParams
from specdecode.cli import main


@pytest.fixture(scope="module")
def distilled(tiny_models, tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("distill")
    code = main(["distill", "--target", str(tiny_models["llama"]), "--out", str(out), "--max-prompts", "40",
                 "--max-new-tokens", "48", "--minutes", "0.4", "--eval-every", "0.2", "--draft-vocab", "128",
                 "--batch-tokens", "256", "--epochs", "10000",   # time-bound on any machine: 3 curve points
                 "--eval-prompts", "1", "--dtype", "fp32"])
    assert code == 0
    return out


def test_distill_outputs(distilled):
    drafter = distilled / "drafter"
    meta = json.loads((drafter / "drafter.json").read_text())
    assert meta["kind"] == "eagle" and meta["version"] == 1 and meta["target"]["fingerprint"]
    assert (drafter / "model.safetensors").is_file()
    assert (distilled / "corpus" / "corpus.jsonl").is_file() and (distilled / "features.pt").is_file()
    curve = json.loads((distilled / "curve.json").read_text())
    assert curve[0]["step"] == 0 and len(curve) >= 2
    first, last = curve[0]["mean_accepted_length"], curve[-1]["mean_accepted_length"]
    assert len(last) == 8 and all(a <= b for a, b in zip(last, last[1:]))   # MAL grows with k
    assert last[4] >= first[4] - 0.3, (first, last)    # (this tiny target is too repetitive to show gains)
    assert curve[-1]["loss"] < curve[1]["loss"], curve  # the training loss went down
    assert (distilled / "curve.png").is_file()
    assert json.loads((distilled / "eval.json").read_text())["mean_accepted_length"] >= 1.0


def test_distilled_drafter_is_lossless(tiny_models, distilled):
    # drafts every step (adaptive=False): on this tiny target a head's pass costs several target steps, and
    # the draft budget, started from what the first call measured, rightly keeps later calls plain
    llm = LLM(model=str(tiny_models["llama"]), drafter_path=str(distilled / "drafter"), dtype="fp32", progress=False,
              adaptive=False)
    assert llm.method == "cascade"          # the default with a drafter directory
    prompts = ["the quick brown fox", "def add(a, b):"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for chat in (False, True):
        plain = llm.generate(prompts, params, num_speculative_tokens=0, chat=chat)
        spec = llm.generate(prompts, params, num_speculative_tokens=5, chat=chat)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    # chat prompts are what the drafter was trained on (the tiny target's answers to them)
    assert spec[0].stats["mean_accepted_length"] > 1.0


def test_distill_resume_and_errors(tiny_models, distilled, capsys):
    code = main(["distill", "--target", str(tiny_models["llama"]), "--out", str(distilled), "--max-prompts", "40",
                 "--max-new-tokens", "48", "--minutes", "0.5", "--resume", "--eval-prompts", "0",
                 "--draft-vocab", "128", "--dtype", "fp32"])
    assert code == 0
    assert "resumed at step" in capsys.readouterr().err
    assert main(["distill", "--out", str(distilled / "x"), "--minutes", "0"]) == 2
    assert "--minutes must be > 0" in capsys.readouterr().err
    assert main(["distill", "--out", str(distilled / "y"), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_distill_draft_lm(tiny_models, distilled, tmp_path, capsys):
    out = tmp_path / "lm"
    code = main(["distill", "--kind", "draft-lm", "--layers", "2", "--target", str(tiny_models["llama"]),
                 "--out", str(out), "--corpus", str(distilled / "corpus"), "--max-prompts", "40",
                 "--max-new-tokens", "48", "--minutes", "0.15", "--eval-every", "0.1", "--eval-prompts", "1",
                 "--dtype", "fp32"])
    assert code == 0, capsys.readouterr().err
    drafter = out / "drafter"
    assert json.loads((drafter / "drafter.json").read_text())["kind"] == "draft-lm"
    from transformers import AutoModelForCausalLM  # a standard HF checkpoint
    hf = AutoModelForCausalLM.from_pretrained(str(drafter))
    assert hf.config.num_hidden_layers == 2
    llm = LLM(model=str(tiny_models["llama"]), draft=str(drafter), dtype="fp32", progress=False)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = llm.generate(["the quick brown fox"], params, num_speculative_tokens=0)[0]
    spec = llm.generate(["the quick brown fox"], params, num_speculative_tokens=4)[0]
    assert spec.token_ids == plain.token_ids
