"""`specdecode bench`: options, defaults of --quick / --full, and the command itself."""
from __future__ import annotations

import argparse
import shlex
import sys

from ..datasets import SPEC_BENCH_TASKS, TASKS

SYSTEMS = ("specdecode", "transformers", "llama.cpp")
# --quick: plain decoding and the default drafter on the first prompt of each task (every drafter on
# two prompts per task took several times the few minutes a first look should take: most of a run is
# transformers' bf16 passes); "methods" absent: every registered one
MODES = {"quick": {"prompts_per_task": 1, "max_tokens": 64, "methods": ("plain", "ngram")},
         "full": {"prompts_per_task": None, "max_tokens": 128},
         # Spec-Bench's own setting (Xia et al. 2024): its six tasks, greedy, batch 1, up to 1024 new
         # tokens, wall-clock speed-up; here on the first 20 prompts of each task unless told otherwise
         "spec-bench": {"prompts_per_task": 20, "max_tokens": 1024}}


def methods() -> tuple[str, ...]:
    """Bench methods: plain decoding and every registered drafter (drafters/registry.py)."""
    from ..drafters.registry import method_names
    return ("plain", *method_names())


def _ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"-k takes integers like 5 or 1,3,5,8, got {text!r}") from None
    if not ks or not all(1 <= k <= 64 for k in ks):
        raise argparse.ArgumentTypeError(f"-k values must be in [1, 64] (draft tokens of a chain: up to 32; "
                                         f"nodes of a draft tree: up to 64), got {text!r}")
    return ks


def add_parser(sub) -> argparse.ArgumentParser:
    from ..cli_common import DtypeAction, accepted, comma_list, drafter_option, number, positive_int
    p = sub.add_parser("bench", help="benchmark specdecode against transformers and llama.cpp on Spec-Bench "
                                     "and HumanEval, interleaved per prompt",
                       description="Measure every system on the same prompts, weights, dtype and machine, in one "
                                   "run, interleaved per prompt. Writes results.json, report.md, PNG plots and "
                                   "measurements.jsonl (appended as it goes) under --out.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="small run (the default): the first prompt of each task, 64 new tokens, plain decoding "
                           "and the default drafter (ngram); a few minutes on idle cores")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="every prompt of every task (480 Spec-Bench + 164 HumanEval), 128 new tokens")
    mode.add_argument("--protocol", dest="mode", choices=["spec-bench"],
                      help="spec-bench: Spec-Bench's own protocol (its six tasks, temperature 0, batch 1, up to "
                           "1024 new tokens), on the first 20 prompts per task (--prompts-per-task to change)")
    p.set_defaults(mode="quick")
    w = p.add_argument_group("workload")
    w.add_argument("--tasks", type=comma_list("--tasks", TASKS, {"spec_bench": SPEC_BENCH_TASKS}), default=list(TASKS),
                   help=f"comma-separated, from {', '.join(TASKS)} (spec_bench = the six Spec-Bench tasks); "
                        "default all")
    w.add_argument("--prompts-per-task", type=positive_int("--prompts-per-task", 1), default=None,
                   help="first N prompts of each task (default: 1 with --quick, all with --full)")
    w.add_argument("--prompts-file", default=None,
                   help="custom prompts instead: JSONL with 'text' and optional 'task', 'id', 'chat'")
    w.add_argument("--max-tokens", type=positive_int("--max-tokens", 1), default=None,
                   help="max new tokens; EOS stops earlier (default: 64 with --quick, 128 with --full)")
    w.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain every answer to this JSON schema (structured output; specdecode and "
                        "transformers, which gets the same grammar as a logits processor; llama.cpp is skipped "
                        "with a note); e.g. specdecode/data/json_extract/schema.json")
    w.add_argument("--temperature", type=number("--temperature"), default=0.0,
                   help="0 = greedy (default; losslessness is then checked token by token)")
    w.add_argument("--seed", type=positive_int("--seed", 0), default=0, help="base seed for sampling runs")
    s = p.add_argument_group("what to compare")
    s.add_argument("--systems", type=comma_list("--systems", SYSTEMS), default=list(SYSTEMS),
                   help="comma-separated, from specdecode, transformers, llama.cpp (default all; llama.cpp is "
                        "skipped with a note when llama-cpp-python is missing)")
    all_methods = methods()
    s.add_argument("--methods", type=comma_list("--methods", all_methods), default=None,
                   help=f"comma-separated, from {', '.join(all_methods)} (the registered drafters; eagle / cascade "
                        "use --drafter or the one shipped for the target, model needs --draft); default: plain,ngram "
                        "with --quick, all with --full and --protocol")
    s.add_argument("-k", "--num-speculative-tokens", dest="ks", type=_ks, default=[5],
                   help="draft tokens per step; a list (e.g. 1,3,5,8) measures each (default 5)")
    s.add_argument("--drafter-option", dest="drafter_options", action="append", default=[], metavar="KEY=VALUE",
                   type=drafter_option,
                   help="an option of the drafters that take it (as for generate), e.g. head_vocab=32768; "
                        "repeatable; methods whose drafter has no such option run without it")
    s.add_argument("--adaptive", default=None, action=argparse.BooleanOptionalAction,
                   help="specdecode chooses each step's draft size up to k from measured costs (default: on; "
                        "--no-adaptive drafts k every step)")
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help="target .gguf, HF directory or Hugging Face id ORG/NAME[:QUANT] "
                   "(docs/models.md; default: embedded SmolLM2-135M)")
    m.add_argument("--draft", default=None,
                   help="draft model, named as --model is (methods model and cascade; one of another tokenizer drafts "
                        "through text: text-model)")
    m.add_argument("--drafter", default=None, metavar="DIR",
                   help="trained EAGLE drafter from `specdecode distill` (method eagle; default: the shipped one)")
    m.add_argument("--dtype", default=None, action=DtypeAction,
                   help=f"{accepted()}: dense weights in this dtype, auto = the checkpoint's own "
                        "(default: a GGUF target on its own quantized weights, else bf16)")
    m.add_argument("--weights", default="auto", choices=["auto", "native", "dense"],
                   help="native / dense / auto (default) as for generate")
    m.add_argument("--draft-dtype", default=None, action=DtypeAction, allow_int8=True,
                   help="the draft model's dtype if not the target's (int8: per-channel quantized; q4_0: 4-bit blocks)")
    m.add_argument("--threads", type=positive_int("--threads", 1, 1024), default=None,
                   help="CPU threads for every system (default: torch's choice)")
    m.add_argument("--eager", action="store_true", help="specdecode without its fast kernels")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    o.add_argument("--resume", action="store_true",
                   help="keep the measurements already in --out and measure only the missing cells")
    o.add_argument("--rebuild", action="store_true",
                   help="measure nothing: rebuild results.json, report.md and plots from --out/measurements.jsonl")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_bench)
    from .serve_cli import add_serve_parser  # `specdecode bench serve ...`: the server load generator
    from .sessions_cli import add_sessions_parser  # `specdecode bench sessions ...`: multi-turn sessions
    sub = p.add_subparsers(dest="bench_command", title="benchmark a server", metavar="{serve,sessions}")
    add_serve_parser(sub)
    add_sessions_parser(sub)
    return p


def _schema(path: str | None) -> dict | None:
    """The --json-schema file's schema (checked now: a bad file is one line, not a traceback)."""
    if path is None:
        return None
    import json
    from pathlib import Path

    from ..cli_common import CliError
    from ..params import ParamError
    from ..structured import Structured
    try:
        schema = json.loads(Path(path).expanduser().read_text())
        Structured("json_schema", schema).grammar()
    except OSError as exc:
        raise CliError(f"--json-schema: cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, ParamError) as exc:
        raise CliError(f"--json-schema: {path}: {exc}") from None
    return schema


def mode_methods(mode: str) -> list[str]:
    """The methods a mode runs when --methods is not given."""
    return list(MODES[mode].get("methods") or methods())


def _drafter_options(args: argparse.Namespace) -> dict:
    """--drafter-option pairs; each must be an option of at least one of the --methods' drafters."""
    from ..cli_common import CliError
    from ..drafters.registry import drafter_option_names
    options = dict(args.drafter_options or [])
    takers = {m: drafter_option_names(m) for m in args.methods if m != "plain"}
    for key in options:
        if not any(key in names for names in takers.values()):
            known = sorted({n for names in takers.values() for n in names})
            raise CliError(f"--drafter-option {key!r} is not an option of any of --methods "
                           f"{','.join(args.methods)} (their options: {', '.join(known) or 'none'})")
    return options


def config_from(args: argparse.Namespace) -> dict:
    """The resolved settings of a run (stored in run.json / results.json), with the canonical
    command line that reproduces them."""
    defaults = MODES[args.mode]
    args.methods = args.methods or mode_methods(args.mode)
    from ..cli_common import CliError, option_error
    from ..params import ParamError, SamplingParams
    try:                                   # before any system loads its weights
        SamplingParams(temperature=args.temperature, seed=args.seed)
    except ParamError as exc:
        raise option_error(exc) from None
    if args.mode == "spec-bench":
        if args.temperature != 0:
            raise CliError(f"--protocol spec-bench runs at temperature 0, got --temperature {args.temperature}")
        if args.tasks == list(TASKS):
            args.tasks = list(SPEC_BENCH_TASKS)
    cfg = {"mode": args.mode, "tasks": args.tasks, "prompts_file": args.prompts_file,
           "prompts_per_task": args.prompts_per_task or defaults["prompts_per_task"],
           "max_tokens": args.max_tokens or defaults["max_tokens"], "temperature": args.temperature,
           "seed": args.seed, "systems": args.systems, "methods": args.methods, "ks": args.ks,
           "model": args.model, "draft": args.draft, "drafter": args.drafter, "dtype": args.dtype,
           "weights": args.weights,
           "draft_dtype": args.draft_dtype, "threads": args.threads, "adaptive": args.adaptive,
           "eager": args.eager, "resume": args.resume, "json_schema": _schema(args.json_schema),
           "drafter_options": _drafter_options(args)}
    words = ["specdecode", "bench"] + (["--protocol", args.mode] if args.mode == "spec-bench" else [f"--{args.mode}"])
    if args.prompts_file:
        words += ["--prompts-file", args.prompts_file]
    if args.json_schema:
        words += ["--json-schema", args.json_schema]
    elif args.tasks != list(TASKS) and not (args.mode == "spec-bench" and args.tasks == list(SPEC_BENCH_TASKS)):
        words += ["--tasks", ",".join(args.tasks)]
    if args.prompts_per_task:
        words += ["--prompts-per-task", str(args.prompts_per_task)]
    if args.max_tokens:
        words += ["--max-tokens", str(args.max_tokens)]
    if args.temperature:
        words += ["--temperature", str(args.temperature), "--seed", str(args.seed)]
    if args.systems != list(SYSTEMS):
        words += ["--systems", ",".join(args.systems)]
    if args.methods != mode_methods(args.mode):
        words += ["--methods", ",".join(args.methods)]
    words += ["-k", ",".join(map(str, args.ks))]
    for flag, value in (("--model", args.model), ("--draft", args.draft), ("--drafter", args.drafter),
                        ("--threads", args.threads)):
        if value is not None:
            words += [flag, str(value)]
    words += ["--dtype", args.dtype] if args.dtype else []
    words += ["--weights", args.weights] if args.weights != "auto" else []
    words += (["--draft-dtype", args.draft_dtype] if args.draft_dtype else [])
    words += (["--eager"] if args.eager else [])
    words += ([] if args.adaptive is None else ["--adaptive" if args.adaptive else "--no-adaptive"])
    for key, value in cfg["drafter_options"].items():
        words += ["--drafter-option", f"{key}={value}"]
    words += ["--out", args.out]
    cfg["command"] = " ".join(shlex.quote(w) for w in words)
    return cfg


def cmd_bench(args: argparse.Namespace) -> int:
    from ..cli_common import CliError
    from .report import console_summary
    from .runner import build_outputs, measure
    from .store import Store

    if args.rebuild and args.resume:
        raise CliError("--rebuild and --resume exclude each other")
    if (args.methods or mode_methods(args.mode)) == ["model"] and not args.draft:
        raise CliError("--methods model needs a draft model: add --draft PATH")
    store = Store(args.out)
    if not args.rebuild:
        config = config_from(args)
        try:
            run = measure(config, store, progress=not args.no_progress)
        except ValueError as exc:
            if type(exc) is not ValueError:   # ParamError, ModelError, ...: main() reports them
                raise
            raise CliError(str(exc)) from None
        except KeyboardInterrupt:
            if store.read_run() is not None and store.records():
                build_outputs(store)
                print(f"\ninterrupted: what was measured is in {store.dir} (--resume continues)", file=sys.stderr)
            raise
        results = build_outputs(store, run)
    else:
        results = build_outputs(store)
    print(console_summary(results))
    print(f"\nwrote {store.dir}/results.json, report.md, {', '.join(sorted(p.name for p in store.dir.glob('*.png')))}",
          file=sys.stderr)
    return 0
