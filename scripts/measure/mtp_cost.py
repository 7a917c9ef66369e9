"""Cost of one token drafted by a Qwen3.5 model's MTP head against one plain decode step of the model.

    python scripts/measure/mtp_cost.py --model qwen35-0.8b-random-q8_0-mtp.gguf [--rounds 5] [--temperature 0]

(make_random_gguf.py --mtp writes such a file.) One loaded model, `--method mtp`, draft sizes fixed;
each round answers a prompt plainly, then with one draft per step, then with `--chain` drafts per
step, arms in turn. Timed in place: every call of the drafter's `propose` (a catch-up pass over the
slots the last step verified, then one head pass per further draft, each through the shared LM head)
and every plain step's target pass (`run` and `logits` of one token). Prints the medians over all
calls: a plain step, a propose per token it drafted, and their ratio (what a drafted token costs in
plain steps), and the share of the LM head (its rows: all, or head_vocab's) in a drafted token.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))    # this checkout's specdecode

PROMPT = "speculative decoding drafts tokens and verifies them in one pass of the target model. " * 3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Qwen3.5 GGUF file or directory with an MTP head")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=48, help="tokens generated per arm and round")
    p.add_argument("--chain", type=int, default=3, help="drafts per step of the chained arm")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy drafts (argmax only); else sampled")
    p.add_argument("--drafter-option", dest="options", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the mtp drafter (as `generate`), e.g. min_confidence=0.3")
    args = p.parse_args()
    if args.rounds < 1 or args.tokens < 2 or args.chain < 2:
        raise SystemExit(f"--rounds >= 1, --tokens >= 2 and --chain >= 2, got {args.rounds}, {args.tokens}, "
                         f"{args.chain}")

    from specdecode import LLM, SamplingParams
    from specdecode.cli_common import drafter_option
    from specdecode.fast.linear import cpu_label
    options = dict(drafter_option(o) for o in args.options)
    llm = LLM(args.model, method="mtp", adaptive=False, progress=False, prefix_cache=False, **options)
    model, drafter = llm.target.model, llm.drafter
    times: dict[str, list[float]] = {"plain": [], "propose1": [], "propose_chain": [], "head": []}
    arm = {"name": None, "run": 0.0, "head": 0.0}

    def timed(owner, name: str, record) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            started = time.perf_counter()
            out = inner(*a, **k)
            record(time.perf_counter() - started, a, out)
            return out
        setattr(owner, name, wrapper)

    def on_run(dt, a, out):
        arm["run"] = dt if a[0].tokens.shape[1] == 1 else None       # a one-token pass (not the prefill)

    def on_logits(dt, a, out):
        if arm["name"] == "plain" and arm["run"] is not None:
            times["plain"].append(arm["run"] + dt)

    def on_head(dt, a, out):
        arm["head"] += dt

    def on_propose(dt, a, out):
        drafted = int(out.num_tokens.sum())
        if arm["name"] != "plain" and drafted:
            times["propose1" if arm["name"] == 1 else "propose_chain"].append(dt / drafted)
            times["head"].append(arm["head"] / drafted)
        arm["head"] = 0.0
    timed(drafter, "_draft_logits", on_head)
    timed(model, "run", on_run)
    timed(model, "logits", on_logits)
    timed(drafter, "propose", on_propose)
    params = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=1, ignore_eos=True)
    llm.generate(PROMPT, params, num_speculative_tokens=args.chain)          # warm-up: kernels, cost curve
    for key in times:
        times[key].clear()
    for _ in range(args.rounds):
        for name, k in (("plain", 0), (1, 1), ("chain", args.chain)):
            arm["name"] = name
            llm.generate(PROMPT, params, num_speculative_tokens=k)
    plain = statistics.median(times["plain"])
    print(f"{llm.target.name} ({llm.target.weights_kind}), {cpu_label()}, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}, {args.rounds} rounds")
    print(f"plain step (target run + logits, 1 token): median {plain * 1e3:.2f} ms over {len(times['plain'])}")
    for key, label in (("propose1", "1 draft per step"), ("propose_chain", f"{args.chain} drafts per step")):
        cost = statistics.median(times[key])
        print(f"MTP propose, {label}: median {cost * 1e3:.2f} ms per drafted token over {len(times[key])} calls "
              f"= {cost / plain:.3f} plain steps")
    head = statistics.median(times["head"])
    print(f"  of which the LM head (final norm, {len(drafter.draft_vocab)} of {model.config.vocab_size} rows): "
          f"median {head * 1e3:.2f} ms per drafted token = {head / plain:.3f} plain steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
