"""Where a step's time goes outside the target's forward pass and LM head, per drafting method.

    python scripts/measure/step_overhead.py --methods eagle,ngram [--task qa] [--rounds 3] [--plain]

Each method (and plain decoding) answers one Spec-Bench prompt for 128 tokens `--rounds` times on
one loaded target; the target's `run` and `logits` are timed, and the rest of each step is what the
engine, the draft budget and the drafter cost. `--plain` holds every budget at plain decoding (the
cost of a method that never drafts: its hooks, its bookkeeping, its shadow drafts). Prints per
method microseconds per step in all, outside the model, and in each timed part (each wrapper adds
~0.5 us). The same work with cold caches costs several times its microbenchmark: after a step's pass
a torch call took ~10 us, so this measures in place.
"""
from __future__ import annotations

import argparse
import collections
import time

from specdecode import LLM
from specdecode.bench.systems import Cell, SpecdecodeSystem
from specdecode.datasets import spec_bench
from specdecode.engine import budget as budget_module
from specdecode.engine import engine as engine_module
from specdecode.engine import runner as runner_module
from specdecode.engine import shadows as shadows_module
from specdecode.fast.linear import cpu_label


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", required=True, help="comma-separated drafting methods (as `generate --method`)")
    p.add_argument("--task", default="qa", help="the Spec-Bench task whose first prompt is answered")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--plain", action="store_true", help="every budget held at plain decoding")
    args = p.parse_args()
    spent: collections.Counter = collections.Counter()

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[label] += time.perf_counter() - started
        setattr(owner, name, wrapper)

    if args.plain:
        next_size = budget_module.DraftBudget.next_size

        def plain(self) -> int:
            next_size(self)
            self.size, self.chosen[-1], self.probed = 0, 0, False
            return 0
        budget_module.DraftBudget.next_size = plain
    llm = LLM(None, method="none", num_speculative_tokens=0, progress=False, prefix_cache=False)
    timed(llm.target.model, "run", "model")
    timed(llm.target.model, "logits", "model")
    for owner, name in ((budget_module.DraftBudget, "next_size"), (budget_module.DraftBudget, "observe"),
                        (shadows_module.ShadowDrafts, "propose"), (shadows_module.ShadowDrafts, "score"),
                        (runner_module, "transform_logits"), (engine_module, "verify_greedy_lists")):
        timed(owner, name, f"{getattr(owner, '__name__', '')}.{name}")
    system = SpecdecodeSystem(llm)
    methods = [m for m in args.methods.split(",") if m]
    cells = {"plain": Cell("specdecode", "plain", 0), **{m: Cell("specdecode", m, 5) for m in methods}}
    for m in methods:
        drafter = system.drafter(m, 5)
        for name in ("propose", "observe", "observe_topk", "commit"):
            if hasattr(drafter, name):
                timed(drafter, name, f"drafter.{name}")
    question = next(q for q in spec_bench() if q.task == args.task)
    ids = llm.encode(question.text, question.chat)
    for m in cells:                                        # first-call costs
        system.run(cells[m], ids, 16, 0.0, 0)
    print(f"{cpu_label()}, {args.task}, 128 tokens x {args.rounds}" + (", budgets held plain" if args.plain else ""))
    for m in cells:
        spent.clear()
        steps = seconds = 0.0
        for _ in range(args.rounds):
            got = system.run(cells[m], ids, 128, 0.0, 0)
            steps, seconds = steps + got["steps"], seconds + got["seconds"]
        parts = "  ".join(f"{k}={v / steps * 1e6:.1f}" for k, v in spent.most_common() if k != "model")
        print(f"{m:11s} {seconds / steps * 1e6:6.0f} us/step, outside the model {(seconds - spent['model']) / steps * 1e6:5.0f}"
              f" | {parts}", flush=True)


if __name__ == "__main__":
    main()
