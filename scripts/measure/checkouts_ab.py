"""Two checkouts of specdecode side by side: each runs in a worker process of its own (its package
first on the path), and the driver hands both the same calls in turn, so that a busy moment of a
shared CPU falls on both. Prints per scenario the median tokens per second of each checkout and
their ratio (new / old), and whether their outputs were identical.

    python scripts/measure/checkouts_ab.py --old ../base --new . --scenario single --rounds 5
    python scripts/measure/checkouts_ab.py --old ../base --new . --scenario pair \\
        --model M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --draft M/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

Scenarios (greedy, chat template, 128 new tokens unless --max-tokens): `single` (each of seven
prompts alone, plain and with the default drafter), `batch` (3 and 4 prompts in one call; 24 in one
call, plain and speculative), `seeded` (temperature 0.8, a seed per prompt, plain and speculative),
`pair` (8 prompts in one call, and the same 8 one by one).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, sys, time
from specdecode import LLM, SamplingParams
options = json.loads(sys.argv[1])
llm = LLM(progress=False, **options)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    params = [SamplingParams(**p) for p in job["params"]]
    started = time.perf_counter()
    outs = llm.generate(job["prompts"], params, chat=True, num_speculative_tokens=job.get("k"))
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "tokens": [o.token_ids for o in outs],
                      "mean_accepted_length": [o.stats["mean_accepted_length"] for o in outs]}), flush=True)
"""
TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag", "writing")
LIST = ("Repeat this list exactly, then add one item: apples, bananas, cherries, dates, elderberries, figs, grapes, "
        "honeydew melons.")


def prompts() -> list[str]:
    """The first prompt of each of six Spec-Bench tasks (from the package's data), then a list to repeat."""
    path = Path(__file__).resolve().parents[2] / "specdecode" / "data" / "spec_bench" / "question.jsonl"
    first: dict[str, str] = {}
    for line in path.read_text().splitlines():
        q = json.loads(line)
        first.setdefault(q["category"], q["turns"][0])
    return [first[t] for t in TASKS] + [LIST]


class Worker:
    def __init__(self, checkout: str, options: dict) -> None:
        env_path = str(Path(checkout).resolve())
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(options)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**__import__("os").environ,
                                                                              "PYTHONPATH": env_path})
        assert json.loads(self.proc.stdout.readline())["ready"]

    def call(self, prompts: list[str], params: list[dict], k: int | None = None) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "params": params, "k": k}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def jobs(scenario: str, max_tokens: int) -> list[tuple[str, list[str], list[dict], int | None]]:
    """(label, prompts, params, k) of one round."""
    ps, greedy = prompts(), {"max_tokens": max_tokens}
    if scenario == "single":
        return [(f"{kind} p{i}", [p], [greedy], 0 if kind == "plain" else None)
                for i, p in enumerate(ps) for kind in ("plain", "spec")]
    if scenario == "batch":
        work = (ps * 4)[:24]
        return [("3 in one call", ps[:3], [greedy] * 3, None), ("4 in one call", ps[:4], [greedy] * 4, None),
                ("24 plain", work, [greedy] * 24, 0), ("24 spec", work, [greedy] * 24, None)]
    if scenario == "seeded":
        return [(f"{kind} p{i}", [p], [{**greedy, "temperature": 0.8, "seed": 100 + i}], 0 if kind == "plain" else None)
                for i, p in enumerate(ps[:6]) for kind in ("plain", "spec")]
    if scenario == "pair":
        work = (ps + ps)[:8]
        return [("8 in one call", work, [greedy] * 8, None)] + [(f"alone p{i}", [p], [greedy], None)
                                                                for i, p in enumerate(work)]
    raise ValueError(scenario)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the checkout to compare against (a folder holding specdecode/)")
    ap.add_argument("--new", default=".", help="the checkout measured (default: this one)")
    ap.add_argument("--scenario", choices=["single", "batch", "seeded", "pair"], default="single")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="LLM(prefix_cache=False): a call does not find an earlier call's prompt in the cache")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()
    options = {k: v for k, v in (("model", args.model), ("draft", args.draft)) if v}
    if args.no_prefix_cache:
        options["prefix_cache"] = False
    workers = {"old": Worker(args.old, options), "new": Worker(args.new, options)}
    todo = jobs(args.scenario, args.max_tokens)
    for _, batch, _, k in todo[:2]:                          # warm-up: kernels, cost curves
        for w in workers.values():
            w.call(batch[:1], [{"max_tokens": 8}], k)
    seen: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list] = {}
    records = []
    for r in range(args.rounds):
        for label, batch, params, k in todo:
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for name in order:
                out = workers[name].call(batch, params, k)
                rate = sum(map(len, out["tokens"])) / out["seconds"]
                seen.setdefault((label, name), []).append(rate)
                outputs[(label, name)] = out["tokens"]
                records.append({"round": r, "label": label, "checkout": name, "tok_s": rate,
                                "mean_accepted_length": out["mean_accepted_length"]})
    for w in workers.values():
        w.close()
    print(f"{'call':<16}{'old tok/s':>11}{'new tok/s':>11}{'new/old':>9}  same")
    ratios = []
    for label, *_ in todo:
        old, new = statistics.median(seen[(label, "old")]), statistics.median(seen[(label, "new")])
        ratios.append(new / old)
        same = outputs[(label, "old")] == outputs[(label, "new")]
        print(f"{label:<16}{old:>11.1f}{new:>11.1f}{new / old:>9.3f}  {same}")
    print(f"{'geometric mean':<38}{statistics.geometric_mean(ratios):>9.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
