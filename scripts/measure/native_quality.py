"""How close the native quantized path stays to the same weights in fp32.

    python scripts/measure/native_quality.py [--model PATH] [--prompts 8] [--tokens 300]

Teacher-forces the first tokens of Spec-Bench questions (every `len // prompts`-th of the 480)
through the model on its native quantized weights and through the same weights dequantized to fp32
(eager reference), and prints the mean KL divergence of the next-token distributions
(KL(fp32 || native), per position) and the top-1 agreement; with --bf16 also the dense bf16 path's,
with --llamacpp also llama.cpp's on the same file (llama-cpp-python, logits of every position).
Only the native path's int8 activations (and bf16 hidden states) differ: the weights are the same.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.forward import ForwardBatch
from specdecode.models.loader import load_model

QUESTIONS = Path(__file__).resolve().parents[2] / "specdecode/data/spec_bench/question.jsonl"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=300, help="at most this many tokens per prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="also the dense bf16 weights")
    p.add_argument("--llamacpp", action="store_true", help="also llama.cpp on the same GGUF file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    questions = [json.loads(line) for line in QUESTIONS.open()]
    step = max(1, len(questions) // args.prompts)
    texts = [q["turns"][0] for q in questions[::step][:args.prompts]]
    reference = load_model(args.model, dtype="fp32", weights="dense", progress=False)
    ids = [reference.tokenizer.encode(t)[:args.tokens] for t in texts]

    def logits(lm, row):
        cache = lm.model.new_cache(1, len(row) + 4)
        index = torch.arange(len(row))[None]
        return lm.model.logits(lm.model.run(ForwardBatch.chain(torch.tensor([row]), 0, logit_index=index), cache),
                               index).float()[0]

    want = [logits(reference, row) for row in ids]
    candidates = [load_model(args.model, progress=False)]
    if args.bf16:
        candidates.append(load_model(args.model, dtype="bf16", weights="dense", progress=False))
    for lm in candidates:
        agree = total = 0
        kl = 0.0
        for row, ref in zip(ids, want):
            got = logits(lm, row)
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            total += len(row)
            kl += float(F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum"))
        print(f"{lm.name}: {lm.weights_kind} against fp32: mean KL {kl / total:.4f}, top-1 agreement "
              f"{agree / total:.1%} over {total} positions of {len(ids)} prompts")
    if args.llamacpp:
        from llama_cpp import Llama

        from specdecode.models.loader import default_model_path
        path = str(args.model or default_model_path())
        llm = Llama(model_path=path, n_ctx=args.tokens + 8, logits_all=True, n_threads=args.threads, verbose=False)
        agree = total = 0
        kl = 0.0
        for row, ref in zip(ids, want):
            llm.reset()
            llm.eval(row)
            got = torch.tensor(llm.scores[:len(row)], dtype=torch.float32)
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            total += len(row)
            kl += float(F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum"))
        print(f"llama.cpp on {Path(path).name} against fp32: mean KL {kl / total:.4f}, top-1 agreement "
              f"{agree / total:.1%} over {total} positions")


if __name__ == "__main__":
    main()
