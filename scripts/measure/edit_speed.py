"""Edits where speculation pays most: the first edit request of each shipped code-edit session
(specdecode/data/sessions: "rename X ... reply with the whole file"), answered by `LLM.generate`
plain, with the default drafter, and with the original file as a predicted output, alternating
per round. Greedy; prints per arm the median tok/s (prefill included and decode only), mean
accepted length, the speed-ups over plain, and whether every answer was identical to plain's.

    python scripts/measure/edit_speed.py --model ~/.cache/specdecode/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    python scripts/measure/edit_speed.py --sessions 2 --rounds 3 --max-tokens 700 --json edit.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))    # this checkout's specdecode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--method", default=None)
    ap.add_argument("--sessions", type=int, default=4, help="edit sessions (first edit of each)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=800)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from specdecode import LLM, SamplingParams
    from specdecode.bench.sessions_data import load
    from specdecode.fast.linear import cpu_label as cpu_name
    llm = LLM(model=args.model, method=args.method, threads=args.threads, progress=False, prefix_cache=False)
    sessions = [s for s in load() if s.kind == "edit"][:args.sessions]
    arms = ("plain", "default", "prediction")
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    llm.generate([[{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=4), chat=True)   # warm-up
    for r in range(args.rounds):
        for i, s in enumerate(sessions):
            prompt = [{"role": "user", "content": s.turns[0].user.replace("{file}", s.file)}]
            order = arms[(r + i) % 3:] + arms[:(r + i) % 3]
            for arm in order:
                params = SamplingParams(max_tokens=args.max_tokens, prediction=s.file if arm == "prediction" else None)
                out = llm.generate([prompt], params, chat=True,
                                   num_speculative_tokens=0 if arm == "plain" else None)[0]
                st = out.stats
                decode = st["total_s"] - st["prefill_s"]
                runs[arm].append({"session": s.id, "round": r, "tokens": st["num_tokens"], "ids": out.token_ids,
                                  "total_s": st["total_s"], "prefill_s": st["prefill_s"],
                                  "tok_s": st["num_tokens"] / st["total_s"],
                                  "decode_tok_s": (st["num_tokens"] - 1) / decode if decode > 0 else None,
                                  "mean_accepted_length": st["mean_accepted_length"],
                                  "accepted_prediction_tokens": st.get("accepted_prediction_tokens")})
    plain = {(x["session"], x["round"]): x for x in runs["plain"]}
    print(f"{cpu_name()}; {llm.target.name}; {len(sessions)} edits x {args.rounds} rounds, greedy, "
          f"max {args.max_tokens} tokens; median per arm")
    print(f"{'arm':<12}{'tok/s':>8}{'decode':>9}{'x plain':>9}{'x decode':>10}{'MAL':>7}  identical")
    base = statistics.median(x["tok_s"] for x in runs["plain"])
    base_decode = statistics.median(x["decode_tok_s"] for x in runs["plain"])
    for arm in arms:
        tok_s = statistics.median(x["tok_s"] for x in runs[arm])
        decode = statistics.median(x["decode_tok_s"] for x in runs[arm])
        same = sum(x["ids"] == plain[(x["session"], x["round"])]["ids"] for x in runs[arm])
        mal = statistics.mean(x["mean_accepted_length"] for x in runs[arm])
        print(f"{arm:<12}{tok_s:>8.1f}{decode:>9.1f}{tok_s / base:>8.2f}x{decode / base_decode:>9.2f}x{mal:>7.2f}  "
              f"{same}/{len(runs[arm])}")
    if args.json:
        for rows in runs.values():
            for x in rows:
                x.pop("ids")
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "model": llm.target.name, "command": sys.argv,
                                               "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
