"""A 6-turn chat on a long document through a running server: the first message holds four
Spec-Bench summarization and RAG texts (~2.9k tokens on the embedded model) and a question, then
five short follow-up questions, each turn re-sending the whole conversation (as chat clients do).
Prints per turn the prompt tokens, the cached prompt tokens the server reports and TTFT (streamed,
to the first text), and the decode speed after it. Greedy, 48 tokens per answer.

    specdecode serve --port 8000 &
    python scripts/measure/chat_turns.py --url http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))    # this checkout's specdecode

QUESTIONS = ["Who is mentioned?", "Summarize the second text.", "What numbers appear?", "Give a title.",
             "Anything else?"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--turns", type=int, default=6)
    args = ap.parse_args()
    from openai import OpenAI

    from specdecode import datasets
    texts = [p.text for p in datasets.spec_bench("summarization")] + [p.text for p in datasets.spec_bench("rag")]
    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "\n\n".join(texts[:4]) + "\n\nWhat is the first text about?"}]
    for turn in range(args.turns):
        started, ttft, text, usage = time.perf_counter(), None, "", None
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - started
                text += chunk.choices[0].delta.content
            if chunk.usage:
                usage = chunk.usage
        details = getattr(usage, "prompt_tokens_details", None)
        cached = details.cached_tokens if details else "-"
        answer = time.perf_counter() - started
        decode = (usage.completion_tokens - 1) / max(answer - ttft, 1e-9)
        print(f"turn {turn + 1}: prompt {usage.prompt_tokens} tokens, cached {cached}, TTFT {ttft:.3f} s, "
              f"answer {answer:.2f} s, {usage.completion_tokens} tokens, {decode:.0f} tok/s after the first")
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]}]
    return 0


if __name__ == "__main__":
    sys.exit(main())
