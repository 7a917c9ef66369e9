"""How much of each method's gain comes from outputs that repeat themselves.

    python scripts/analysis/repetition_share.py benchmarks/RUN_DIR [--ngram 4] [--threshold 0.5]

Reads a `specdecode bench` run's measurements.jsonl. For every prompt, the *self-repeat share*
of its plain output is the fraction of output tokens that lookup on the output itself predicts:
position t counts when the `--ngram` tokens before t occurred earlier in the output and were
followed there by the token at t (long answers of small models often loop). Prompts are split at
`--threshold` into "repeating" and "other"; for each method the table gives its speed-up in each
group (total tokens over total seconds, as the bench's tokens_per_s_total), the group's share of
the plain decoding time, and the share of all the time the method saved that was saved on the
repeating prompts.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def self_repeat_share(ids: list[int], n: int) -> float:
    """Fraction of positions whose token follows an n-gram seen earlier in `ids` with that token."""
    if len(ids) <= n:
        return 0.0
    seen: dict[tuple, set] = {}
    hits = 0
    for t in range(n, len(ids)):
        key = tuple(ids[t - n:t])
        followers = seen.get(key)
        hits += followers is not None and ids[t] in followers
        seen.setdefault(key, set()).add(ids[t])
    return hits / (len(ids) - n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--ngram", type=int, default=4)
    p.add_argument("--threshold", type=float, default=0.5)
    args = p.parse_args()
    records = [json.loads(line) for line in (Path(args.run_dir) / "measurements.jsonl").read_text().splitlines()]
    runs = [r for r in records if r.get("type") == "measurement" and r["system"] == "specdecode"]
    plain = {(r["task"], str(r["prompt_id"])): r for r in runs if r["method"] == "plain"}
    if not plain:
        raise SystemExit(f"{args.run_dir}: no specdecode plain measurements")
    share = {key: self_repeat_share(r["token_ids"], args.ngram) for key, r in plain.items()}
    repeating = {key for key, s in share.items() if s >= args.threshold}
    tokens = sum(len(r["token_ids"]) for r in plain.values())
    print(f"{len(plain)} prompts, {tokens} plain output tokens; self-repeat share (n={args.ngram}) mean "
          f"{sum(share.values()) / len(share):.2f}; {len(repeating)} prompts at >= {args.threshold:g} "
          f"({sum(len(plain[k]['token_ids']) for k in repeating) / tokens:.0%} of the tokens)")
    print("| method | k | speed-up all | repeating prompts | other prompts | repeating share of plain time "
          "| share of time saved on repeating |")
    print("|---|---|---|---|---|---|---|")
    cells = sorted({(r["method"], r["k"]) for r in runs if r["method"] != "plain"})
    for method, k in cells:
        own = {(r["task"], str(r["prompt_id"])): r for r in runs if (r["method"], r["k"]) == (method, k)}
        keys = [key for key in own if key in plain]

        def speed(group, own=own):
            spec_s = sum(own[key]["seconds"] for key in group)
            plain_s = sum(plain[key]["seconds"] for key in group)
            spec_tok = sum(own[key]["tokens"] for key in group)
            plain_tok = sum(plain[key]["tokens"] for key in group)
            return (spec_tok / spec_s) / (plain_tok / plain_s) if spec_s and plain_s and plain_tok else float("nan")

        def saved(group, own=own):    # plain seconds minus the method's, per token of the method's output
            return sum(plain[key]["seconds"] - own[key]["seconds"] * plain[key]["tokens"] / max(own[key]["tokens"], 1)
                       for key in group)

        rep = [key for key in keys if key in repeating]
        other = [key for key in keys if key not in repeating]
        total_saved = saved(keys)
        plain_time = sum(plain[key]["seconds"] for key in keys)
        rep_time = sum(plain[key]["seconds"] for key in rep)
        saved_share = f"{saved(rep) / total_saved:.0%}" if total_saved > 0 else "- (none saved overall)"
        print(f"| {method} | {k} | {speed(keys):.2f}x | {speed(rep):.2f}x ({len(rep)}) | {speed(other):.2f}x "
              f"({len(other)}) | {rep_time / plain_time:.0%} | {saved_share} |")


if __name__ == "__main__":
    main()
