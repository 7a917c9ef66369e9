"""lm-evaluation-harness's `local-completions` model against the server, unchanged: a
log-likelihood (multiple-choice) task and a generate-until task written here, scored with
speculation on and off. It finds the server's tokenizer endpoints by itself (no tokenizer given)."""
from __future__ import annotations

import json

import pytest

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

QUESTIONS = [("The capital of France is", ["Paris", "Berlin", "Madrid"], 0),
             ("Two plus two equals", ["three", "four", "five"], 1),
             ("The opposite of hot is", ["cold", "warm", "green"], 0),
             ("Water freezes at zero degrees", ["Fahrenheit", "Celsius", "Kelvin"], 1),
             ("The color of the sky on a clear day is", ["red", "blue", "black"], 1),
             ("A week has seven", ["days", "months", "years"], 0)]


def write_tasks(folder) -> None:
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\n"
              f"test_split: test\n")
    (folder / "sd_choice.yaml").write_text(
        "task: sd_choice\n" + common + "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\ntarget_delimiter: \" \"\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "sd_until.yaml").write_text(
        "task: sd_until\n" + common + "output_type: generate_until\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_target: \"{{choices[answer]}}\"\ntarget_delimiter: \" \"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n    ignore_punctuation: true\n")


def evaluate(url: str, folder):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    out = simple_evaluate(model="local-completions", model_args=f"model=smollm2,base_url={url}/v1/completions,"
                                                                 "num_concurrent=2,max_retries=1",
                          tasks=["sd_choice", "sd_until"], task_manager=TaskManager(include_path=str(folder)),
                          log_samples=True, batch_size=1)
    return {task: [s["resps"] for s in samples] for task, samples in out["samples"].items()}, out["results"]


def test_scores_identical_with_speculation_on_and_off(tmp_path):
    write_tasks(tmp_path)
    runs = []
    for method in ("ngram", "none"):
        llm = LLM(method=method, progress=False)
        state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=512, served_model_name="smollm2"))
        with BackgroundServer(create_app(state)) as srv:
            runs.append(evaluate(srv.url, tmp_path))
    (spec_samples, spec_scores), (plain_samples, plain_scores) = runs
    assert spec_samples == plain_samples                          # every log-likelihood and generation
    assert spec_scores["sd_choice"]["acc,none"] == plain_scores["sd_choice"]["acc,none"]
    assert spec_scores["sd_until"]["exact_match,none"] == plain_scores["sd_until"]["exact_match,none"]
    assert len(spec_samples["sd_choice"]) == len(QUESTIONS) and len(spec_samples["sd_until"]) == len(QUESTIONS)
    print(spec_scores["sd_choice"], spec_scores["sd_until"])
