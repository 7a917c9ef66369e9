"""Speculation's value against acceptance, without a drafter of that acceptance: the target's own greedy
output as a predicted output (`--prediction`), corrupted at a chosen rate, verifies like a drafter whose
drafts are accepted at that rate. For a model file: tokens/s against acceptance and the break-even.

    python scripts/measure/acceptance_curve.py --model FILE [--rates 0.3,0.5,0.7,0.8,0.9,1.0] [--k 1,2,4]
        [--prompts 3] [--tokens 128] [--rounds 3] [--threads 2] [--no-chat] [--lookup] [--json out.json]

Per prompt (the first Spec-Bench prompt of each task, then the next ones) plain greedy decoding gives the
reference; per rate a, each of its tokens is replaced by another random token with probability 1 - a
(seeded per prompt and rate), and that is the request's prediction. By default the prediction is read at
the answer's own position (the answer is the reference, so drafts at position i are the corrupted tokens
i, i+1, ...: each draft position accepted with probability a, independently); with `--lookup` it goes
through the text and the n-gram alignment of `--prediction FILE` (a corrupted token costs the drafts
until the alignment finds the answer again). Arms: every rate at each fixed k of `--k` (drafting k every
step, `--no-adaptive`: the raw value of such drafts) and at the controller's choice (`auto`, k = the
largest: what `specdecode generate --prediction` does). Each round runs plain first and last and the arms
between, in an order that reverses every round; an arm's ratio is its decode time against the mean of
the two plain runs around it (decode: the call's time less its prefill).

Prints per arm and rate: decode tokens/s, x plain (median over rounds and prompts, the rounds' range),
the measured acceptance per draft position (first position's accepted / drafted), accepted / drafted
tokens, the mean accepted length (tokens per verify step, the bonus included); then per arm the
break-even acceptance (where x plain crosses 1, interpolated between rates; the range over rounds). On
a mixture of experts with random weights the routing is random: the worst case for the union of experts
a verify pass reads, so the break-even printed is an upper bound for real weights (the output says so).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))    # this checkout's specdecode


def parse_list(text: str, kind, name: str, low, high) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{name} takes comma-separated numbers, got {text!r}") from None
    if not values or not all(low <= v <= high for v in values):
        raise SystemExit(f"{name} takes values in [{low}, {high}], got {text!r}")
    return values


def corrupt(ids: list[int], rate: float, vocab: int, seed: int) -> list[int]:
    """`ids` with each token replaced, with probability 1 - rate, by another token drawn at random."""
    rng = random.Random(seed)
    out = []
    for t in ids:
        if rng.random() < rate:
            out.append(t)
            continue
        other = rng.randrange(vocab - 1)
        out.append(other + (other >= t))
    return out


def break_even(points: list[tuple[float, float]]) -> str:
    """Where (acceptance, x plain) points, sorted by acceptance, cross 1 (the first crossing upward)."""
    points = sorted(points)
    if points and points[0][1] >= 1.0:
        return f"<= {points[0][0]:.2f}"
    for (a0, x0), (a1, x1) in zip(points, points[1:]):
        if x0 < 1.0 <= x1:
            return f"{a0 + (a1 - a0) * (1.0 - x0) / (x1 - x0):.2f}"
    return f"> {points[-1][0]:.2f}" if points else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rates", default="0.3,0.5,0.7,0.8,0.9,1.0", help="acceptances to corrupt to (0 .. 1)")
    ap.add_argument("--k", default="1,2,4", help="fixed draft sizes (each drafts k every step); auto uses the largest")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-chat", action="store_true", help="the prompts as plain text (no chat template)")
    ap.add_argument("--lookup", action="store_true", help="the prediction as text, aligned by n-gram lookups")
    ap.add_argument("--json", default=None, help="write every run's figures there")
    args = ap.parse_args()
    rates = parse_list(args.rates, float, "--rates", 0.0, 1.0)
    ks = parse_list(args.k, int, "--k", 1, 16)
    for name, value in (("--prompts", args.prompts), ("--tokens", args.tokens), ("--rounds", args.rounds)):
        if value < 1:
            raise SystemExit(f"{name} must be >= 1, got {value}")

    from specdecode import LLM, SamplingParams
    from specdecode.datasets import spec_bench
    from specdecode.drafters import prediction as prediction_module
    from specdecode.drafters.registry import build_drafter
    from specdecode.engine import offline
    from specdecode.fast.linear import cpu_label

    llm = LLM(args.model, method="none", num_speculative_tokens=0, threads=args.threads, progress=False,
              prefix_cache=False)
    target = llm.target
    vocab = target.model.vocab_size
    bench = spec_bench()
    tasks = list(dict.fromkeys(q.task for q in bench))
    chosen = [next(q for q in bench if q.task == t) for t in tasks]
    chosen += [q for q in bench if q not in chosen]
    prompts = [llm.encode(q.text, q.chat and not args.no_chat) for q in chosen[:args.prompts]]

    planted: dict[str, list[int]] = {}                    # prediction text -> the ids read at the answer's position

    class AtPosition(prediction_module.PredictionIndex):
        """A prediction read at the answer's own position (the answer being the reference)."""

        def __init__(self, ids: list[int]) -> None:
            super().__init__(planted.get(current[0], ids))

        def draft(self, output: list[int], k: int) -> list[int]:
            return self.ids[len(output):len(output) + k]

    current = [""]
    if not args.lookup:
        prediction_module.PredictionIndex = AtPosition    # read by the engine core as it admits a request

    arms = [(f"k={k}", k, False) for k in ks] + [("auto", max(ks), True)]
    cores = {"plain": offline.offline_core(target, None, 0)}
    for name, k, adaptive in arms:
        cores[name] = offline.offline_core(target, build_drafter("ngram", target), k, adaptive)

    def run(arm: str, i: int, prediction: str | None) -> dict:
        core = cores[arm]
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, prediction=prediction)
        current[0] = prediction or ""
        offline.prepare(core, 1, len(prompts[i]) + args.tokens)
        seq = offline.run(core, [prompts[i]], [params])[0]
        st = seq.stats
        decode = st.total_seconds - st.prefill_seconds
        first = (st.accepted_per_position[0] / st.drafted_per_position[0]) if st.drafted_per_position and \
            st.drafted_per_position[0] else None
        return {"ids": list(seq.output_ids), "decode_s": decode, "tokens": len(seq.output_ids), "steps": st.steps,
                "drafted": st.drafted, "accepted": st.accepted, "first_position": first}

    read = "through n-gram lookups of its text" if args.lookup else "at the answer's own position"
    print(f"{cpu_label()}; {target.name}; {len(prompts)} prompts x {args.rounds} rounds, {args.tokens} tokens, greedy; "
          f"the prediction read {read}", flush=True)
    moe = getattr(target.model.config, "moe", None)
    if moe is not None:
        print(f"mixture of experts ({moe['used']} of {moe['experts']} routed): with random weights the routing is "
              f"random, the worst case for the union of experts a verify pass reads", flush=True)
    references = [run("plain", i, None)["ids"] for i in range(len(prompts))]      # warm-up and the references
    texts: dict[tuple[int, float], str] = {}
    for i, ref in enumerate(references):
        for rate in rates:
            ids = corrupt(ref, rate, vocab, seed=1000 * i + round(rate * 100))
            text = target.tokenizer.decode(ids)
            if not args.lookup:                                   # unique per prompt and rate; ids planted
                text = f"{i}:{rate}:{text}"
                planted[text] = ids
            texts[i, rate] = text
    cells = [(name, rate) for name, _, _ in arms for rate in rates]
    runs: dict[tuple[str, float], list[dict]] = {c: [] for c in cells}
    identical = True
    for r in range(args.rounds):
        for i in range(len(prompts)):
            order = cells if (r + i) % 2 == 0 else cells[::-1]
            before = run("plain", i, None)
            got = {c: run(c[0], i, texts[i, c[1]]) for c in order}
            after = run("plain", i, None)
            plain = (before["decode_s"] + after["decode_s"]) / 2
            for c, x in got.items():
                identical &= x["ids"] == references[i]
                x.update(round=r, prompt=i, ratio=plain / x["decode_s"], plain_decode_s=plain)
                x.pop("ids")
                runs[c].append(x)
    print(f"{'arm':<7}{'rate':>5}{'tok/s':>8}{'x plain':>9}  {'(rounds)':<13}{'acc/pos':>8}{'acc/drafted':>12}"
          f"{'MAL':>6}")
    curve: dict[str, list[tuple[float, float]]] = {}
    per_round: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for name, _, _ in arms:
        for rate in rates:
            xs = runs[name, rate]
            ratio = statistics.median(x["ratio"] for x in xs)
            rounds = [sum(x["plain_decode_s"] for x in xs if x["round"] == q)
                      / sum(x["decode_s"] for x in xs if x["round"] == q) for q in range(args.rounds)]
            tok_s = sum(x["tokens"] for x in xs) / sum(x["decode_s"] for x in xs)
            drafted = sum(x["drafted"] for x in xs)
            accepted = sum(x["accepted"] for x in xs)
            firsts = [x["first_position"] for x in xs if x["first_position"] is not None]
            first = statistics.mean(firsts) if firsts else None
            mal = sum(x["tokens"] for x in xs) / max(sum(x["steps"] for x in xs), 1)
            measured = first if first is not None else rate
            curve.setdefault(name, []).append((measured, ratio))
            for q, x in enumerate(rounds):
                per_round.setdefault(name, {}).setdefault(q, []).append((measured, x))
            print(f"{name:<7}{rate:>5.2f}{tok_s:>8.1f}{ratio:>8.2f}x  ({min(rounds):.2f}-{max(rounds):.2f}){'':<2}"
                  f"{(f'{first:.2f}' if first is not None else '-'):>8}"
                  f"{(f'{accepted / drafted:.2f}' if drafted else '-'):>12}{mal:>6.2f}", flush=True)
    print("break-even acceptance per draft position (x plain = 1; the rounds' own in brackets):")
    for name, _, _ in arms:
        spread = ", ".join(break_even(p) for p in per_round[name].values())
        print(f"  {name:<7}{break_even(curve[name]):>8}  ({spread})")
    print(f"outputs identical to plain decoding: {'yes' if identical else 'NO'}")
    if moe is not None:
        print("(random routing: the worst case for the expert union; real weights route more alike)")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_label(), "model": target.name, "command": sys.argv,
                                               "runs": {f"{a}@{rate}": v for (a, rate), v in runs.items()}},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
