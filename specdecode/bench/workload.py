"""Which prompts a bench run measures, rendered once to token ids that every system shares.

Prompts come from the shipped Spec-Bench and HumanEval sets (`specdecode.datasets`) or from
a custom JSONL file (one object per line: `text` required; `task` (default "custom"), `id`
(default the line number), `chat` (default true) and `schema` optional; `schema` constrains that
prompt's answer: a JSON schema object, or a name resolved as `schemas/<name>.json` next to the
file (structured output; it takes the place of the run's --json-schema for that prompt)). Chat prompts are rendered
with the target's own chat template by specdecode's tokenizer, so specdecode, transformers
and llama.cpp all see exactly the same token ids.

Selection is deterministic (the first N prompts of each task, in file order, that fit the
model's context with max_tokens and the draft room), so `--resume` finds the same cells.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .. import datasets


@dataclass(frozen=True)
class BenchPrompt:
    task: str
    id: str
    ids: tuple[int, ...]   # prompt token ids (chat template applied when the prompt is a chat prompt)
    schema: str | None = None   # this prompt's JSON schema (canonical JSON text), if it has its own


def read_custom(path: str | Path) -> list[datasets.Prompt]:
    """Prompts from a JSONL file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row["text"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{number}: each line must be a JSON object with a 'text' field") from None
        prompts.append(datasets.Prompt(str(row.get("task", "custom")), str(row.get("id", number)), str(text),
                                       chat=bool(row.get("chat", True)),
                                       schema=_schema(row.get("schema"), path, number)))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _schema(value, path: Path, number: int) -> str | None:
    """A prompt line's `schema` as canonical JSON text: an object, or a name of
    `schemas/<name>.json` (or a file path) relative to the prompts file; checked by llguidance."""
    if value is None:
        return None
    from ..params import ParamError
    from ..structured import Structured, check_grammar
    where = f"{path}:{number}: schema"
    if isinstance(value, str):
        found = next((f for f in (path.parent / "schemas" / f"{value}.json", path.parent / value) if f.is_file()), None)
        if found is None:
            raise ValueError(f"{where} {value!r}: no schemas/{value}.json or {value} next to {path.name}")
        try:
            value = json.loads(found.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{where} {found}: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON schema object or a schema file's name, got {value!r:.60}")
    try:
        check_grammar(Structured("json_schema", value))
    except ParamError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return json.dumps(value, sort_keys=True)


def select(llm, tasks: list[str], per_task: int | None, max_tokens: int, room: int,
           prompts_file: str | None = None) -> tuple[list[BenchPrompt], list[str]]:
    """The first `per_task` prompts of each task (all when None) whose prompt + max_tokens +
    room fits the target's context. Returns the prompts and notes about skipped ones."""
    context = llm.target.model.max_len
    if llm.draft is not None:
        context = min(context, llm.draft.model.max_len)
    if prompts_file:
        pool = read_custom(prompts_file)
        tasks = list(dict.fromkeys(p.task for p in pool))
    else:
        pool = [p for task in tasks for p in datasets.load(task)]
    chosen: list[BenchPrompt] = []
    notes: list[str] = []
    for task in tasks:
        taken = too_long = 0
        for p in (q for q in pool if q.task == task):
            if per_task is not None and taken >= per_task:
                break
            ids = llm.encode(p.text, chat=p.chat)
            if not ids or len(ids) + max_tokens + room > context:
                too_long += 1
                continue
            chosen.append(BenchPrompt(task, p.id, tuple(ids), p.schema))
            taken += 1
        if too_long:
            notes.append(f"{task}: skipped {too_long} prompt(s) longer than the context of {context} tokens "
                         f"minus max_tokens {max_tokens}")
        if taken == 0:
            notes.append(f"{task}: no prompt fits; task left out")
    return chosen, notes


def interleave(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """Round-robin over tasks (first prompt of each task, then the second, ...) so that an
    interrupted run already covers every task."""
    by_task: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_task.setdefault(p.task, []).append(p)
    order = []
    for i in range(max((len(v) for v in by_task.values()), default=0)):
        order += [v[i] for v in by_task.values() if i < len(v)]
    return order
