"""How far can prompt-lookup drafting go on a workload? An offline replay of a bench run.

At temperature 0 the target's output does not depend on the drafter (specdecode is lossless),
so the plain decoding outputs recorded by `specdecode bench` fix, for any lookup drafter, which
drafts would be accepted. This script replays those outputs step by step, exactly as the
engine would run them (context = prompt + output so far; drafts capped so the output never
passes its length; a step emits the accepted drafts plus one target token), and prices each
step with the measured cost of a verify pass of k+1 tokens relative to one decode step
(`scripts/measure/perf_core.py`; benchmarks/RESULTS.md, "Verify-pass cost"). Reported per policy:

* mean accepted length (bonus included) and decode speed-up = tokens / summed step costs;
* the check that matters first: the replay of the shipped n-gram drafter must reproduce the
  mean accepted length the bench measured for it (same prompts, same outputs);
* bounds: the best draft length for each match length, fitted on this very data (an oracle,
  so an upper bound for any length rule); a tree of the m latest distinct lookup continuations
  verified in one pass (rows of the prefix tree priced by the same table); perfect drafts.

Usage: python scripts/analysis/lookup_ceiling.py benchmarks/full [--costs 1.09,1.15,...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from specdecode import LLM, datasets
from specdecode.drafters.ngram import latest_match, lookup, occurrences

# verify pass of k+1 tokens / one decode step, k = 1..8: the embedded model in bf16 (Zen 4, 2 threads),
# benchmarks/RESULTS.md, "Verify-pass cost"
DEFAULT_COSTS = (1.09, 1.15, 1.18, 1.20, 1.24, 1.29, 1.30, 1.41)


def cost_table(costs: list[float], rows: int) -> np.ndarray:
    """Cost of a step with j drafts, j = 0..rows: 1 for a plain step, the measured table, then
    extrapolated with the table's mean slope past its end."""
    slope = (costs[-1] - costs[0]) / max(len(costs) - 1, 1)
    extra = [costs[-1] + slope * (j + 1) for j in range(max(rows - len(costs), 0))]
    return np.array([1.0, *costs, *extra])


def tree_candidates(ids: np.ndarray, k: int, m: int, ngram_max: int = 4) -> list[tuple[int, ...]]:
    """The m latest distinct continuations over all match lengths, longest match first."""
    found: list[tuple[int, ...]] = []
    for n in range(min(ngram_max, len(ids) - 1), 0, -1):
        for start in occurrences(ids, n)[::-1] + n:
            cont = tuple(ids[start:start + k].tolist())
            if cont and not any(c[:len(cont)] == cont for c in found):
                found.append(cont)
                if len(found) == m:
                    return found
    return found


def replay(samples, propose, costs: np.ndarray) -> dict:
    """propose(context, room) -> list of candidate drafts (one for a chain, several for a tree);
    room = drafts the engine allows (max_tokens - output so far - 1)."""
    tokens = steps = 0
    cost = 0.0
    per_task: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in samples:
        out, i = s["output"], 0
        while i < len(out):
            context = np.asarray(s["prompt"] + out[:i], dtype=np.int64)
            candidates = [c for c in propose(context, s["max_tokens"] - i - 1) if c]
            best = 0
            for draft in candidates:
                a = 0
                while a < len(draft) and i + a < len(out) and draft[a] == out[i + a]:
                    a += 1
                best = max(best, a)
            rows = len({c[:j] for c in map(tuple, candidates) for j in range(1, len(c) + 1)})
            step_cost = costs[min(rows, len(costs) - 1)]
            cost += step_cost
            per_task[s["task"]][0] += step_cost
            emitted = min(best + 1, len(out) - i)
            per_task[s["task"]][1] += emitted
            i += emitted
            steps += 1
        tokens += len(out)
    return {"mean_accepted_length": tokens / steps, "decode_speedup": tokens / cost,
            "by_task": {t: round(v[1] / v[0], 3) for t, v in per_task.items()}}


def best_length_per_match(samples, k_max: int, costs: np.ndarray) -> tuple[dict, list[int]]:
    """Oracle: coordinate search of a draft length for each match length 1..4."""
    caps = [0] + [min(5, k_max)] * 4

    def rule(context, room):
        start, n = latest_match(context, 1, 4)
        return [context[start:start + min(caps[n], room)].tolist()] if n else []

    best = replay(samples, rule, costs)
    for _ in range(2):
        for n in range(1, 5):
            for k in range(0, k_max + 1):
                old, caps[n] = caps[n], k
                result = replay(samples, rule, costs)
                if result["decode_speedup"] > best["decode_speedup"]:
                    best = result
                else:
                    caps[n] = old
    return best, caps


def load_samples(bench_dir: Path, tasks: list[str] | None) -> tuple[list[dict], dict[tuple[str, int], float], dict]:
    run = json.loads((bench_dir / "run.json").read_text())
    config = run["config"]
    if config.get("temperature", 0.0) != 0.0:
        sys.exit("lookup_ceiling: the replay needs a greedy run (temperature 0)")
    if config.get("prompts_file"):
        sys.exit("lookup_ceiling: runs with --prompts-file are not supported")
    rows = [json.loads(line) for line in (bench_dir / "measurements.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("type") == "measurement" and r["system"] == "specdecode"
            and (tasks is None or r["task"] in tasks)]
    llm = LLM(model=config.get("model"), dtype=config.get("dtype", "bf16"), prefix_cache=False)
    texts = {(p.task, p.id): p for task in config["tasks"] for p in datasets.load(task)}
    samples = []
    for r in rows:
        if r["method"] != "plain":
            continue
        p = texts[(r["task"], r["prompt_id"])]
        prompt = llm.encode(p.text, chat=p.chat)
        if len(prompt) != r["prompt_tokens"]:
            sys.exit(f"lookup_ceiling: prompt {r['task']}/{r['prompt_id']} re-encodes to {len(prompt)} tokens, "
                     f"the run had {r['prompt_tokens']}")
        samples.append({"task": r["task"], "prompt": prompt, "output": list(r["token_ids"]),
                        "max_tokens": config["max_tokens"]})
    plain = [r for r in rows if r["method"] == "plain"]
    config["prefill_share"] = sum(r["prefill_s"] for r in plain) / max(sum(r["total_s"] for r in plain), 1e-9)
    measured: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        if r["method"] == "ngram":
            measured[("ngram", r["k"])][0] += r["emitted"]
            measured[("ngram", r["k"])][1] += r["steps"]
    return samples, {key: e / s for key, (e, s) in measured.items() if s}, config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench_dir", type=Path, help="output directory of a greedy `specdecode bench` run")
    parser.add_argument("--costs", default=",".join(map(str, DEFAULT_COSTS)),
                        help="verify pass of k+1 tokens / one decode step for k = 1, 2, ... "
                             "(default: benchmarks/RESULTS.md's, embedded model in bf16)")
    parser.add_argument("--k-max", type=int, default=12, help="longest draft tried (default 12)")
    parser.add_argument("--tasks", default=None, help="only these tasks (comma-separated; default all of the run)")
    parser.add_argument("--goal", type=float, default=2.5, help="end-to-end speed-up to size the drafts for")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    costs = cost_table([float(x) for x in args.costs.split(",")], 64)
    samples, measured, config = load_samples(args.bench_dir, args.tasks.split(",") if args.tasks else None)
    if not samples:
        sys.exit(f"lookup_ceiling: no specdecode plain measurements in {args.bench_dir}")
    print(f"{len(samples)} prompts, {sum(len(s['output']) for s in samples)} output tokens; "
          f"verify costs {', '.join(f'{c:.2f}' for c in costs[1:9])} (k = 1..8)\n")
    prefill = config["prefill_share"]
    print(f"prefill: {prefill:.1%} of plain decoding's wall time; end-to-end speed-up = "
          f"1 / (prefill + (1 - prefill) / decode speed-up)\n")
    figures = {}

    def show(name: str, result: dict, note: str = "") -> None:
        result["end_to_end_speedup"] = 1.0 / (prefill + (1.0 - prefill) / result["decode_speedup"])
        figures[name] = result
        print(f"| {name} | {result['mean_accepted_length']:.2f} | {result['decode_speedup']:.2f}x | "
              f"{result['end_to_end_speedup']:.2f}x | {note} |")

    print("| policy | mean acc. len | decode speed-up | end to end | note |\n|---|---|---|---|---|")
    for k in sorted({1, 2, 3, 5, 8, args.k_max}):
        result = replay(samples, lambda c, room, k=k: [lookup(c, min(k, room), 1, 4)], costs)
        note = f"bench measured {measured[('ngram', k)]:.2f}" if ("ngram", k) in measured else ""
        show(f"ngram k={k} (shipped drafter)", result, note)
    best, caps = best_length_per_match(samples, args.k_max, costs)
    show("best length per match length (oracle)", best, f"lengths for matches of 1..4 tokens: {caps[1:]}")
    for m in (2, 3):
        show(f"tree of {m} lookup candidates, k=5", replay(samples, lambda c, room, m=m:
             tree_candidates(c, min(5, room), m), costs))
    show("perfect drafts, k=8", {"mean_accepted_length": 9.0, "decode_speedup": 9.0 / costs[8], "by_task": {}},
         "every draft accepted")
    if 1.0 / args.goal > prefill:
        needed = (1.0 - prefill) / (1.0 / args.goal - prefill)
        print(f"\n{args.goal}x end to end needs a {needed:.2f}x decode speed-up: a mean accepted length of "
              f"{needed * costs[5]:.2f} at k=5 or {needed * costs[8]:.2f} at k=8 (bonus included).")
    else:
        print(f"\n{args.goal}x end to end is out of reach: prefill alone takes {prefill:.0%} of the time.")
    if args.json:
        args.json.write_text(json.dumps({"config": config, "costs": costs[:17].tolist(), "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
