"""Plain decoding of one GGUF file: specdecode against llama.cpp (llama-cpp-python), arms alternating.

Both get the same prompt token ids and decode the same number of tokens greedily (no EOS stop), with
the same number of threads; a round times each arm once, and the report is the median tok/s over the
rounds (wall time of the whole call, the short prompt's pass included) and the median and range of the
rounds' own ratios (the arms of a round run back to back: a slow spell of a shared host weighs on
both). llama.cpp runs in a child
process of its own Python (--llamacpp-python: a venv where `pip install llama-cpp-python` built it),
loaded once and fed one request per round, so the two never run at the same time and neither needs
the other's packages.

--prefill N times a prompt's prefill instead: the first N tokens of the repository's README.md (repeated if
short) to the first token (max_tokens 1), both arms from an empty cache every round (specdecode's prefix
cache off; llama.cpp reset, its default n_batch 512), reported as prompt tokens/s.

Usage: python scripts/measure/plain_vs_llamacpp.py --model F.gguf --llamacpp-python ~/llama-venv/bin/python
       [--threads 2] [--tokens 128] [--rounds 3] [--json out.json]
       python scripts/measure/plain_vs_llamacpp.py --model F.gguf --llamacpp-python ~/llama-venv/bin/python
       --prefill 1024 [--threads 2] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Speculative decoding drafts tokens cheaply and verifies them in one pass of the target model, so"
CHILD = r"""
import json, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]),
            n_threads_batch=int(sys.argv[3]), verbose=False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    ids, n = json.loads(line)
    llm.reset()
    out, start = [], time.perf_counter()
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
        out.append(token)
        if len(out) == n:
            break
    print(json.dumps({"seconds": time.perf_counter() - start, "tokens": out}), flush=True)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the GGUF file both arms decode")
    parser.add_argument("--llamacpp-python", default=sys.executable,
                        help="the Python that has llama_cpp (default: this one)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--prefill", type=int, default=0,
                        help="time the prefill of a prompt of this many tokens (README.md's) instead of decoding")
    args = parser.parse_args(argv)
    for name in ("threads", "tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.prefill < 0:
        parser.error(f"--prefill must be >= 0 (0: time decoding), got {args.prefill}")

    from specdecode import LLM, SamplingParams
    llm = LLM(model=args.model, method="none", threads=args.threads, progress=False, prefix_cache=not args.prefill)
    ids = llm.tokenizer.encode(args.prompt)
    if args.prefill:            # README.md's first tokens; each round's tokens/s counts the prompt's
        readme = llm.tokenizer.encode((Path(__file__).resolve().parents[2] / "README.md").read_text())
        ids = (readme * (args.prefill // max(1, len(readme)) + 1))[:args.prefill]
        args.tokens = 1
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    child = subprocess.Popen([args.llamacpp_python, "-c", CHILD, args.model, str(len(ids) + args.tokens + 16),
                              str(args.threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if not json.loads(child.stdout.readline() or "{}").get("ready"):
        raise SystemExit(f"llama.cpp could not load {args.model} (its child process: {args.llamacpp_python})")
    llm.generate([ids], params)                                        # warm both arms once
    child.stdin.write(json.dumps([ids, args.tokens]) + "\n")
    child.stdin.flush()
    child.stdout.readline()
    rates: dict[str, list[float]] = {"specdecode": [], "llama.cpp": []}
    same = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        ours = llm.generate([ids], params)[0].token_ids
        rates["specdecode"].append((args.prefill or args.tokens) / (time.perf_counter() - start))
        child.stdin.write(json.dumps([ids, args.tokens]) + "\n")
        child.stdin.flush()
        theirs = json.loads(child.stdout.readline())
        rates["llama.cpp"].append((args.prefill or len(theirs["tokens"])) / theirs["seconds"])
        same.append(next((i for i, (a, b) in enumerate(zip(ours, theirs["tokens"])) if a != b), len(ours)))
    child.stdin.close()
    child.wait()
    medians = {arm: statistics.median(r) for arm, r in rates.items()}
    unit = "prompt tok/s" if args.prefill else "tok/s"
    for arm, r in rates.items():
        print(f"{arm:11s} median {medians[arm]:6.2f} {unit}  (rounds: {', '.join(f'{x:.2f}' for x in r)})")
    what = f"a {args.prefill}-token prompt to its first token" if args.prefill else f"{args.tokens} tokens"
    print(f"speed-up    {medians['specdecode'] / medians['llama.cpp']:.2f}x  ({what}, "
          f"{args.threads} threads, prompt {len(ids)} tokens; the first {min(same)} greedy tokens as llama.cpp's)")
    # a round's two arms run back to back, so a slow spell of the host weighs on both of its rates
    ratios = sorted(a / b for a, b in zip(rates["specdecode"], rates["llama.cpp"]))
    print(f"per round   median {statistics.median(ratios):.2f}x, range {ratios[0]:.2f}-{ratios[-1]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rates": rates, "medians": medians, "round_ratios": ratios, "tokens": args.tokens,
                       "prefill": args.prefill,
                       "threads": args.threads,
                       "prompt_tokens": len(ids), "same_prefix": min(same), "model": args.model}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
