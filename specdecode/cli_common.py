"""Command-line helpers shared by every `specdecode` subcommand (generate, serve, bench, distill).

This module sits below all the CLIs: each of them imports it, it imports none of them, so the
subcommands never import each other. Argument parsers (`positive_int`, `number`, `comma_list`)
raise argparse errors that name the option; `CliError` is a bad combination of options found
after parsing (the CLI prints one line and exits with code 2).
"""
from __future__ import annotations

import argparse

from .models.dtypes import DTYPE_NAMES, DtypeAction, accepted  # noqa: F401  (torch-free; DTYPE_NAMES re-exported)

# The methods that read `--drafter DIR` (the registry's drafters with a `drafter_path` option;
# tests/test_docs.py holds this, the help and docs/drafters.md to the registry)
DRAFTER_DIR_METHODS = "eagle, eagle2, medusa, cascade"
# What the native kernels do with activations (said alike in --help, `specdecode info` and docs/models.md)
NATIVE_ACTIVATIONS = "bf16 activations, quantized to int8 per row and block of 32 values for each matrix product"


class CliError(ValueError):
    """A bad command-line argument."""


def option_error(exc) -> Exception:
    """A SamplingParams ParamError as the CLI says it: naming the option (`--top-p must be ...`, not
    `top_p must be ...`); another ParamError unchanged."""
    field = exc.sampling_field
    return CliError("--" + field.replace("_", "-") + str(exc)[len(field):]) if field else exc


def positive_int(name: str, low: int = 1, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            limit = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{name} must be {limit}, got {value}")
        return value
    return parse


def number(name: str):
    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
    return parse


def comma_list(name: str, allowed: tuple[str, ...], aliases: dict[str, tuple[str, ...]] | None = None):
    """A comma-separated list of names from `allowed` (an alias expands to several)."""
    def parse(text: str) -> list[str]:
        out: list[str] = []
        for item in (x.strip() for x in text.split(",") if x.strip()):
            if aliases and item in aliases:
                out += aliases[item]
            elif item in allowed:
                out.append(item)
            else:
                raise argparse.ArgumentTypeError(f"{name}: unknown {item!r} (choose from {', '.join(allowed)})")
        if not out:
            raise argparse.ArgumentTypeError(f"{name} is empty")
        return list(dict.fromkeys(out))
    return parse


def method_choices() -> list[str]:
    """`--method` values: every registered drafter (see drafters/registry.py) and "none"."""
    from .drafters.registry import method_names
    return [*method_names(), "none"]


def drafter_option(text: str) -> tuple[str, object]:
    """argparse type of --drafter-option: KEY=VALUE with VALUE an int, a float, true/false or text."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"--drafter-option takes KEY=VALUE (KEY an identifier), got {text!r}")
    value: object = raw
    for cast in (int, float):
        try:
            value = cast(raw)
            break
        except ValueError:
            pass
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    return key.strip(), value


def drafter_options(args: argparse.Namespace) -> dict:
    """--drafter-option pairs as keyword options, checked against the method's drafter (CliError)."""
    _check_models_used(args)
    options = dict(getattr(args, "drafter_options", None) or [])
    if options:
        from .drafters.base import DrafterError
        from .drafters.registry import check_drafter_options
        try:
            method = args.method
            if method is None:                   # the default drafter for these arguments (api.default_method)
                from .api import default_method
                method = default_method(getattr(args, "draft", None), getattr(args, "model", None),
                                        getattr(args, "drafter", None))
            check_drafter_options(method, options)
        except DrafterError as exc:
            raise CliError(str(exc)) from None
    return options


def draft_size_error(args: argparse.Namespace) -> str | None:
    """What is wrong with -k for the method the arguments pick (a chain drafter, or none, takes at most
    MAX_CHAIN draft tokens per step, a tree drafter MAX_TREE_NODES nodes), or None; read from the
    arguments alone, so that a bad -k is refused before any model loads (the limits' modules import
    torch: called after parsing, so that --help stays quick)."""
    k, method = getattr(args, "k", None), getattr(args, "method", None)
    if not isinstance(k, int):
        return None
    from .engine.config import MAX_CHAIN
    from .tree import MAX_TREE_NODES
    if k > MAX_TREE_NODES:
        return f"-k {k}: at most {MAX_TREE_NODES} (draft tree nodes of a tree drafter; {MAX_CHAIN} draft tokens " \
               f"of a chain drafter)"
    if k <= MAX_CHAIN:
        return None
    from .drafters.base import DrafterError
    from .drafters.registry import drafter_class, method_names
    if method is None:                       # the default drafter for these arguments (api.default_method)
        from .api import default_method
        try:
            method = default_method(getattr(args, "draft", None), getattr(args, "model", None),
                                    getattr(args, "drafter", None))
        except (DrafterError, OSError, ValueError):
            return None                      # the load reports it, naming the file
    if method == "none":
        return f"-k {k}: --method none drafts nothing; leave -k out (or give at most {MAX_CHAIN})"
    if method not in method_names():
        return None
    options = dict(getattr(args, "drafter_options", None) or [])
    tree_topk = options.get("tree_topk", 1)  # EAGLE's head drafts trees when asked for more than one child
    if drafter_class(method).capabilities.drafts_trees or (isinstance(tree_topk, int) and tree_topk > 1):
        return None
    return f"-k {k}: method {method!r} drafts chains of at most {MAX_CHAIN} tokens per step (tree drafters: " \
           f"up to {MAX_TREE_NODES} nodes)"


def _check_models_used(args: argparse.Namespace) -> None:
    """CliError for --draft / --drafter given with a --method that never reads them (the draft was
    loaded, re-quantized and never used)."""
    from .drafters.registry import drafter_option_names, method_names
    method = getattr(args, "method", None)
    if method is None or (method != "none" and method not in method_names()):
        return
    for flag, value, option in (("--draft", getattr(args, "draft", None), "draft"),
                                ("--drafter", getattr(args, "drafter", None), "drafter_path")):
        if value is not None and (method == "none" or option not in drafter_option_names(method)):
            users = "model, text-model, cascade, assistant" if option == "draft" else DRAFTER_DIR_METHODS
            raise CliError(f"{flag} {value}: method {method!r} does not use it ({users} do); leave it out "
                           f"or pick one of those")


def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="target: a .gguf file, an HF directory, or a Hugging Face id ORG/NAME, ORG/NAME:QUANT (the "
                        "GGUF file with that quant tag), ORG/NAME/FILE.gguf; an existing path wins; downloads go to "
                        "huggingface_hub's cache, HF_HUB_OFFLINE=1 uses it only (docs/models.md; default: embedded "
                        "SmolLM2-135M-Instruct)")
    g.add_argument("--draft", default=None,
                   help="draft model, named as --model is (path or Hugging Face id); one with another tokenizer "
                        "drafts through text (method text-model), Gemma 4's assistant (a gemma4_assistant "
                        "directory) with method assistant (docs/drafters.md)")
    g.add_argument("--method", default=None, choices=method_choices(),
                   help="drafter (default: cascade with --draft or --drafter, assistant with Gemma 4's assistant "
                        "as --draft, mtp for a Qwen3.5 checkpoint with its multi-token-prediction head, else "
                        "ngram; none: plain decoding; "
                        f"{DRAFTER_DIR_METHODS} use the drafter shipped for the embedded model when no --drafter "
                        "is given (cascade with --draft: suffix-index lookup where the text repeats at length, else "
                        "the draft model); drafters registered by other packages are listed too; every method: "
                        "docs/drafters.md)")
    g.add_argument("--drafter", default=None, metavar="DIR",
                   help=f"trained drafter directory from `specdecode distill` (methods {DRAFTER_DIR_METHODS})")
    g.add_argument("-k", "--num-speculative-tokens", dest="k", type=positive_int("-k", 0), default=5,
                   help="draft tokens per step (chain drafters) or draft tree nodes (tree drafters: recycle, "
                        "suffix, lookahead, eagle2, medusa); 0 = plain decoding (default 5; the limits: "
                        "engine/config.py MAX_CHAIN, tree.py MAX_TREE_NODES)")
    g.add_argument("--drafter-option", dest="drafter_options", action="append", default=[], metavar="KEY=VALUE",
                   type=drafter_option,
                   help="an option of the method's drafter, repeatable, e.g. tree_topk=8 tree_depth=6 (eagle2), "
                        "min_confidence=0.3 (eagle), ngram_max=4 (ngram); an unknown key lists the accepted ones")
    g.add_argument("--adaptive", default=None, action=argparse.BooleanOptionalAction,
                   help="choose each step's draft size up to -k from measured costs and acceptance, plain "
                        "decoding when drafts do not pay (default: on; --no-adaptive drafts k every step)")
    g.add_argument("--dtype", default=None, action=DtypeAction,
                   help=f"dense weights in this dtype (a GGUF file is dequantized): {accepted()} (any case); "
                        "auto (the checkpoint's own: a GGUF file computes on its "
                        "quantized weights, an HF directory in its config's torch_dtype); default: a GGUF file "
                        "on its own quantized weights (--weights native), anything else in bf16")
    g.add_argument("--weights", default="auto", choices=["auto", "native", "dense"],
                   help=f"native: a GGUF file's quantized weights as stored ({NATIVE_ACTIVATIONS}); dense: "
                        "dequantized to --dtype; auto (default): native for a GGUF file unless --dtype is given")
    g.add_argument("--draft-dtype", default=None, action=DtypeAction, allow_int8=True,
                   help="the draft model's dtype if not the target's; int8 quantizes its weights per channel, "
                        "q4_0 re-quantizes them to 4-bit blocks (a cheaper draft; still lossless), auto keeps "
                        "a GGUF file's own; default: q4_0 for a GGUF draft whose Q4_0 copy reads >= 20%% fewer "
                        "bytes, else the target's dtype")
    g.add_argument("--device", default="cpu",
                   help="cpu (the default, also with a GPU present), cuda, cuda:N, or auto (cuda when available)")
    g.add_argument("--threads", type=positive_int("--threads", 1, 1024), default=None,
                   help="CPU threads (default: torch's choice)")
    g.add_argument("--eager", action="store_true", help="disable the fast kernels (reference eager path)")
