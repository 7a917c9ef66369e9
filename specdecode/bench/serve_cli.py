"""`specdecode bench serve`: options and the run (levels, interleaved speculation arms, memory
sampling, output files). The load itself is in serve_load, the server side in serve_server,
the numbers and tables in serve_report."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from .. import datasets
from .serve_load import Record, Shape, Workload, first_model, make_client, run_load, send
from .serve_report import compare, summarize, write
from .serve_server import LocalServer, MemorySampler, ServerError, summarize_memory

SERVER_OPTIONS = ("model", "draft", "method", "k", "dtype", "threads", "eager", "server_args")


def _int_list(name: str, low: int, high: int):
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes integers like 1,4,16, got {text!r}") from None
        if not values or not all(low <= v <= high for v in values):
            raise argparse.ArgumentTypeError(f"{name} values must be in [{low}, {high}], got {text!r}")
        return list(dict.fromkeys(values))
    return parse


def _rate_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rate takes requests per second like 0.5,2, got {text!r}") from None
    if not values or not all(0 < v <= 10000 for v in values):
        raise argparse.ArgumentTypeError(f"--rate values must be in (0, 10000] requests/s, got {text!r}")
    return list(dict.fromkeys(values))


def _positive_float(name: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        return value
    return parse


def add_serve_parser(sub) -> argparse.ArgumentParser:
    from ..cli_common import DtypeAction, comma_list, number, positive_int
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, goodput)",
                       description="Load generator for `specdecode serve` (or any OpenAI-compatible server): "
                                   "streaming Spec-Bench requests at fixed concurrency or Poisson arrivals; reports "
                                   "TTFT, TPOT and ITL at p50/p99, request and token throughput, goodput and "
                                   "failures; speculation on vs off; memory over time. Without --url it starts "
                                   "its own server with the model options.")
    s = p.add_argument_group("server")
    s.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (default: start one)")
    s.add_argument("--server-pid", type=positive_int("--server-pid", 1), default=None,
                   help="with --url: PID of that server on this machine, to sample its RSS")
    s.add_argument("--model", default=None, help="own server: target model (default: embedded SmolLM2-135M)")
    s.add_argument("--draft", default=None, help="own server: draft model")
    s.add_argument("--method", default=None, help="own server: drafter (as `specdecode serve --method`)")
    s.add_argument("-k", "--num-speculative-tokens", dest="k", type=positive_int("-k", 0, 32), default=None,
                   help="own server: default draft tokens per step")
    s.add_argument("--dtype", default=None, action=DtypeAction,
                   help="own server: weights dtype (as for serve)")
    s.add_argument("--threads", type=positive_int("--threads", 1, 1024), default=None, help="own server: CPU threads")
    s.add_argument("--eager", action="store_true", default=None, help="own server: no fast kernels")
    s.add_argument("--server-args", default=None,
                   help="own server: more `specdecode serve` options, quoted, e.g. \"--max-batch-size 16\"")
    s.add_argument("--server-timeout", type=_positive_float("--server-timeout"), default=300.0,
                   help="seconds to wait for the own server's /health (default 300)")
    ld = p.add_argument_group("load")
    shape = ld.add_mutually_exclusive_group()
    shape.add_argument("--concurrency", type=_int_list("--concurrency", 1, 1024), default=None,
                       help="fixed concurrency levels, e.g. 1,4,16 (default 1,4,16)")
    shape.add_argument("--rate", type=_rate_list, default=None, help="Poisson arrival rates in requests/s, e.g. 0.5,2")
    ld.add_argument("--max-concurrency", type=positive_int("--max-concurrency", 1, 1024), default=None,
                    help="with --rate: at most this many requests in flight")
    size = ld.add_mutually_exclusive_group()
    size.add_argument("--num-requests", type=positive_int("--num-requests", 1, 1_000_000), default=None,
                      help="requests per level and speculation arm "
                           "(default: 4 x concurrency, at least 8; 32 with --rate)")
    size.add_argument("--duration", type=_positive_float("--duration"), default=None,
                      help="seconds per level and arm instead (soak test; requests in flight then finish)")
    ld.add_argument("--warmup", type=positive_int("--warmup", 0, 10000), default=2,
                    help="unmeasured requests before each level (default 2)")
    ld.add_argument("--compare-speculation", action="store_true",
                    help="run every level with speculation on and off (request field `speculate`), interleaved")
    ld.add_argument("--compare-auto", action="store_true",
                    help="with --compare-speculation: a third arm that leaves speculation to the server's "
                         "automatic policy, compared with off")
    ld.add_argument("--rounds", type=positive_int("--rounds", 1, 1000), default=None,
                    help="rounds per level; with --compare-speculation ordered on,off,off,on,... "
                         "(default 2 then, else 1)")
    ld.add_argument("--speculate", choices=["on", "off", "server"], default="server",
                    help="without --compare-speculation: send speculate true/false, "
                         "or leave it to the server (default)")
    w = p.add_argument_group("workload")
    w.add_argument("--tasks", type=comma_list("--tasks", datasets.TASKS, {"spec_bench": datasets.SPEC_BENCH_TASKS}),
                   default=list(datasets.SPEC_BENCH_TASKS),
                   help=f"prompts from {', '.join(datasets.TASKS)} (spec_bench = the six Spec-Bench tasks, default), "
                        "taken round-robin across tasks")
    w.add_argument("--prompts-file", default=None, help="JSONL prompts instead ('text', optional 'task', 'id', 'chat')")
    w.add_argument("--max-tokens", type=positive_int("--max-tokens", 1), default=64,
                   help="max new tokens (default 64)")
    w.add_argument("--temperature", type=number("--temperature"), default=0.0, help="default 0 (greedy)")
    w.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every request makes max tokens")
    w.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    w.add_argument("--seed", type=positive_int("--seed", 0), default=0, help="seed of the Poisson arrivals")
    w.add_argument("--request-timeout", type=_positive_float("--request-timeout"), default=600.0,
                   help="seconds before a request counts as failed (default 600)")
    g = p.add_argument_group("goodput and output")
    g.add_argument("--slo-ttft", type=_positive_float("--slo-ttft"), default=None, help="TTFT SLO in ms for goodput")
    g.add_argument("--slo-tpot", type=_positive_float("--slo-tpot"), default=None, help="TPOT SLO in ms for goodput")
    g.add_argument("--sample-interval", type=_positive_float("--sample-interval"), default=1.0,
                   help="seconds between memory samples (default 1)")
    g.add_argument("--out", default="bench-serve-out",
                   help="output directory: results.json, requests.jsonl, report.md (default bench-serve-out)")
    p.set_defaults(run=cmd_bench_serve)
    return p


def check_url(args: argparse.Namespace, command: str) -> None:
    """--url is an http(s) address and comes without the own server's model options (CliError)."""
    from ..cli_common import CliError
    if args.url is None:
        return
    if not args.url.startswith(("http://", "https://")):
        raise CliError(f"--url must start with http:// or https://, got {args.url!r}")
    given = [name for name in SERVER_OPTIONS if getattr(args, name) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-") if given[0] != "k" else "-k"
        raise CliError(f"{flag} applies only when {command} starts its own server: drop --url or {flag}")


def extra_body(args: argparse.Namespace) -> dict:
    """The --extra-body object ({} without one; CliError unless it is a JSON object)."""
    from ..cli_common import CliError
    if args.extra_body is None:
        return {}
    try:
        extra = json.loads(args.extra_body)
    except ValueError as exc:
        raise CliError(f"--extra-body must be a JSON object: {exc}") from None
    if not isinstance(extra, dict):
        raise CliError(f"--extra-body must be a JSON object, got {type(extra).__name__}")
    return extra


def check(args: argparse.Namespace) -> dict:
    """Cross-option checks; returns the --extra-body object."""
    from ..cli_common import CliError
    check_url(args, "bench serve")
    if args.url is None and args.server_pid is not None:
        raise CliError("--server-pid applies only with --url (the own server's RSS is sampled anyway)")
    if args.max_concurrency is not None and args.rate is None:
        raise CliError("--max-concurrency applies only with --rate")
    if args.temperature < 0:
        raise CliError(f"--temperature must be >= 0, got {args.temperature:g}")
    return extra_body(args)


def load_prompts(args: argparse.Namespace) -> list[datasets.Prompt]:
    if args.prompts_file:
        from .workload import read_custom
        return read_custom(args.prompts_file)
    per_task = [datasets.load(task) for task in args.tasks]
    return [p for group in zip(*per_task) for p in group]   # round-robin across tasks


def serve_args(args: argparse.Namespace) -> list[str]:
    words: list[str] = []
    for flag, value in (("--model", args.model), ("--draft", args.draft), ("--method", args.method),
                        ("-k", args.k), ("--dtype", args.dtype), ("--threads", args.threads)):
        if value is not None:
            words += [flag, str(value)]
    if args.eager:
        words.append("--eager")
    return words + shlex.split(args.server_args or "")


def plan(args: argparse.Namespace) -> list[dict]:
    """Load levels, each with its rounds: (arm, number of requests or seconds, prompt offset, seed)."""
    arms = ["on", "off"] if args.compare_speculation else [args.speculate]
    if args.compare_speculation and args.compare_auto:
        arms.append("server")
    rounds = args.rounds or (2 if args.compare_speculation else 1)
    levels = []
    shapes = ([("concurrency", c) for c in args.concurrency or [1, 4, 16]] if args.rate is None
              else [("rate", r) for r in args.rate])
    start = 0          # each level (and round) takes the next prompts: a server's prefix cache, or a
    for kind, value in shapes:     # peer's last-prompt cache, never finds a later level's prompts cached
        total = args.num_requests or (max(8, 4 * value) if kind == "concurrency" else 32)
        steps = []
        for i in range(rounds):
            count = total // rounds + (1 if i < total % rounds else 0)
            if args.duration is None and count == 0:
                continue
            order = arms if i % 2 == 0 else arms[::-1]     # on,off then off,on: drift hits both arms alike
            for arm in order:
                steps.append({"round": i, "arm": arm, "requests": None if args.duration else count,
                              "seconds": args.duration / rounds if args.duration else None,
                              "offset": start + i * max(count, 1), "seed": args.seed + i})
        start += max(total, 1)
        label = f"concurrency {value}" if kind == "concurrency" else f"rate {value:g}/s"
        levels.append({"load": label, "kind": kind, "value": value, "arms": arms, "steps": steps})
    return levels


async def run_level(url: str, level: dict, prompts, workload: Workload, args, pid: int | None) -> tuple[dict, list]:
    conc = level["value"] if level["kind"] == "concurrency" else args.max_concurrency   # None: open loop
    records: list[Record] = []
    async with make_client(url, conc, workload.timeout_s) as client:
        if args.warmup:   # not measured: first-use costs of the server and of this client
            gate = asyncio.Semaphore(min(conc or args.warmup, args.warmup))

            async def warm(i: int) -> None:
                prompt, arm = prompts[-1 - i % len(prompts)], level["arms"][i % len(level["arms"])]   # not measured
                async with gate:
                    await send(client, prompt, workload, Record(prompt.task, prompt.id, arm, -1), time.perf_counter())
            await asyncio.gather(*(warm(i) for i in range(args.warmup)))
        t0 = time.perf_counter()
        sampler = MemorySampler(client, pid, args.sample_interval, t0)
        sampler.start()
        rounds, spent = [], {arm: 0.0 for arm in level["arms"]}
        try:
            for step in level["steps"]:
                rotated = prompts[step["offset"] % len(prompts):] + prompts[:step["offset"] % len(prompts)]
                shape = Shape(concurrency=level["value"] if level["kind"] == "concurrency" else None,
                              rate=level["value"] if level["kind"] == "rate" else None,
                              max_concurrency=args.max_concurrency, num_requests=step["requests"],
                              duration_s=step["seconds"])
                start = time.perf_counter()
                got = await run_load(client, rotated, workload, shape, step["arm"], step["round"], step["seed"], t0)
                took = time.perf_counter() - start
                spent[step["arm"]] += took
                records += got
                rounds.append({"round": step["round"], "arm": step["arm"], "requests": len(got),
                               "failed": sum(not r.ok for r in got), "duration_s": round(took, 3)})
        finally:
            samples = await sampler.stop()
    arms = {arm: summarize([r for r in records if r.arm == arm], spent[arm], args.slo_ttft, args.slo_tpot)
            for arm in level["arms"]}
    return {"load": level["load"], "concurrency": level["value"] if level["kind"] == "concurrency" else None,
            "rate": level["value"] if level["kind"] == "rate" else None, "arms": arms,
            "comparison": compare(arms["off"], arms["on"]) if args.compare_speculation else None,
            "comparison_auto": compare(arms["off"], arms["server"]) if "server" in arms and "off" in arms else None,
            "rounds": rounds, "memory": {**summarize_memory(samples), "series": samples}}, records


async def run_all(url: str, args, prompts, extra: dict, pid: int | None) -> tuple[list[dict], list[Record], str]:
    model = await first_model(url)
    workload = Workload(model=model, max_tokens=args.max_tokens, temperature=args.temperature,
                        ignore_eos=args.ignore_eos, extra_body=extra, timeout_s=args.request_timeout)
    levels, records = [], []
    for level in plan(args):
        print(f"bench serve: {level['load']} ({', '.join(level['arms'])})", file=sys.stderr, flush=True)
        result, got = await run_level(url, level, prompts, workload, args, pid)
        levels.append(result)
        records += got
    return levels, records, model


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from ..cli_common import CliError
    from .serve_report import markdown
    extra = check(args)
    prompts = load_prompts(args)
    out = Path(args.out)
    own = serve_args(args)
    if args.compare_speculation and "--no-prefix-cache" not in own:
        # the arms send the same prompts one after another: with the prefix cache the later arms would
        # skip the prefill the first one paid (a --url server: run it with its prefix cache off)
        own.append("--no-prefix-cache")
    server = LocalServer(own, out / "server.log", args.server_timeout) if args.url is None else None
    try:
        if server is not None:
            print(f"bench serve: starting `specdecode serve {shlex.join(server.serve_args)}`", file=sys.stderr,
                  flush=True)
            server.start()
        url = args.url or server.url
        pid = server.pid if server is not None else args.server_pid
        levels, records, model = asyncio.run(run_all(url, args, prompts, extra, pid))
    except (ServerError, ConnectionError) as exc:
        raise CliError(str(exc)) from None
    finally:
        if server is not None:
            server.stop()
    config = {key: getattr(args, key) for key in (
        "concurrency", "rate", "max_concurrency", "num_requests", "duration", "warmup", "compare_speculation",
        "compare_auto",
        "rounds", "speculate", "tasks", "prompts_file", "max_tokens", "temperature", "ignore_eos", "seed",
        "request_timeout", "sample_interval")}
    config.update(extra_body=extra, slo_ttft_ms=args.slo_ttft, slo_tpot_ms=args.slo_tpot,
                  concurrency=None if args.rate else args.concurrency or [1, 4, 16],
                  rounds=args.rounds or (2 if args.compare_speculation else 1))
    results = {"config": config,
               "machine": {"cores": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version()},
               "server": {"url": url, "local": server is not None, "model": model,
                          "args": server.serve_args if server is not None else None, "rss_sampled": pid is not None},
               "levels": levels}
    write(out, results, records)
    print(markdown(results))
    failed = sum(not r.ok for r in records)
    if failed:
        first = next(r.error for r in records if not r.ok)
        print(f"bench serve: {failed} of {len(records)} requests failed (first: {first})", file=sys.stderr)
    print(f"wrote {out}/results.json, requests.jsonl, report.md", file=sys.stderr)
    return 0
