"""One `LLM.generate` call of many requests, plain against speculative, alternating: the offline
batch where speculation used to lose (issue 35). Six held-out-style prompts (chat, summary,
translation, code, QA, RAG) x --copies requests, greedy, --max-tokens each. `LLM.generate` runs the
call on the engine core (continuous batching over paged KV caches, engine/offline.py), each row's
draft size chosen by the speculation controller. Prints the median tok/s of each arm, their ratio
and whether every output was identical.

    python scripts/measure/batch_speed.py                     # embedded model, native weights, 24 requests
    python scripts/measure/batch_speed.py --dtype bf16 --rounds 3
    python scripts/measure/batch_speed.py --spec-bench 64 --max-tokens 64   # ragged: Spec-Bench prompts
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))    # this checkout's specdecode

PROMPTS = ["Write a friendly reply to a colleague who asked how the weekend was.",
           "Summarize: The city council met on Tuesday to discuss the new bike lanes. Residents raised concerns about "
           "parking, while cyclists praised the plan. The council will vote next month after a public hearing.",
           "Translate to German: The train leaves at seven, so we should have breakfast early.",
           "Write a Python function that returns the n-th Fibonacci number iteratively.",
           "What causes the seasons on Earth? Answer in a few sentences.",
           "Context: The library opens at 9 am on weekdays and 10 am on weekends. It closes at 6 pm every day. "
           "Question: When does the library open on Saturday?"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--method", default=None)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec-bench", type=int, default=0, metavar="N",
                    help="instead: the first N prompts of the six Spec-Bench tasks, taken in turn (ragged lengths)")
    args = ap.parse_args()
    from specdecode import LLM, SamplingParams
    from specdecode.fast.linear import cpu_label
    llm = LLM(model=args.model, dtype=args.dtype, method=args.method, progress=False, prefix_cache=False)
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS] * args.copies
    params = SamplingParams(max_tokens=args.max_tokens)
    llm.generate(prompts, params, chat=True)                            # warm-up: curves, kernels
    ids = [llm.encode(p, chat=True) for p in prompts]
    if args.spec_bench:
        from specdecode.bench.workload import interleave, select
        tasks = ["multi_turn", "summarization", "translation", "qa", "math_reasoning", "rag"]
        chosen, _ = select(llm, tasks, -(-args.spec_bench // len(tasks)), args.max_tokens, 40)
        ids = [list(p.ids) for p in interleave(chosen)][:args.spec_bench]

    def run(arm: str) -> list[list[int]]:
        k = 0 if arm == "plain" else None
        return [o.token_ids for o in llm.generate(ids, params, num_speculative_tokens=k)]
    names = ["plain", "speculative"]
    rates: dict[str, list[float]] = {a: [] for a in names}
    same = True
    for r in range(args.rounds):
        outs = {}
        for arm in names[r % len(names):] + names[:r % len(names)]:
            started = time.perf_counter()
            outs[arm] = run(arm)
            rates[arm].append(sum(map(len, outs[arm])) / (time.perf_counter() - started))
        same = same and all(o == outs["plain"] for o in outs.values())
    median = {a: statistics.median(v) for a, v in rates.items()}
    lengths = sorted(map(len, ids))
    print(f"{cpu_label()}; {llm.target.name} ({llm.target.weights_kind}), method {llm.method}; {len(ids)} requests "
          f"(prompts of {lengths[0]}-{lengths[-1]} tokens) in one call, {args.max_tokens} tokens, {args.rounds} "
          f"rounds: plain {median['plain']:.1f} tok/s, speculative {median['speculative']:.1f} tok/s = "
          f"{median['speculative'] / median['plain']:.2f}x; identical outputs: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
