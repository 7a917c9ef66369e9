"""Where a step's time goes outside the target's forward pass and LM head, per drafting method.

    python scripts/measure/step_overhead.py --methods eagle,ngram [--task qa] [--rounds 3] [--plain]

Each method (and plain decoding) answers one Spec-Bench prompt for 128 tokens `--rounds` times on
one loaded target (the bench's way: one engine core per method); the target's `run` and `logits`
are timed, and the rest of each step is what the engine core, the speculation controller and the
drafter cost. `--plain` holds every row at draft size 0 after the controller has chosen (the cost of
a method that never drafts: the controller's bookkeeping, the drafter's hooks, its shadow drafts).
Prints per method microseconds per step in all, outside the model, and in each timed part (each
wrapper adds ~0.5 us; parts nest: `drafting._shadow` holds the drafter's shadow `propose` calls). The
same work with cold caches costs several times its microbenchmark: after a step's pass a torch
call took ~10 us, so this measures in place.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))    # this checkout's specdecode

TOKENS = 128


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", required=True, help="comma-separated drafting methods (as `generate --method`)")
    p.add_argument("--task", default="qa", help="the Spec-Bench task whose first prompt is answered")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--plain", action="store_true", help="every row held at draft size 0 after the controller chose")
    args = p.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")

    from specdecode import LLM, verify_tree
    from specdecode.bench.systems import Cell, SpecdecodeSystem
    from specdecode.datasets import spec_bench
    from specdecode.engine import runner as runner_module
    from specdecode.engine.controller import AUTO, RowSpec, SpeculationController
    from specdecode.engine.drafting import Drafting
    from specdecode.engine.probes import MAX_PROBE_EVERY
    from specdecode.fast.linear import cpu_label
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
        plan = SpeculationController.plan

        def held_plain(self, rows, pending):
            sizes = plan(self, rows, pending)            # the controller's bookkeeping, as it would run
            for r in rows:                               # ... then plain, as if it had chosen 0
                if r.probing:                            # a probe that did not pay: the next waits longer
                    r.probe_interval = min(2 * r.probe_interval, MAX_PROBE_EVERY)
                    r.probe_wait = r.probe_interval
                r.size, r.probing, r.probed = 0, False, False
                if r.mode == AUTO:                       # kept off: its drafter hears of it only before a probe
                    r.listening = self.probes.listens(r, 0)
            return [0] * len(sizes)
        SpeculationController.plan = held_plain
    llm = LLM(None, method="none", num_speculative_tokens=0, progress=False, prefix_cache=False)
    timed(llm.target.model, "run", "model")
    timed(llm.target.model, "logits", "model")
    for owner, name, label in ((SpeculationController, "plan", "controller.plan"),
                               (SpeculationController, "observe", "controller.observe"),
                               (Drafting, "_shadow", "drafting._shadow"),
                               (runner_module.ModelRunner, "_observe", "runner._observe"),
                               (RowSpec, "score_shadow", "row.score_shadow"),
                               (runner_module, "transform_logits", "transform_logits"),
                               (verify_tree, "verify_greedy_lists", "verify_greedy_lists")):
        timed(owner, name, label)
    system = SpecdecodeSystem(llm)
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if not system.supports(m):
            raise SystemExit(f"method {m!r} cannot run here: {system.skipped.get(m, 'unknown method')}")
    cells = {"plain": Cell("specdecode", "plain", 0), **{m: Cell("specdecode", m, 5) for m in methods}}
    for m in methods:
        drafter = system.drafter(m, 5)
        for name in ("propose", "observe", "observe_topk", "commit"):
            timed(drafter, name, f"drafter.{name}")
    question = next(q for q in spec_bench() if q.task == args.task)
    ids = llm.encode(question.text, question.chat)
    for m in cells:                                        # first-call costs (cost curve, kernels)
        system.run(cells[m], ids, 16, 0.0, 0)
    print(f"{cpu_label()}, {args.task}, {TOKENS} tokens x {args.rounds}"
          + (", rows held plain" if args.plain else ""))
    for m in cells:
        spent.clear()
        steps = seconds = 0.0
        for _ in range(args.rounds):
            got = system.run(cells[m], ids, TOKENS, 0.0, 0)
            steps, seconds = steps + got["steps"], seconds + got["seconds"]
        parts = "  ".join(f"{k}={v / steps * 1e6:.1f}" for k, v in spent.most_common() if k != "model")
        outside = (seconds - spent["model"]) / steps * 1e6
        print(f"{m:11s} {seconds / steps * 1e6:6.0f} us/step, outside the model {outside:5.0f} | {parts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
