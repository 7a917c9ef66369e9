"""How often a draft model agrees with its target, against how sure the target is, per answer.

    python scripts/analysis/draft_agreement.py --model TARGET.gguf --draft DRAFT.gguf [--per-task 4] [--max-tokens 128]

For the first --per-task Spec-Bench prompts of six tasks and as many HumanEval prompts: the target's
greedy answer, then both models teacher-forced over prompt + answer; per position the target's top
next-token probability ("conf") and whether the draft's argmax is the target's token ("agree", what
a one-token greedy draft would have had accepted). Prints per answer the first 8 confidences and 16
agreements, and the means over the first 16 tokens and the whole answer. Read with
benchmarks/never-slower/confidence-17.txt (RESULTS.md, seventeenth session).
"""
from __future__ import annotations

import argparse

import torch

from specdecode import LLM, SamplingParams
from specdecode.datasets import humaneval, spec_bench
from specdecode.forward import ForwardBatch

TASKS = ("multi_turn", "summarization", "translation", "qa", "rag", "math_reasoning")


def logits_over(model, ids: list[int]) -> torch.Tensor:      # -> [len(ids), vocab]
    """A native model's logits at every position of `ids` (one pass, a fresh cache)."""
    cache = model.new_cache(1, len(ids) + 8)
    fb = ForwardBatch.chain(torch.tensor([ids]), 0, torch.arange(1))
    with torch.inference_mode():
        return model.logits(model.run(fb, cache), fb.logit_index)[0].float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--per-task", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    if args.per_task < 1 or args.max_tokens < 1:
        raise SystemExit(f"--per-task and --max-tokens must be >= 1, got {args.per_task} / {args.max_tokens}")
    target = LLM(args.model, method="none", num_speculative_tokens=0, progress=False, prefix_cache=False)
    draft = LLM(args.draft, method="none", num_speculative_tokens=0, progress=False, prefix_cache=False)
    bench = spec_bench()
    prompts = [(t, q) for t in TASKS for q in [x for x in bench if x.task == t][:args.per_task]]
    prompts += [("humaneval", h) for h in humaneval()[:args.per_task]]
    for task, q in prompts:
        ids = target.encode(q.text, q.chat)
        answer = target.generate([ids], SamplingParams(max_tokens=args.max_tokens, temperature=0.0))[0].token_ids
        seq, span = ids + answer, slice(len(ids) - 1, len(ids) + len(answer) - 1)
        conf = logits_over(target.target.model, seq)[span].softmax(-1).amax(-1)
        agree = (logits_over(draft.target.model, seq)[span].argmax(-1) == torch.tensor(answer)).float()
        print(" ".join(f"{c:.2f}" for c in conf[:8].tolist()), "| agree",
              "".join(str(int(a)) for a in agree[:16].tolist()))
        print(f"{task:14s} len {len(answer):3d} conf16 {conf[:16].mean():.3f} conf_all {conf.mean():.3f} "
              f"agree16 {agree[:16].mean():.2f} agree_all {agree.mean():.2f}", flush=True)


if __name__ == "__main__":
    main()
