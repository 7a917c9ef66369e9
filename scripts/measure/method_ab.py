"""Each drafting method against plain decoding, per prompt, arms alternating (one process).

    python scripts/measure/method_ab.py --methods eagle,recycle,medusa [--rounds 3] [--model PATH] [--max-tokens 128]
    python scripts/measure/method_ab.py --methods cascade --model TARGET.gguf --draft DRAFT.gguf   # a pair
    python scripts/measure/method_ab.py --methods eagle --trace   # + a line per call (sizes chosen per step: 0 = plain;
                                                                  # on MoE the distinct experts its passes read)
    python scripts/measure/method_ab.py --methods cascade ... --drafter-option head_vocab=32768   # (as `generate`)
    python scripts/measure/method_ab.py --methods text-model ... --humaneval 8   # the first 8 HumanEval prompts
    python scripts/measure/method_ab.py --methods ngram --model random-moe.gguf --no-chat --trace   # no chat template

One generation per cell (what `specdecode bench` runs) moves by +-5-10% on a 2-core host whose
speed drifts; here every prompt runs each method `--rounds` times between two plain runs, in an
order that alternates between rounds and prompts, and the per-prompt ratio is the median over
rounds of each method's time against the mean of the plain runs around it. The prompts are
the bench's six held-out kinds: the first Spec-Bench prompt of multi_turn, summarization,
translation, qa and rag, and HumanEval/0 (or with --humaneval N the first N HumanEval prompts).
Each method's engine core keeps its speculation controller (the costs and acceptance it measured)
between calls, as a long-running process does. Prints per method the ratio over all the prompts
(sum of plain medians / sum of the method's; with the range of each round's own), each prompt's,
and whether every output equals plain decoding's.

Every arm runs on one loaded target (the bench's way: `SpecdecodeSystem`): separate `LLM`s each load
their own copy of the weights, and where a copy lands in memory moves its decoding speed (three
identical plain LLMs in one process: 370, 371 and 388 ms for the same answer). A drafter that
remembers finished outputs (suffix, recycle) is put back before each generation to what it knew
after the warm-up, so it never drafts its own answer to the same prompt from an earlier round; the
controller's measurements carry from call to call.
"""
from __future__ import annotations

import argparse
import statistics

from specdecode import LLM
from specdecode.bench.systems import Cell, SpecdecodeSystem
from specdecode.cli_common import drafter_option
from specdecode.datasets import humaneval, spec_bench
from specdecode.engine.controller import SpeculationController
from specdecode.fast.linear import cpu_label

TASKS = ("multi_turn", "summarization", "translation", "humaneval", "qa", "rag")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", required=True, help="comma-separated drafting methods (as `generate --method`)")
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default=None, help="a draft model (the pair's default method: cascade)")
    p.add_argument("--drafter-option", dest="drafter_options", action="append", default=[], type=drafter_option,
                   metavar="KEY=VALUE", help="given to the methods' drafters that take it (as `generate`)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--humaneval", type=int, default=0, metavar="N",
                   help="the first N HumanEval prompts instead of the six kinds (code only)")
    p.add_argument("--no-chat", action="store_true", help="the prompts as plain text (a model without a chat "
                                                          "template, e.g. make_random_gguf.py's)")
    p.add_argument("--trace", action="store_true", help="a line per method call: its ratio, steps, drafts, times "
                                                        "and the draft size the controller chose at each step")
    args = p.parse_args()
    if args.rounds < 1 or args.max_tokens < 1 or args.humaneval < 0:
        raise SystemExit(f"--rounds and --max-tokens must be >= 1 and --humaneval >= 0, got {args.rounds} / "
                         f"{args.max_tokens} / {args.humaneval}")
    if args.humaneval:
        prompts = humaneval()[:args.humaneval]
        tasks = [f"humaneval/{i}" for i in range(len(prompts))]
    else:
        bench = spec_bench()
        prompts = [humaneval()[0] if t == "humaneval" else next(q for q in bench if q.task == t) for t in TASKS]
        tasks = list(TASKS)
    methods = [m for m in args.methods.split(",") if m]
    llm = LLM(args.model, draft=args.draft, method="none", num_speculative_tokens=0, progress=False, prefix_cache=False)
    system = SpecdecodeSystem(llm, drafter_options=dict(args.drafter_options))
    for m in methods:
        if not system.supports(m):
            raise SystemExit(f"method {m!r} cannot run here: {system.skipped.get(m, 'unknown method')}")
    cells = {"plain": Cell("specdecode", "plain", 0), **{m: Cell("specdecode", m, 5) for m in methods}}
    ids = [llm.encode(p.text, p.chat and not args.no_chat) for p in prompts]
    warm_up = llm.encode("Write a haiku about the sea.", not args.no_chat)      # none of the six prompts

    chosen: list[int] = []                                 # the size planned at each step of the call running
    plan = SpeculationController.plan

    def recording(self, rows, pending):
        sizes = plan(self, rows, pending)
        chosen.append(sizes[0] if sizes else 0)
        return sizes
    SpeculationController.plan = recording

    def moe_totals(m: str) -> tuple[int, int, float] | None:
        """A MoE target's passes, rows and distinct experts per layer so far in method m's core."""
        core = system.cores.get((m, cells[m].k))
        moe = core.costs.moe if core is not None else None
        return (moe.passes, moe.rows_seen, moe.experts_seen) if moe is not None else None

    def run(m: str, prompt_ids: list[int]) -> dict:
        if memory.get(m) is not None:                      # what the drafter knew before the rounds
            system.drafter(m, cells[m].k).restore(memory[m])
        chosen.clear()
        before = moe_totals(m)
        got = system.run(cells[m], prompt_ids, args.max_tokens, 0.0, 0)
        got["sizes"] = list(chosen)
        after = moe_totals(m)
        if after is not None and after[0] > (before or (0,))[0]:
            passes, rows, experts = (a - b for a, b in zip(after, before or (0, 0, 0.0)))
            got["moe"] = f" | MoE passes {passes}: {rows / passes:.2f} rows, {experts / passes:.1f} experts / layer"
        return got

    def trace(r: int, task: str, m: str, got: dict, baseline: float) -> None:
        sizes = "".join(str(min(x, 9)) for x in got["sizes"]) or "-"
        print(f"r{r} {task:13s} {m} x{baseline / got['seconds']:.2f} steps {got['steps']} drafted {got['drafted']} "
              f"accepted {got['accepted']} ms: draft {got['draft_s'] * 1e3:.0f} verify {got['verify_s'] * 1e3:.0f} "
              f"prefill {got['prefill_s'] * 1e3:.0f} plain {baseline * 1e3:.0f}{got.get('moe', '')} | sizes {sizes}",
              flush=True)

    memory: dict[str, object] = {}
    for m in cells:                                        # first-call costs (cost curve, kernels)
        run(m, warm_up)
        drafter = system.drafter(m, cells[m].k)
        memory[m] = drafter.memory() if drafter is not None else None
    if args.trace:                                         # measured by each method's core at its first call
        for m in methods:
            curve = system.cores[m, cells[m].k].costs.curve
            print(f"{m} cost curve (rows: ms):", {r: round(t * 1e3, 2) for r, t in sorted(curve.items())}, flush=True)
            moe = system.cores[m, cells[m].k].costs.moe
            if moe is not None:                            # random tokens route nearly at random: the worst case
                print(f"{m} MoE: {moe.seconds * 1e3:.3f} ms per distinct expert per layer past {moe.used}; distinct "
                      f"experts per layer of distinct random tokens (rows: experts):",
                      {r: round(u, 1) for r, u in sorted(moe.union.items())}, flush=True)
    times: dict[tuple[str, int], list[float]] = {(m, i): [] for m in cells for i in range(len(prompts))}
    ratios: dict[tuple[str, int], list[float]] = {(m, i): [] for m in methods for i in range(len(prompts))}
    outputs: dict[tuple[str, int], list[int]] = {}
    for r in range(args.rounds):
        for i in range(len(prompts)):
            # plain runs first and last, the methods between (order alternating): each method's
            # ratio is to the mean of the two plain runs around it, so that a drift of the host's
            # speed within the round (+-5-10% here) moves both sides alike
            order = methods if (r + i) % 2 == 0 else methods[::-1]
            before = run("plain", ids[i])
            got = {m: run(m, ids[i]) for m in order}
            after = run("plain", ids[i])
            baseline = (before["seconds"] + after["seconds"]) / 2
            times["plain", i].append(baseline)
            outputs["plain", i] = after["token_ids"]
            for m in methods:
                if args.trace:
                    trace(r, tasks[i], m, got[m], baseline)
                times[m, i].append(got[m]["seconds"])
                ratios[m, i].append(baseline / got[m]["seconds"])
                outputs[m, i] = got[m]["token_ids"]
    plain = [statistics.median(times["plain", i]) for i in range(len(prompts))]
    print(f"{cpu_label()}, {args.rounds} rounds, {args.max_tokens} tokens; x plain (all: sum of plain medians / sum "
          f"of the method's; per prompt: median over rounds of the ratio to the plain runs around it)")
    for m in methods:
        mine = [statistics.median(times[m, i]) for i in range(len(prompts))]
        same = all(outputs[m, i] == outputs["plain", i] for i in range(len(prompts)))
        per = [statistics.median(ratios[m, i]) for i in range(len(prompts))]
        per_prompt = " ".join(f"{t}:{x:.2f}" for t, x in zip(tasks, per))
        # each round's own "all" (its plain runs over its method runs): how far one round moves it
        n = len(prompts)
        rounds = [sum(times["plain", i][r] for i in range(n)) / sum(times[m, i][r] for i in range(n))
                  for r in range(args.rounds)]
        print(f"{m:11s} all {sum(plain) / sum(mine):.3f} (rounds {min(rounds):.3f}-{max(rounds):.3f})  "
              f"min {min(per):.2f}  {per_prompt}  identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
