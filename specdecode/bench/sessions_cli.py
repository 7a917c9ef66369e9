"""`specdecode bench sessions`: multi-turn sessions (code edits, tool-calling agent loops, follow-up
questions on a document) through an OpenAI-compatible chat endpoint, turn by turn; TTFT per turn,
decode and output tok/s, cached prompt tokens, accepted draft and prediction tokens; speculation
on vs off, prefix cache on vs off, and the losslessness check of greedy runs.

The sessions are in sessions_data, the requests in sessions_run, the numbers and tables in
sessions_report; the own server is bench serve's LocalServer.

Arms. With --url every arm runs on that one server, the speculation arms alternating per group of
sessions (on, off, then off, on): the second arm of a group then finds the first one's prompts in
the server's prefix cache (its cached tokens show it). The bench's own server is started afresh
for each arm instead (each prefix-cache arm and, unless --one-server, each speculation arm), so
every arm starts with an empty cache and the same warm-up.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import httpx

from .serve_cli import _positive_float, check_url, extra_body, serve_args
from .serve_load import first_model
from .serve_server import LocalServer, ServerError
from .sessions_data import KINDS, SessionDataError, load, select
from .sessions_report import build, markdown, write
from .sessions_run import Settings, probe, run_group


def add_sessions_parser(sub) -> argparse.ArgumentParser:
    from ..cli_common import DtypeAction, comma_list, number, positive_int
    p = sub.add_parser("sessions", help="multi-turn sessions (code edits, tool loops, documents) through a server: "
                                        "TTFT per turn, cached tokens, speculation and prefix cache on/off",
                       description="Runs multi-turn sessions the project ships (specdecode/data/sessions: code edits, "
                                   "tool-calling agent loops, follow-up questions on a document) through an "
                                   "OpenAI-compatible chat endpoint, streaming, each conversation growing with the "
                                   "model's own answers. Reports TTFT per turn, decode and output tok/s, cached prompt "
                                   "tokens, accepted draft and prediction tokens, and whether greedy answers are "
                                   "identical across arms. Without --url it starts its own `specdecode serve`.")
    s = p.add_argument_group("server")
    s.add_argument("--url", default=None, help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000 "
                                               "(llama.cpp's, vLLM's; default: start `specdecode serve`)")
    s.add_argument("--model", default=None, help="own server: target model (default: embedded SmolLM2-135M)")
    s.add_argument("--draft", default=None, help="own server: draft model")
    s.add_argument("--method", default=None, help="own server: drafter (as `specdecode serve --method`)")
    s.add_argument("-k", "--num-speculative-tokens", dest="k", type=positive_int("-k", 0, 64), default=None,
                   help="own server: default draft tokens per step")
    s.add_argument("--dtype", default=None, action=DtypeAction, help="own server: weights dtype (as for serve)")
    s.add_argument("--threads", type=positive_int("--threads", 1, 1024), default=None, help="own server: CPU threads")
    s.add_argument("--eager", action="store_true", default=None, help="own server: no fast kernels")
    s.add_argument("--server-args", default=None,
                   help="own server: more `specdecode serve` options, quoted, e.g. \"--max-batch-size 4\"")
    s.add_argument("--server-timeout", type=_positive_float("--server-timeout"), default=300.0,
                   help="seconds to wait for the own server's /health (default 300)")
    w = p.add_argument_group("sessions")
    w.add_argument("--kinds", type=comma_list("--kinds", KINDS), default=list(KINDS),
                   help=f"session kinds, from {', '.join(KINDS)} (default all)")
    w.add_argument("--sessions", type=positive_int("--sessions", 1), default=None,
                   help="the first N sessions of each kind (default all: 3-4 per kind)")
    w.add_argument("--turns", type=positive_int("--turns", 1), default=None,
                   help="at most N turns per session (default all: 5-7)")
    w.add_argument("--sessions-file", default=None,
                   help="JSONL sessions of the same form instead of the shipped ones (specdecode/data/sessions)")
    w.add_argument("--max-tokens", type=positive_int("--max-tokens", 1), default=512,
                   help="max new tokens per turn (default 512: a whole edited file fits)")
    w.add_argument("--temperature", type=number("--temperature"), default=0.0,
                   help="default 0 (greedy: answers are then compared arm against arm)")
    w.add_argument("--seed", type=positive_int("--seed", 0), default=None, help="seed sent with temperature > 0")
    w.add_argument("--tool-choice", choices=["auto", "required", "none"], default="auto",
                   help="tool_choice of tools sessions (default auto: the model may answer in text, which is "
                        "appended, and the run goes on)")
    w.add_argument("--prediction", action="store_true",
                   help="edit sessions: send the current file as OpenAI's prediction "
                        "{\"type\": \"content\", \"content\": FILE}")
    w.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    w.add_argument("--request-timeout", type=_positive_float("--request-timeout"), default=600.0,
                   help="seconds before a turn counts as failed (default 600)")
    a = p.add_argument_group("arms")
    a.add_argument("--compare-speculation", action="store_true",
                   help="run every session with speculation on and off (request field `speculate`; a server that "
                        "does not report specdecode's `speculation` object gets one arm)")
    a.add_argument("--speculate", choices=["on", "off", "server"], default=None,
                   help="without --compare-speculation: send speculate true/false, or nothing (server, default)")
    a.add_argument("--compare-prefix-cache", action="store_true",
                   help="own server: run everything on a server started normally, then on one started with "
                        "--no-prefix-cache")
    a.add_argument("--one-server", action="store_true",
                   help="own server: both speculation arms on one server, alternating per group of sessions "
                        "(default: a fresh server per arm, so neither finds the other's prompts cached)")
    a.add_argument("--interleave", type=positive_int("--interleave", 1, 64), default=1,
                   help="N sessions of a kind at once, advancing turn by turn in lockstep (default 1)")
    a.add_argument("--round-robin", action="store_true",
                   help="with --interleave: send a turn's N requests one after another instead of at once")
    p.add_argument("--out", default="bench-sessions-out",
                   help="output directory: results.json, report.md, transcripts.jsonl, server logs "
                        "(default bench-sessions-out)")
    p.set_defaults(run=cmd_bench_sessions, sessions_parser=p)
    return p


def check(args: argparse.Namespace) -> dict:
    """Cross-option checks (CliError naming the flag); returns the --extra-body object."""
    from ..cli_common import CliError
    check_url(args, "bench sessions")
    if args.url is not None:
        for flag, on in (("--compare-prefix-cache", args.compare_prefix_cache), ("--one-server", args.one_server)):
            if on:
                raise CliError(f"{flag} applies only to the bench's own server (drop --url); with --url, run once "
                               f"per server setting")
    if args.compare_prefix_cache and "--no-prefix-cache" in shlex.split(args.server_args or ""):
        raise CliError("--compare-prefix-cache starts the second server with --no-prefix-cache itself: "
                       "drop it from --server-args")
    if args.one_server and not args.compare_speculation:
        raise CliError("--one-server applies only with --compare-speculation")
    if args.compare_speculation and args.speculate is not None:
        raise CliError("--speculate applies only without --compare-speculation (which runs on and off)")
    if args.round_robin and args.interleave < 2:
        raise CliError("--round-robin applies only with --interleave 2 or more")
    if args.temperature < 0:
        raise CliError(f"--temperature must be >= 0, got {args.temperature:g}")
    if args.prediction and "edit" not in args.kinds:
        raise CliError("--prediction applies to edit sessions: add edit to --kinds")
    return extra_body(args)


def load_sessions(args: argparse.Namespace):
    from ..cli_common import CliError
    try:
        every = load(args.sessions_file)
    except SessionDataError as exc:
        raise CliError(f"--sessions-file: {exc}" if args.sessions_file else f"the shipped sessions: {exc}") from None
    missing = [k for k in args.kinds if not any(s.kind == k for s in every)]
    if missing:
        raise CliError(f"--kinds: no {', '.join(missing)} sessions in {args.sessions_file or 'the shipped sessions'}")
    return select(every, args.kinds, args.sessions)


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces the run: every option that differs from its default."""
    words = ["specdecode", "bench", "sessions"]
    for action in args.sessions_parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:
            words.append(flag)
        else:
            words += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return shlex.join(words)


def cpu_info() -> dict:
    """The CPU as /proc/cpuinfo names it: model name, family and model numbers (null where unknown)."""
    from ..fast.linear import cpu_field
    return {"cpu": cpu_field("model name") or platform.processor() or platform.machine(),
            "cpu_family": cpu_field("cpu family") or None, "cpu_model": cpu_field("model") or None}


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages (others sharing the cores show up here)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def groups(sessions, size: int) -> list[list]:
    """Sessions in groups of `size`, each group of one kind."""
    out = []
    for kind in dict.fromkeys(s.kind for s in sessions):
        mine = [s for s in sessions if s.kind == kind]
        out += [mine[i:i + size] for i in range(0, len(mine), size)]
    return out


async def run_on(url: str, sessions, args, settings: Settings, arms: list[str], cache: str, t0: float,
                 notes: list[str]) -> tuple[list, list, dict, list[str]]:
    """Every group of sessions under each arm on one server; the arms actually run."""
    records, transcripts = [], []
    limits = httpx.Limits(max_connections=args.interleave + 4, max_keepalive_connections=args.interleave + 4)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), limits=limits, timeout=settings.timeout_s) as client:
        caps = await probe(client, settings, arms)
        if caps["errors"]:
            notes.append(f"warm-up requests failed on {url}: {caps['errors'][0]}")
        if any(a in ("on", "off") for a in arms) and not caps["speculation"]:
            notes.append(f"{url} reports no `speculation` object (not specdecode): the speculate field is not sent, "
                         "one arm with the server's own setting")
            arms = ["server"]
        for index, group in enumerate(groups(sessions, args.interleave)):
            for arm in (arms if index % 2 == 0 else arms[::-1]):
                label = f"prefix cache {cache}, speculation {arm}" if cache != "server" else f"speculation {arm}"
                print(f"bench sessions: {', '.join(s.id for s in group)} ({label})", file=sys.stderr, flush=True)
                got, convs = await run_group(client, group, settings, arm, cache, index, args.turns,
                                             args.round_robin, t0)
                records += [r.as_dict() for r in got]
                transcripts += [{"session": c.session.id, "kind": c.session.kind, "cache": cache, "arm": arm,
                                 "failed": c.failed, "messages": c.messages} for c in convs]
    return records, transcripts, caps, arms


def run_own(args, sessions, settings_of, t0: float, notes: list[str], out: Path) -> tuple[list, list, list]:
    """Own servers, one after the other: per prefix-cache arm, per speculation arm (or both on one)."""
    spec_arms = ["on", "off"] if args.compare_speculation else [args.speculate or "server"]
    caches = ["on", "off"] if args.compare_prefix_cache else ["on"]
    base = serve_args(args)
    records, transcripts, runs = [], [], []
    for cache in caches:
        for arms in ([spec_arms] if args.one_server else [[a] for a in spec_arms]):
            words = base + ([] if cache == "on" else ["--no-prefix-cache"])
            log = out / f"server-cache-{cache}-spec-{'-'.join(arms)}.log"
            server = LocalServer(words, log, args.server_timeout)
            print(f"bench sessions: starting `specdecode serve {shlex.join(server.serve_args)}`", file=sys.stderr,
                  flush=True)
            started = time.perf_counter()
            try:
                server.start()
                ready = time.perf_counter() - started
                settings = settings_of(asyncio.run(first_model(server.url)))
                got, texts, caps, ran = asyncio.run(run_on(server.url, sessions, args, settings, arms, cache, t0,
                                                           notes))
            finally:
                server.stop()
            records += got
            transcripts += texts
            runs.append({"cache": cache, "arms": ran, "args": server.serve_args, "log": log.name,
                         "startup_s": round(ready, 2), "model": settings.model, "reports": caps})
    return records, transcripts, runs


def cmd_bench_sessions(args: argparse.Namespace) -> int:
    from ..cli_common import CliError
    extra = check(args)
    sessions = load_sessions(args)
    out = Path(args.out)

    def settings_of(model: str) -> Settings:
        return Settings(model=model, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                        tool_choice=args.tool_choice, prediction=args.prediction, extra_body=extra,
                        timeout_s=args.request_timeout)

    notes: list[str] = []
    load_start = load_average()
    t0 = time.perf_counter()
    try:
        if args.url is not None:
            settings = settings_of(asyncio.run(first_model(args.url)))
            arms = ["on", "off"] if args.compare_speculation else [args.speculate or "server"]
            records, transcripts, caps, ran = asyncio.run(run_on(args.url, sessions, args, settings, arms, "server",
                                                                 t0, notes))
            if len(ran) > 1:
                notes.append("both speculation arms ran on one server: the second arm of each group of sessions "
                             "finds the first one's prompts in its prefix cache (see cached tokens)")
            runs = [{"cache": "server", "arms": ran, "args": None, "log": None, "startup_s": None,
                     "model": settings.model, "reports": caps}]
        else:
            records, transcripts, runs = run_own(args, sessions, settings_of, t0, notes, out)
    except (ServerError, ConnectionError) as exc:
        raise CliError(str(exc)) from None
    if any(not run["reports"]["cached_tokens"] for run in runs):
        notes.append("the server does not report usage.prompt_tokens_details.cached_tokens: cached is blank")
    held = [r for r in records if r["ok"] and r["chunks"] == 1 and (r["output_tokens"] or 0) > 1]
    if held:
        kinds = ", ".join(dict.fromkeys(r["kind"] for r in held))
        notes.append(f"{len(held)} turns ({kinds}) came in one chunk (a server that holds the text of a request "
                     "with `tools` back to parse calls from it, as specdecode's does): their TTFT is the whole "
                     "answer's time and they have no "
                     "decode rate; compare them by output tok/s")
    if args.prediction and not any(r["accepted_prediction_tokens"] is not None for r in records):
        notes.append("prediction sent, but the server reports no accepted_prediction_tokens")
    config = {key: getattr(args, key) for key in (
        "kinds", "sessions", "turns", "sessions_file", "max_tokens", "temperature", "seed", "tool_choice",
        "prediction", "request_timeout", "compare_speculation", "speculate", "compare_prefix_cache", "one_server",
        "interleave", "round_robin")}
    config.update(extra_body=extra, command=command_line(args))
    from ..engine.threads import usable_cpus  # (torch: cpu_info reads the kernels' module too)
    results = {"schema": "specdecode-bench-sessions/1", "config": config,
               "machine": {**cpu_info(), "cores": usable_cpus(), "platform": platform.platform(),
                           "python": platform.python_version(), "load_average_start": load_start,
                           "load_average_end": load_average(),
                           "duration_s": round(time.perf_counter() - t0, 1)},
               "server": {"url": args.url, "local": args.url is None, "model": runs[0]["model"],
                          "args": serve_args(args) if args.url is None else None, "runs": runs},
               "sessions": [{"id": s.id, "kind": s.kind, "title": s.title, "turns": len(s.turns)} for s in sessions],
               "notes": list(dict.fromkeys(notes)), **build(records, args.temperature == 0), "turns": records}
    write(out, results, transcripts)
    print(markdown(results))
    failed = [r for r in records if not r["ok"]]
    if failed:
        print(f"bench sessions: {len(failed)} of {len(records)} turns failed (first: {failed[0]['error']})",
              file=sys.stderr)
    print(f"wrote {out}/results.json, report.md, transcripts.jsonl", file=sys.stderr)
    return 0
