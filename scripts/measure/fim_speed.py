"""Fill in the middle with speculation on and off, arms alternating: a loader of orders written
between a loader of users it mirrors and the code that calls both (Qwen2.5-Coder's FIM format, or
whichever the model's vocabulary carries). Prints the median speed-up, whether the middles are
identical, and whether prefix + middle + suffix compiles.

    python scripts/measure/fim_speed.py --model ~/.cache/specdecode/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))    # this checkout's specdecode

PREFIX = '''import csv
import json


def load_users(path: str) -> list[dict]:
    """Read users from a CSV file and return them as dictionaries."""
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        for row in reader:
            row["id"] = int(row["id"])
            row["name"] = row["name"].strip()
            row["email"] = row["email"].strip().lower()
            rows.append(row)
    return rows


def load_orders(path: str) -> list[dict]:
'''
SUFFIX = '''


def main() -> None:
    users = load_users("users.csv")
    orders = load_orders("orders.csv")
    print(json.dumps({"users": len(users), "orders": len(orders)}))


if __name__ == "__main__":
    main()
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()
    from specdecode import LLM, SamplingParams
    llm = LLM(model=args.model)
    ids, stops = llm.fim_prompt(PREFIX, SUFFIX)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, stop_token_ids=stops)
    llm.generate(ids, params)                                     # warm-up
    seconds: dict[str, list[float]] = {"on": [], "off": []}
    outs = {}
    for r in range(args.rounds):
        for arm in ("on", "off") if r % 2 == 0 else ("off", "on"):
            started = time.perf_counter()
            outs[arm] = llm.generate(ids, params, num_speculative_tokens=None if arm == "on" else 0)[0]
            seconds[arm].append(time.perf_counter() - started)
    on, off = statistics.median(seconds["on"]), statistics.median(seconds["off"])
    rounds = [round(b / a, 2) for a, b in zip(seconds["on"], seconds["off"])]
    middle = outs["on"].text
    try:
        compile(PREFIX + middle + SUFFIX, "middle", "exec")
        compiles = "yes"
    except SyntaxError as exc:
        compiles = f"no ({exc})"
    print(f"{len(outs['on'].token_ids)} tokens; speculation on {on:.3f} s, off {off:.3f} s: {off / on:.2f}x "
          f"(rounds {rounds}); identical: {outs['on'].token_ids == outs['off'].token_ids}; compiles: {compiles}")
    print(middle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
