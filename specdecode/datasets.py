"""Benchmark prompts shipped with the package (licenses beside the files in specdecode/data).

Spec-Bench (Xia et al. 2024, Apache-2.0): 480 questions; the 8 MT-bench categories are
grouped as the task "multi_turn" (first turn used), the others are translation,
summarization, qa, math_reasoning, rag. HumanEval (Chen et al. 2021, MIT): 164 code prompts.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data"
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
SPEC_BENCH_TASKS = ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag")
TASKS = SPEC_BENCH_TASKS + ("humaneval",)


@dataclass(frozen=True)
class Prompt:
    task: str
    id: str
    text: str
    chat: bool      # wrap in the chat template (Spec-Bench) or feed raw (HumanEval code completion)
    schema: str | None = None   # a JSON schema (canonical JSON text) the answer is constrained to


def spec_bench(task: str | None = None) -> list[Prompt]:
    prompts = []
    for line in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines():
        row = json.loads(line)
        name = "multi_turn" if row["category"] in MT_BENCH else row["category"]
        if task is None or task == name:
            prompts.append(Prompt(name, str(row["question_id"]), row["turns"][0], chat=True))
    return prompts


def humaneval() -> list[Prompt]:
    with gzip.open(DATA / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        return [Prompt("humaneval", row["task_id"], row["prompt"], chat=False) for row in map(json.loads, f)]


def load(task: str) -> list[Prompt]:
    if task == "humaneval":
        return humaneval()
    if task not in SPEC_BENCH_TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    return spec_bench(task)
