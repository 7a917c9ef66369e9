"""What the server keeps of the engine's speed at one request: the same prompts through
`LLM.generate` (in this process) and through `specdecode serve` (a child process, via the openai
client, non-streamed and streamed), alternating arm by arm per prompt so that a noisy CPU spreads
over all of them. Greedy, `--max-tokens` tokens per answer (EOS ignored), prefill included.

    python scripts/measure/serve_overhead.py                                   # embedded model, 6 prompts x 2 rounds
    python scripts/measure/serve_overhead.py --model qwen2.5-coder-1.5b-q4_k_m.gguf --max-tokens 128

Arms: offline / server / server-stream / server-stream-raw, each plain (k = 0; `speculate: false`) and
speculative (the default drafter; each row's draft size chosen by the speculation controller). Prints
median tok/s per arm and the ratio of each server arm to the offline arm of the same kind; `--json FILE`
keeps every measurement.
`server-stream-raw` reads the same stream with httpx, line by line, without parsing the chunks: the
server's streaming cost without the openai client's (pydantic per chunk), which shares the cores.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["Write a short story about a robot learning to paint.",
           "Explain how a hash table works, with an example in Python.",
           "Translate to French: The weather is nice today and I want to go to the park with my friends.",
           "Summarize the plot of Romeo and Juliet in a paragraph.",
           "What are the main causes of inflation? Answer in detail.",
           "List ten fruits and describe each one in one sentence."]


def cpu_name() -> str:
    from specdecode.fast.linear import cpu_label
    return cpu_label()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--method", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", default="plain,spec")
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="an option for the server, e.g. --serve-arg=--stream-interval-ms=0 (repeatable)")
    args = ap.parse_args()

    from openai import OpenAI

    from specdecode import LLM, SamplingParams
    from specdecode.bench.serve_server import LocalServer
    llm = LLM(model=args.model, method=args.method, threads=args.threads, progress=False, prefix_cache=False)
    serve_args = [a for a, v in (("--model", args.model), ("--method", args.method),
                                 ("--threads", args.threads)) if v is not None for a in (a, str(v))]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:args.prompts]
    kinds = args.arms.split(",")
    # the prompts repeat round after round: both sides prefill them in full (no prefix caches)
    with LocalServer(serve_args + args.serve_arg + ["--log-level", "warning", "--no-prefix-cache"],
                     Path(tempfile.mkdtemp()) / "server.log") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def offline(prompt: str, spec: bool) -> float:
            started = time.perf_counter()
            out = llm.generate([[{"role": "user", "content": prompt}]], params, chat=True,
                               num_speculative_tokens=None if spec else 0)[0]
            assert len(out.token_ids) == args.max_tokens
            return args.max_tokens / (time.perf_counter() - started)

        import httpx
        raw = httpx.Client(base_url=server.url, timeout=600)

        def served_raw(prompt: str, spec: bool) -> float:
            body = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                        temperature=0, stream=True, ignore_eos=True, **({} if spec else {"speculate": False}))
            started = time.perf_counter()
            with raw.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = [line for line in response.iter_lines() if line]
            assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2].replace(" ", "")
            return args.max_tokens / (time.perf_counter() - started)

        def served(prompt: str, spec: bool, stream: bool) -> float:
            body = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                        temperature=0, extra_body={"ignore_eos": True, **({} if spec else {"speculate": False})})
            started = time.perf_counter()
            if stream:
                chunks = list(client.chat.completions.create(stream=True, **body))
                assert chunks[-1].choices[0].finish_reason == "length"
            else:
                out = client.chat.completions.create(**body)
                assert out.usage.completion_tokens == args.max_tokens
            return args.max_tokens / (time.perf_counter() - started)

        arms = {f"{name}-{kind}": fn for kind in kinds for name, fn in (
            ("offline", lambda p, s=kind == "spec": offline(p, s)),
            ("server", lambda p, s=kind == "spec": served(p, s, False)),
            ("server-stream", lambda p, s=kind == "spec": served(p, s, True)),
            ("server-stream-raw", lambda p, s=kind == "spec": served_raw(p, s)))}
        for fn in arms.values():                       # warm-up: caches, compiled kernels, cost curves
            fn(prompts[0])
        rates: dict[str, list[float]] = {a: [] for a in arms}
        for r in range(args.rounds):
            for i, prompt in enumerate(prompts):
                names = list(arms)
                shift = (r * len(prompts) + i) % len(names)     # rotate the order
                for name in names[shift:] + names[:shift]:
                    rates[name].append(arms[name](prompt))
    median = {a: statistics.median(v) for a, v in rates.items()}
    print(f"{cpu_name()}, {llm.target.name}, {len(prompts)} prompts x {args.rounds} rounds, "
          f"{args.max_tokens} tokens, one request at a time, server options {args.serve_arg or 'default'}")
    print(f"{'arm':<22}{'median tok/s':>14}{'min':>8}{'max':>8}{'/ offline':>11}")
    for name, values in rates.items():
        kind = name.rsplit("-", 1)[1]
        ratio = median[name] / median[f"offline-{kind}"]
        print(f"{name:<22}{median[name]:>14.1f}{min(values):>8.1f}{max(values):>8.1f}{ratio:>10.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "model": llm.target.name, "rates": rates,
                                               "median": median, "command": sys.argv}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
