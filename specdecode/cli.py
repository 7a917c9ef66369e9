"""Command line: `specdecode generate "PROMPT" [--compare] [--json] ...`.

Every user error is one line on stderr (exit code 2); set SPECDECODE_DEBUG=1 for tracebacks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from . import __version__
from .cli_common import CliError, add_model_options, drafter_options, number, option_error, positive_int
from .params import ParamError


def _logit_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--logit-bias takes TOKEN_ID=BIAS, got {text!r}") from None


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=number("--temperature"), default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=positive_int("--top-k", 0), default=0,
                   help="keep the K most likely tokens (default 0: off)")
    g.add_argument("--top-p", type=number("--top-p"), default=1.0,
                   help="keep the smallest set of tokens whose probability reaches P (default 1.0: off)")
    g.add_argument("--min-p", type=number("--min-p"), default=0.0,
                   help="drop tokens below P times the most likely one's probability (default 0.0: off)")
    g.add_argument("--repetition-penalty", type=number("--repetition-penalty"), default=1.0,
                   help="penalize tokens already in the prompt or output, HF style (default 1.0: off)")
    g.add_argument("--presence-penalty", type=number("--presence-penalty"), default=0.0,
                   help="subtract from the logits of tokens already in the output (default 0.0)")
    g.add_argument("--frequency-penalty", type=number("--frequency-penalty"), default=0.0,
                   help="subtract, per earlier occurrence in the output (default 0.0)")
    g.add_argument("--logit-bias", type=_logit_bias, action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS to a token's logit (repeatable)")
    g.add_argument("--seed", type=positive_int("--seed", 0), default=None,
                   help="sampling seed: the same text with speculation on or off (default: random)")
    g.add_argument("--max-tokens", type=positive_int("--max-tokens", 1), default=128,
                   help="new tokens at most (default 128)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    s = p.add_argument_group("structured output (at most one; the output follows it, speculation stays lossless)")
    s.add_argument("--json-schema", metavar="FILE", help="a JSON schema file (- for stdin)")
    s.add_argument("--json-object", action="store_true", help="any JSON object")
    s.add_argument("--regex", metavar="RE", help="a regular expression the whole output matches")
    s.add_argument("--choice", action="append", metavar="TEXT", help="one allowed output (repeatable)")
    s.add_argument("--grammar", metavar="FILE", help="a context-free grammar file (GBNF with ::=, else Lark)")


def structured_option(args: argparse.Namespace):
    """The --json-schema / --json-object / --regex / --choice / --grammar constraint, or None."""
    from .cli_common import CliError
    from .params import ParamError
    from .structured import Structured, check_grammar
    given = [(flag, value) for flag, value in (("--json-schema", args.json_schema), ("--json-object", args.json_object),
                                               ("--regex", args.regex), ("--choice", args.choice),
                                               ("--grammar", args.grammar)) if value]
    if len(given) > 1:
        raise CliError(f"give at most one of --json-schema, --json-object, --regex, --choice, --grammar "
                       f"(got {', '.join(f for f, _ in given)})")
    if not given:
        return None
    flag, value = given[0]
    if value == "-" and getattr(args, "prompt", None) == "-":
        raise CliError(f"{flag} - and the prompt - cannot both be read from stdin: give one of them as a file")
    try:
        if flag in ("--json-schema", "--grammar"):
            text = sys.stdin.read() if value == "-" else Path(value).expanduser().read_text()
            if flag == "--json-schema":
                structured = Structured("json_schema", json.loads(text))
            else:
                structured = Structured("grammar", text)
        else:
            structured = Structured({"--json-object": "json_object", "--regex": "regex", "--choice": "choice"}[flag],
                                    None if flag == "--json-object" else value)
        check_grammar(structured)                       # errors now (before the model loads), as one line
    except OSError as exc:
        raise CliError(f"{flag}: cannot read {value}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"{flag}: {value} is not JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise CliError(f"{flag}: {value} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                       f"{exc.start})") from None
    except ParamError as exc:
        raise CliError(f"{flag}: {' '.join(str(exc).split())}") from None
    return structured


def sampling_params(args: argparse.Namespace):
    """The options' SamplingParams; a bad value is a CliError naming its option (--top-p, not top_p)."""
    from .params import ParamError, SamplingParams
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, logit_bias=dict(args.logit_bias),
                              seed=args.seed, max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
                              structured=structured_option(args), prediction=prediction_option(args))
    except ParamError as exc:
        raise option_error(exc) from None


def suffix_option(value: str) -> str:
    """--suffix TEXT, or the text of the file --suffix @FILE names."""
    from .cli_common import CliError
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--suffix {value}: cannot read it ({exc})") from None


def prediction_option(args: argparse.Namespace) -> str | None:
    """The text of --prediction FILE (- for stdin), or None."""
    from .cli_common import CliError
    path = getattr(args, "prediction", None)
    if path is None:
        return None
    if path == "-" and getattr(args, "prompt", None) == "-":
        raise CliError("--prediction - and the prompt - cannot both be read from stdin: give one of them as a file")
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--prediction {path}: cannot read it ({exc})") from None
    if not text:
        raise CliError(f"--prediction {path}: the file is empty")
    return text


COMPARE_PAIRS = 3         # --compare: alternating (speculative, plain) runs timed at least (greedy or seeded)
COMPARE_MAX_PAIRS = 9     # ... at most, adding pairs while their speed-ups fall on both sides of 1.0x
COMPARE_SECONDS = 30.0    # ... and while the pairs after the first took less than this


def pair_ratios(spec_runs: list[dict], base_speeds: list[float]) -> list[float]:
    """Each alternating pair's speed-up (speculative over plain tokens per second)."""
    return [run["tokens_per_s"] / max(base, 1e-9) for run, base in zip(spec_runs, base_speeds)]


def straddles(spec_runs: list[dict], base_speeds: list[float]) -> bool:
    """Whether the pairs' speed-ups fall on both sides of 1.0x (the median alone cannot tell)."""
    ratios = pair_ratios(spec_runs, base_speeds)
    return min(ratios) <= 1.0 <= max(ratios)


GENERATE_EPILOG = (
    "The closing stats line: acceptance rate = draft tokens the target kept / draft tokens proposed (steps "
    "that drafted only); mean accepted length = tokens emitted per target pass, the target's own token "
    "included, over every step (1.00 = plain decoding); speed-up = tokens/s against plain decoding's. "
    "Speculation pays where the answer repeats the prompt or itself (code edits, extraction, summaries, "
    "lists); on free text it stays near 1.0x, as drafting is turned off where it does not pay. "
    "Terms: docs/drafters.md#terms.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding on CPU and CUDA.")
    parser.add_argument("--version", action="version", version=f"specdecode {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streaming it as it is accepted",
                         epilog=GENERATE_EPILOG)
    gen.add_argument("prompt", help="the prompt (use - to read it from stdin)")
    add_model_options(gen)
    add_sampling_options(gen)
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap the prompt in the model's chat template (default: on)")
    gen.add_argument("--compare", action="store_true",
                     help="also run plain decoding; print the measured speed-up and whether outputs are identical "
                          "(about 1.0x where the answer repeats neither the prompt nor itself: see below)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--no-stream", action="store_true", help="print the text at the end instead of streaming")
    gen.add_argument("--prediction", metavar="FILE", default=None,
                     help="the answer is expected to repeat most of this file (e.g. the file being edited): "
                          "drafts follow it, re-aligning after each change (OpenAI's Predicted Outputs; - for stdin)")
    gen.add_argument("--suffix", metavar="TEXT|@FILE", default=None,
                     help="fill in the middle: the prompt is the code before the cursor, this the code after it "
                          "(@FILE reads a file); the model's FIM format, no chat template (code models: "
                          "Qwen2.5-Coder, StarCoder2, CodeLlama, DeepSeek-Coder, Codestral)")
    gen.set_defaults(run=cmd_generate)
    from .serve.cli import add_serve_parser  # `specdecode serve` lives in specdecode/serve
    add_serve_parser(sub)
    from .bench import add_parser as add_bench_parser  # `specdecode bench` lives in specdecode/bench
    add_bench_parser(sub)
    from .distill.cli import add_parser as add_distill_parser  # `specdecode distill`: specdecode/distill
    add_distill_parser(sub)
    from .info import add_parser as add_info_parser  # `specdecode info`: what this machine runs (info.py)
    add_info_parser(sub)
    parser.subcommands = sub.choices       # main() reports a bad -k as the subcommand's usage error
    return parser


class Streamer:
    """Prints each sequence's new text as tokens are accepted (holding back split UTF-8)."""

    def __init__(self, tokenizer, out=sys.stdout) -> None:
        self.tokenizer, self.out, self.printed = tokenizer, out, 0

    def __call__(self, seq, tokens) -> None:
        text = self.tokenizer.decode(seq.output_ids)
        if seq.stop_text_index is not None:
            text = text[:seq.stop_text_index]
        elif not seq.finished:
            text = text.rstrip("\ufffd")          # an incomplete UTF-8 character
            hold = max((len(s) - 1 for s in seq.params.stop), default=0)
            text = text[:max(0, len(text) - hold)]  # may still become part of a stop string
        if len(text) > self.printed:
            self.out.write(text[self.printed:])
            self.out.flush()
            self.printed = len(text)


def cmd_generate(args: argparse.Namespace) -> int:
    from .api import LLM
    from .engine.sequence import check_room

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise CliError("prompt is empty")
    params = sampling_params(args)
    if args.method == "model" and args.draft is None:   # before loading anything (no progress bar)
        raise CliError("--method model needs a draft model: add --draft PATH")
    llm = LLM(model=args.model, draft=args.draft, method=args.method, num_speculative_tokens=args.k,
              dtype=args.dtype, device=args.device, threads=args.threads, fast=not args.eager,
              progress=not args.json, drafter_path=args.drafter, weights=args.weights, draft_dtype=args.draft_dtype,
              adaptive=args.adaptive, prefix_cache=False,   # --compare times full prefills of the same prompt
              **drafter_options(args))
    if args.suffix is None:
        ids = llm.encode(prompt, chat=args.chat)
    else:                                       # fill in the middle: the prompt is the prefix
        ids, stop_ids = llm.fim_prompt(prompt, suffix_option(args.suffix))
        params = params.with_stop_ids(stop_ids)
    check_room(len(ids), params.max_tokens, llm.target.model.max_len, "--max-tokens")   # before any generation
    # warm-up on the prompt's first tokens, so that the first measured run does not pay one-time costs
    # (allocations, kernels); the drafter then forgets it (and, with --compare, each timed run)
    memory = llm.drafter.memory() if llm.drafter is not None else None
    warm_k = min(args.k, 2) if llm.drafter is not None else 0
    llm.generate([ids[:32]], type(params)(max_tokens=4, ignore_eos=True), num_speculative_tokens=warm_k)

    def fresh_drafter() -> None:
        if memory is not None:
            llm.drafter.restore(memory)
    fresh_drafter()
    stream = not (args.json or args.no_stream)
    drafts = llm.drafter is not None and args.k > 0
    method = f"{llm.method} k={args.k}" if drafts else "none"     # no k where nothing drafts
    if args.compare and stream:
        print(f"--- speculative ({method}) ---", file=sys.stderr)
    out = llm.generate([ids], params, on_tokens=Streamer(llm.tokenizer) if stream else None)[0]
    if stream:
        print()
    elif not args.json:
        print(out.text)
    result = {"text": out.text, "tokens": out.token_ids, "num_tokens": len(out.token_ids),
              "finish_reason": out.finish_reason, "method": llm.method if drafts else "none",
              "k": args.k if drafts else 0,
              "weights": llm.target.weights_kind,
              **{key: out.stats[key] for key in ("tokens_per_s", "acceptance_rate", "mean_accepted_length",
                                                 "acceptance_per_position", "draft_s", "verify_s",
                                                 "prefill_s", "total_s", "tree_nodes_mean")}}
    if llm.drafter is not None and llm.drafter.summary():
        result["drafter"] = llm.drafter.summary()
    if args.compare:
        base = llm.generate([ids], params, num_speculative_tokens=0)[0]
        spec_runs, base_speeds = [out.stats], [base.stats["tokens_per_s"]]
        # one timed pair is mostly noise on a loaded host: alternate pairs, at least COMPARE_PAIRS, more
        # while their spread straddles 1.0x and COMPARE_SECONDS allow (greedy or seeded: every run writes
        # the same text; unseeded samples differ in length and work, so their pairs do not compare)
        until = time.perf_counter() + COMPARE_SECONDS
        while (params.greedy or params.seed is not None) and len(spec_runs) < COMPARE_MAX_PAIRS and (
                len(spec_runs) < COMPARE_PAIRS or (time.perf_counter() < until and straddles(spec_runs, base_speeds))):
            fresh_drafter()                              # not drafting from the runs before
            spec_runs.append(llm.generate([ids], params)[0].stats)
            base_speeds.append(llm.generate([ids], params, num_speculative_tokens=0)[0].stats["tokens_per_s"])
        for key in ("draft_s", "verify_s", "prefill_s", "total_s"):   # every timing the runs' median alike
            if all(isinstance(run.get(key), (int, float)) for run in spec_runs):
                result[key] = statistics.median(run[key] for run in spec_runs)
        spec_tps = statistics.median(run["tokens_per_s"] for run in spec_runs)
        base_tps = statistics.median(base_speeds)
        result["tokens_per_s"] = round(spec_tps, 2)
        result["baseline_tokens_per_s"] = round(base_tps, 2)
        result["timed_runs"] = len(spec_runs)
        result["speedup"] = round(spec_tps / base_tps, 3)
        ratios = pair_ratios(spec_runs, base_speeds)
        result["speedup_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]
        # the same work in both arms (nothing drafted), or pairs on both sides of 1.0x: noise decides
        result["within_noise"] = all(run["drafted_tokens"] == 0 for run in spec_runs) or straddles(spec_runs,
                                                                                                  base_speeds)
        result["identical"] = base.token_ids == out.token_ids
        if not result["identical"]:
            diverge = next((i for i, (a, b) in enumerate(zip(base.token_ids, out.token_ids)) if a != b),
                           min(len(base.token_ids), len(out.token_ids)))
            result["first_divergence"] = diverge
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"[{method}] {result['num_tokens']} tokens ({result['weights']} weights), "
          f"{result['tokens_per_s']:.1f} tok/s, "
          f"acceptance rate {result['acceptance_rate']:.2f}, mean accepted length "
          f"{result['mean_accepted_length']:.2f}, {finish_note(out.finish_reason, params.max_tokens)}",
          file=sys.stderr)
    if args.compare:
        note = "" if params.greedy or result["identical"] else (
            " (sampling without --seed: the runs draw different samples of the same distribution)"
            if params.seed is None else " (seeded sampling with a drafter that samples its drafts: same distribution)")
        low, high = result["speedup_spread"]
        runs = (f" (median of {result['timed_runs']} alternating runs each, pairs {low:.2f}-{high:.2f}x)"
                if result["timed_runs"] > 1 else " (one timed run each)")
        noise = ""
        if result["within_noise"]:
            noise = (": within noise (nothing was drafted: both arms decoded plain)"
                     if all(run["drafted_tokens"] == 0 for run in spec_runs) else ": within noise")
        print(f"[plain] {result['baseline_tokens_per_s']:.1f} tok/s -> speed-up {result['speedup']:.2f}x{noise}{runs}, "
              f"identical output: {'yes' if result['identical'] else 'no'}{note}", file=sys.stderr)
    return 0


def finish_note(reason: str | None, max_tokens: int) -> str:
    """Why the answer ended, as the stats line says it (a cut answer says so, and how to lengthen it)."""
    if reason == "length":
        return f"finish_reason length: cut at --max-tokens {max_tokens} (raise it for the rest)"
    return f"finish_reason {reason}"


def main(argv: list[str] | None = None) -> int:
    from .cli_common import draft_size_error
    from .drafters.base import DrafterError
    from .models.config import ModelError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("generate", "serve"):
        problem = draft_size_error(args)        # before any model loads
        if problem:
            parser.subcommands[args.command].error(problem)
    try:
        return args.run(args)
    except (ParamError, ModelError, DrafterError, CliError, FileNotFoundError) as exc:
        print(f"specdecode: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspecdecode: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # last resort: one line, not a traceback (SPECDECODE_DEBUG=1 shows it)
        if os.environ.get("SPECDECODE_DEBUG"):
            raise
        print(f"specdecode: internal error: {type(exc).__name__}: {exc} (set SPECDECODE_DEBUG=1 for details)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
