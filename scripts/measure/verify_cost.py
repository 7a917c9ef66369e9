"""Cost of one target pass against its number of rows (what a verified draft node costs).

    python scripts/measure/verify_cost.py [--model PATH] [--context 256] [--threads 2] [--rows 1,2,4,8] [--rounds 3]

Prints, for each row count (default 1..64) at the given context, the time of a forward pass that
returns logits for every row (median of --repeats passes; with --rounds N the row counts are swept N
times and the least median is kept, which steadies a noisy host), and its ratio to the first row
count's (the curve the engine measures at start-up: engine/costs.py, `measure_cost_curve`). Same
weights as `specdecode generate` loads them (a GGUF file: its own quantization). On a mixture-of-experts
model it also prints the distinct experts a pass read, per MoE layer on average (`FusedDecoder.moe_count`):
what a verify pass costs there grows with that union, not with the rows alone (random tokens on random
weights route evenly: the worst case).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.forward import ForwardBatch
from specdecode.models.loader import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rows", default="1,2,4,6,8,12,16,24,32,48,64", help="comma-separated row counts (1..64)")
    p.add_argument("--rounds", type=int, default=1, help="sweeps of the row counts; the least median is kept")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, progress=False)
    model = lm.model
    cache = model.new_cache(1, args.context + 80)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(model.vocab_size, 1000), (1, args.context), generator=gen)
    model.run(ForwardBatch.chain(prompt, 0), cache)                     # the prompt's keys, no logits
    print(f"{lm.name} ({lm.weights_kind}), context {args.context}, {args.threads} threads")
    row_counts = [int(r) for r in args.rows.split(",")]
    if not row_counts or not all(1 <= r <= 64 for r in row_counts) or args.rounds < 1:
        raise SystemExit(f"--rows takes counts in 1..64 and --rounds >= 1, got {args.rows!r} / {args.rounds}")
    best: dict[int, float] = {}
    experts: dict[int, float] = {}
    counts = getattr(getattr(model, "fused", None), "moe_count", None)     # a MoE model's per-layer union
    moe_layers = sum(model.config.moe_layers) if counts is not None else 0
    for _ in range(args.rounds):
        for rows in row_counts:
            tokens = torch.randint(0, min(model.vocab_size, 1000), (1, rows), generator=gen)
            index = torch.arange(rows)[None]
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                model.logits(model.run(ForwardBatch.chain(tokens, args.context, logit_index=index), cache), index)
                times.append(time.perf_counter() - t0)
            if moe_layers:
                experts[rows] = int(counts.sum()) / moe_layers
            best[rows] = min(best.get(rows, float("inf")), statistics.median(times) * 1e3)
    base = best[row_counts[0]]
    for rows in row_counts:
        union = f"  {experts[rows]:6.1f} experts / layer" if rows in experts else ""
        print(f"{rows:3d} rows  {best[rows]:7.1f} ms  {best[rows] / base:5.2f} steps{union}")


if __name__ == "__main__":
    main()
