"""Core performance figures, measured side by side in one run (not a test).

1. Plain decoding, batch 1: specdecode native vs Hugging Face transformers `generate`, same
   weights and dtype, greedy, N tokens; repeats interleaved to spread machine noise.
2. Fraction of the memory-bandwidth floor: weight bytes per token / read bandwidth measured now.
3. Cost of one verify pass of k+1 tokens, k = 1..8, relative to one decode step.
4. N-gram speculation on Spec-Bench summarization and RAG prompts: speed-up and mean accepted length.

Usage: python scripts/measure/perf_core.py [--dtype bf16] [--tokens 128] [--repeats 3] [--prompts 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from specdecode.bench.runner import read_bandwidth_gbs
from specdecode.forward import ForwardBatch


def time_plain_native(llm, ids, tokens: int) -> float:
    from specdecode import SamplingParams
    out = llm.generate([ids], SamplingParams(max_tokens=tokens, ignore_eos=True), num_speculative_tokens=0)[0]
    return out.stats["tokens_per_s"]


def time_plain_hf(hf, ids, tokens: int) -> float:
    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    elapsed = time.perf_counter() - t
    return (out.shape[1] - len(ids)) / elapsed


def verify_costs(model, prompt_len: int = 64, repeats: int = 20) -> dict[int, float]:
    """Median time of one forward of k+1 tokens at the same position / one of 1 token."""
    cache = model.new_cache(1, prompt_len + 16)
    model.run(ForwardBatch.chain(torch.zeros(1, prompt_len, dtype=torch.long), 0), cache)

    def timed(width: int) -> float:
        tokens = torch.zeros(1, width, dtype=torch.long)
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            model.logits(model.run(ForwardBatch.chain(tokens, prompt_len), cache))
            runs.append(time.perf_counter() - t)
        return statistics.median(runs)

    timed(1)
    one = timed(1)
    return {k: timed(k + 1) / one for k in range(1, 9)} | {0: one * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=5, help="Spec-Bench prompts per task for part 4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specdecode import LLM, SamplingParams, datasets

    report: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                                "torch": torch.__version__}, "dtype": args.dtype}
    llm = LLM(dtype=args.dtype, num_speculative_tokens=5, method="ngram", progress=False, prefix_cache=False)
    ids = llm.encode("Write a short story about a robot who learns to paint.", chat=True)
    llm.generate([ids], SamplingParams(max_tokens=8), num_speculative_tokens=0)

    # 1. plain decoding, native vs transformers, interleaved
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        hf = AutoModelForCausalLM.from_pretrained(str(llm.target.dense_path()), dtype=dtype).eval()
        time_plain_hf(hf, ids, 8)
    native, base = [], []
    for _ in range(args.repeats):
        native.append(time_plain_native(llm, ids, args.tokens))
        if hf is not None:
            base.append(time_plain_hf(hf, ids, args.tokens))
    report["plain_tokens_per_s"] = statistics.median(native)
    print(f"1. plain decoding, batch 1, {args.dtype}, {args.tokens} tokens: specdecode "
          f"{report['plain_tokens_per_s']:.1f} tok/s", end="")
    if base:
        report["transformers_tokens_per_s"] = statistics.median(base)
        report["native_over_transformers"] = report["plain_tokens_per_s"] / report["transformers_tokens_per_s"]
        print(f", transformers {report['transformers_tokens_per_s']:.1f} tok/s "
              f"-> {report['native_over_transformers']:.2f}x", end="")
    print()

    # 2. roofline
    bandwidth = read_bandwidth_gbs()
    weight_bytes = llm.target.model.weight_bytes()
    floor_ms = weight_bytes / bandwidth / 1e6
    measured_ms = 1e3 / report["plain_tokens_per_s"]
    report["roofline"] = {"read_bandwidth_gbs": bandwidth, "weight_mb": weight_bytes / 1e6,
                          "floor_ms_per_token": floor_ms, "measured_ms_per_token": measured_ms,
                          "fraction_of_floor": floor_ms / measured_ms}
    print(f"2. roofline: {weight_bytes / 1e6:.0f} MB of weights per token, read bandwidth {bandwidth:.1f} GB/s "
          f"-> floor {floor_ms:.2f} ms/token; measured {measured_ms:.2f} ms/token = "
          f"{floor_ms / measured_ms:.0%} of the floor")

    # 3. verify cost
    costs = verify_costs(llm.target.model)
    report["verify_cost_vs_decode_step"] = {k: round(v, 3) for k, v in costs.items() if k > 0}
    print(f"3. one verify pass of k+1 tokens / one decode step ({costs[0]:.2f} ms): " +
          ", ".join(f"k={k}: {costs[k]:.2f}x" for k in range(1, 9)))

    # 4. n-gram speculation on summarization and RAG
    report["ngram"] = {}
    for task in ("summarization", "rag"):
        prompts = datasets.load(task)[:args.prompts]
        plain_tps, spec_tps, lengths, same = [], [], [], 0
        for p in prompts:
            pid = llm.encode(p.text, chat=True)
            params = SamplingParams(max_tokens=args.tokens)
            a = llm.generate([pid], params, num_speculative_tokens=0)[0]
            b = llm.generate([pid], params, num_speculative_tokens=5)[0]
            plain_tps.append(a.stats["tokens_per_s"])
            spec_tps.append(b.stats["tokens_per_s"])
            lengths.append(b.stats["mean_accepted_length"])
            same += a.token_ids == b.token_ids
        speedup = statistics.mean(spec_tps) / statistics.mean(plain_tps)
        report["ngram"][task] = {"prompts": len(prompts), "plain_tokens_per_s": statistics.mean(plain_tps),
                                 "spec_tokens_per_s": statistics.mean(spec_tps), "speedup": speedup,
                                 "mean_accepted_length": statistics.mean(lengths), "identical": same}
        print(f"4. ngram k=5 on Spec-Bench {task} ({len(prompts)} prompts): {statistics.mean(plain_tps):.1f} -> "
              f"{statistics.mean(spec_tps):.1f} tok/s = {speedup:.2f}x, mean accepted length "
              f"{statistics.mean(lengths):.2f}, identical {same}/{len(prompts)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
