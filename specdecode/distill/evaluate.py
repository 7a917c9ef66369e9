"""Real speculative runs of a trained drafter on held-out Spec-Bench prompts (never trained on)."""
from __future__ import annotations

from pathlib import Path

from ..datasets import SPEC_BENCH_TASKS, load
from ..drafters.registry import build_drafter
from ..engine import offline
from ..engine.sequence import SpecStats
from ..params import SamplingParams


def drafter_for(target, drafter_dir: Path, kind: str):
    if kind in ("eagle", "medusa"):
        return build_drafter(kind, target, drafter_path=str(drafter_dir))
    from ..models.loader import load_model
    draft = load_model(str(drafter_dir), target.model.dtype, str(target.model.device), progress=False)
    return build_drafter("model", target, draft=draft)


def engine_eval(target, drafter_dir: Path, kind: str = "eagle", prompts_per_task: int = 3, k: int = 5,
                max_tokens: int = 128) -> dict:
    """Greedy, batch 1, per prompt: mean accepted length (bonus included) per task and overall."""
    core = offline.offline_core(target, drafter_for(target, drafter_dir, kind), k)
    tok = target.tokenizer
    total = SpecStats()
    per_task = {}
    for task in SPEC_BENCH_TASKS:
        stats = SpecStats()
        for prompt in load(task)[:prompts_per_task]:
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt.text}]), add_special=False)
            if len(ids) + max_tokens > target.model.max_len:
                continue                     # does not fit this target's context
            seq = offline.run(core, [ids], [SamplingParams(max_tokens=max_tokens)])[0]
            stats.merge(seq.stats)
        total.merge(stats)
        per_task[task] = round(stats.mean_accepted_length, 3)
    return {"k": k, "prompts_per_task": prompts_per_task, "max_tokens": max_tokens,
            "mean_accepted_length": round(total.mean_accepted_length, 3),
            "acceptance_rate": round(total.acceptance_rate, 4),
            "acceptance_per_position": [round(x, 4) for x in total.acceptance_per_position],
            "mean_accepted_length_per_task": per_task}
