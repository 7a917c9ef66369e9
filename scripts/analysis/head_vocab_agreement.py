"""Does a draft model's reduced LM head (`head_vocab`, FR-Spec) agree with its target as often as its whole head?

    python scripts/analysis/head_vocab_agreement.py --model TARGET.gguf --draft DRAFT.gguf [--per-task 3] \
        [--sizes 32768,65536]

For the first --per-task prompts of six Spec-Bench tasks and of HumanEval: the target's greedy answer
(128 tokens at most), then the draft teacher-forced over prompt + answer; per position, whether the
draft's argmax over its whole head, and over each reduced head (the ids `drafters/vocab_rank.py` keeps
for `head_rank` "freq" and "id"), is the target's token (what a one-token greedy draft would have
had accepted). Prints each answer's agreement and each task's, pooled over its tokens.
"""
from __future__ import annotations

import argparse

import torch

from specdecode import LLM, SamplingParams
from specdecode.datasets import humaneval, spec_bench
from specdecode.drafters.vocab_rank import frequent_ids
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
    p.add_argument("--per-task", type=int, default=3)
    p.add_argument("--sizes", default="32768,65536", help="comma-separated head_vocab sizes")
    args = p.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    if args.per_task < 1 or not sizes:
        raise SystemExit("--per-task must be >= 1 and --sizes must name at least one size")
    llm = LLM(args.model, draft=args.draft, method="model", progress=False, prefix_cache=False)
    drafter = llm.drafter                    # the draft as the pair runs it (its default dtype)
    shared = min(drafter.draft_vocab, drafter.target_vocab)
    keep = tuple(drafter.draft.eos_token_ids) + tuple(llm.target.eos_token_ids)
    heads = {"all": None}
    for n in sizes:
        for rank in ("freq", "id"):
            heads[f"{rank}{n // 1024}k"] = frequent_ids(drafter.draft.tokenizer, shared, n, rank, keep=keep)
    bench = spec_bench()
    prompts = [(t, q) for t in TASKS for q in [x for x in bench if x.task == t][:args.per_task]]
    prompts += [("humaneval", h) for h in humaneval()[:args.per_task]]
    pooled: dict[tuple[str, str], list[float]] = {}
    for task, q in prompts:
        ids = llm.encode(q.text, q.chat)
        answer = llm.generate([ids], SamplingParams(max_tokens=128), num_speculative_tokens=0)[0].token_ids
        span = slice(len(ids) - 1, len(ids) + len(answer) - 1)
        logits = logits_over(drafter.model, ids + answer)[span][:, :shared]
        want = torch.tensor(answer)
        line = []
        for name, kept in heads.items():
            pick = logits.argmax(-1) if kept is None else kept[logits[:, kept].argmax(-1)]
            right = (pick == want).float()
            total = pooled.setdefault((task, name), [0.0, 0.0])
            total[0] += right.sum().item()
            total[1] += len(answer)
            line.append(f"{name} {right.mean():.3f}")
        print(f"{task:14s} len {len(answer):3d} | " + "  ".join(line), flush=True)
    print("per task (agreement, tokens pooled):")
    for task in dict.fromkeys(t for t, _ in prompts):
        print(f"{task:14s} " + "  ".join(f"{n} {pooled[task, n][0] / pooled[task, n][1]:.3f}" for n in heads))
    right = {n: sum(v[0] for (_, m), v in pooled.items() if m == n) for n in heads}
    tokens = {n: sum(v[1] for (_, m), v in pooled.items() if m == n) for n in heads}
    print("all            " + "  ".join(f"{n} {right[n] / tokens[n]:.3f}" for n in heads))


if __name__ == "__main__":
    main()
