"""One `LLM.generate` call of many requests, plain against speculative, alternating: the offline
batch where speculation used to lose (issue 35). Six held-out-style prompts (chat, summary,
translation, code, QA, RAG) x --copies requests, greedy, --max-tokens each.

    python scripts/batch_speed.py                     # embedded model, native weights, 24 requests
    python scripts/batch_speed.py --dtype bf16 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))    # this checkout's specdecode

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
    args = ap.parse_args()
    from specdecode import LLM, SamplingParams
    from specdecode.fast.linear import cpu_label
    llm = LLM(model=args.model, dtype=args.dtype, method=args.method, progress=False, prefix_cache=False)
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS] * args.copies
    params = SamplingParams(max_tokens=args.max_tokens)
    llm.generate(prompts, params, chat=True)                            # warm-up: curves, kernels
    rates: dict[str, list[float]] = {"plain": [], "speculative": []}
    same = True
    for r in range(args.rounds):
        outs = {}
        for arm in (("plain", "speculative") if r % 2 == 0 else ("speculative", "plain")):
            started = time.perf_counter()
            out = llm.generate(prompts, params, chat=True, num_speculative_tokens=0 if arm == "plain" else None)
            rates[arm].append(sum(len(o.token_ids) for o in out) / (time.perf_counter() - started))
            outs[arm] = [o.token_ids for o in out]
        same = same and outs["plain"] == outs["speculative"]
    plain, spec = statistics.median(rates["plain"]), statistics.median(rates["speculative"])
    print(f"{cpu_label()}; {llm.target.name} ({llm.target.weights_kind}), method {llm.method}; {len(prompts)} requests "
          f"in one call, {args.max_tokens} tokens, {args.rounds} rounds: plain {plain:.1f} tok/s, speculative "
          f"{spec:.1f} tok/s = {spec / plain:.2f}x; identical outputs: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
