"""A restart that keeps hot prefixes: `specdecode serve --prefix-cache-dir DIR` answers a question on
a long document (four Spec-Bench summarization and RAG texts, ~2.9k tokens on the embedded model),
is stopped with SIGTERM (a graceful stop writes what the cache holds), started again on the same
DIR, and asked two other questions on the same document. Prints prompt tokens, cached tokens and
TTFT (streamed, to the first text) of each question and what DIR holds.

    python scripts/measure/prefix_restart.py [--model PATH] [--dir DIR]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))    # this checkout's specdecode


def ask(client, model: str, document: str, question: str) -> str:
    started, ttft, text, usage = time.perf_counter(), None, "", None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"{document}\n\n{question}"}], max_tokens=32,
            temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - started
            text += chunk.choices[0].delta.content
        if chunk.usage:
            usage = chunk.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return f"prompt {usage.prompt_tokens} tokens, cached {cached}, TTFT {ttft:.3f} s: {text[:50]!r}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dir", default=None, help="prefix cache directory (default: a new temporary one)")
    args = ap.parse_args()
    from openai import OpenAI

    from specdecode import datasets
    from specdecode.bench.serve_server import LocalServer
    from specdecode.fast.linear import cpu_label
    texts = [p.text for p in datasets.spec_bench("summarization")] + [p.text for p in datasets.spec_bench("rag")]
    document = "\n\n".join(texts[:4])
    cache_dir = Path(args.dir or tempfile.mkdtemp(prefix="prefix-cache-"))
    serve_args = (["--model", args.model] if args.model else []) + ["--prefix-cache-dir", str(cache_dir),
                                                                     "--log-level", "warning"]
    print(f"{cpu_label()}; {args.model or 'embedded model'}; cache directory {cache_dir}")
    for start, questions in enumerate((["What is the first text about?"],
                                       ["Who is mentioned in the second text?", "Give the third text a title."])):
        with LocalServer(serve_args, cache_dir.parent / f"{cache_dir.name}-server-{start}.log") as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            model = client.models.list().data[0].id
            for q in questions:
                print(f"{'first start' if start == 0 else 'after restart'}: {ask(client, model, document, q)}")
        files = list(cache_dir.rglob("*.kv"))
        print(f"  stopped (SIGTERM): {len(files)} files, {sum(f.stat().st_size for f in files) / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
