"""The docs cannot drift from the CLI or point nowhere.

* Every `specdecode SUBCOMMAND ...` command in a fenced shell block of README.md, docs/*.md and the
  package READMEs parses with the real parser (`cli.build_parser`), every flag it shows exists exactly as
  written (no abbreviations), and every `--drafter-option KEY=...` is an option of the method it runs.
  Usage synopses (`[--flag VALUE]`) and inline `specdecode ...` spans in prose are checked flag by flag.
* `--help` of every subcommand renders.
* Every relative link (and its #anchor, for a Markdown target) in those files and in benchmarks/ points
  to something that exists.
* Every other command they show is copyable as written: each script a doc names (`python scripts/...`,
  `bash scripts/...`) exists, each `python -m specdecode...` module exists, every Python block compiles,
  no doc installs an extra from a package index that does not hold specdecode, and the OpenAI examples
  call the name a plain `specdecode serve` serves.
* The README keeps the newcomer's path: exactly two set-up commands (the first runs the main job, the
  second the tests, as CI does), then the venv activated, before any bare `specdecode` / `python`.
* The CLI's help and the docs agree: every --method is in docs/drafters.md, the methods that read
  --drafter, what the native kernels do with activations, every serve option documented, and every
  docs/ page#anchor a help text points to exists; the terms its outputs use are defined once, in
  docs/drafters.md#terms.
Parse only: nothing is loaded or run."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from specdecode.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_DOCS = USER_DOCS + [ROOT / "CONTRIBUTING.md", *sorted(ROOT.glob("specdecode/*/README.md")),
                            ROOT / "benchmarks" / "README.md"]
# RESULTS.md keeps each run's command as it was run (some flags have changed since): links only
LINK_DOCS = COMMAND_DOCS + [ROOT / "benchmarks" / "RESULTS.md"]
SHELLS = ("", "bash", "sh", "shell", "console")
COMMAND = re.compile(r"(?:^|(?<=[\s;&(]))(?:[\w./~$-]*/)?specdecode\s+(?=[a-z])")
FLAG = re.compile(r"^--?[A-Za-z][\w-]*")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fenced_blocks(text: str):
    """(language, [lines]) of every fenced code block."""
    lang, lines = None, []
    for line in text.splitlines():
        fence = re.match(r"^\s*```\s*([\w+-]*)", line)
        if fence and lang is None:
            lang, lines = fence.group(1).lower(), []
        elif fence:
            yield lang, lines
            lang = None
        elif lang is not None:
            lines.append(line)


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    keep, inside = [], False
    for line in text.splitlines():
        if re.match(r"^\s*```", line):
            inside = not inside
        elif not inside:
            keep.append(line)
    return "\n".join(keep)


def shell_commands(path: Path) -> list[tuple[str, list[str]]]:
    """(source line, argv after `specdecode`) of every specdecode command in the file's shell blocks."""
    out = []
    for lang, lines in fenced_blocks(path.read_text()):
        if lang not in SHELLS:
            continue
        logical, buf = [], ""
        for line in lines:
            buf += line.rstrip()
            if buf.endswith("\\"):
                buf = buf[:-1] + " "
                continue
            logical.append(buf)
            buf = ""
        for line in logical:
            for match in COMMAND.finditer(line):
                tokens = shlex.split(line[match.end():], comments=True)
                for i, tok in enumerate(tokens):
                    if tok in ("&&", "||", ";", "|", ">", "2>", "&"):
                        tokens = tokens[:i]
                        break
                out.append((line.strip(), tokens))
    return out


def inline_commands(path: Path) -> list[tuple[str, list[str]]]:
    """`specdecode SUB ...` spans in the prose: checked as synopses (flags only)."""
    spans = re.findall(r"`((?:[\w./~-]*/)?specdecode\s+[a-z][^`]*)`", prose(path.read_text()))
    return [(span, span.split(None, 1)[1].replace("[", " [").split()) for span in spans]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def resolve(tokens: list[str]) -> tuple[list[argparse.ArgumentParser], list[str]]:
    """The parsers a command reaches (`bench`, then `bench serve`) and its name; each alternative of
    `generate|serve` is one parser."""
    parser, names = build_parser(), []
    chain = [parser]
    for tok in tokens:
        subs = subparsers(chain[-1])
        alternatives = tok.split("|")
        if not subs or not all(a in subs for a in alternatives):
            break
        names.append(tok)
        if len(alternatives) > 1:
            return [subs[a] for a in alternatives], names
        chain.append(subs[tok])
    return chain[1:], names


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def shown_flags(tokens: list[str]) -> list[str]:
    flags = []
    for tok in tokens:
        for part in tok.strip("[]().,;").split("/"):
            part = part.strip("[]")
            m = FLAG.match(part)
            if m and not re.match(r"^-\d", part):
                flags.append(m.group(0))
    return flags


def check(source: str, tokens: list[str], synopsis: bool) -> list[str]:
    """Problems with one documented command (empty when it is right)."""
    parsers, names = resolve(tokens)
    if not names:
        return [f"{source!r}: no subcommand of specdecode (have {', '.join(subparsers(build_parser()))})"]
    rest = tokens[len(names):]
    # `generate|serve --method NAME`: a flag any of the alternatives has; else the last parser reached
    known = set.union(*(option_strings(p) for p in parsers)) if len(parsers) > 1 else option_strings(parsers[-1])
    problems = [f"{source!r}: {' '.join(names)} has no option {flag}"
                for flag in shown_flags(rest) if flag not in known]
    if synopsis or any("[" in t or t in ("...", "|") for t in rest) or problems:
        return problems
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(tokens)
    except SystemExit as exc:
        return [f"{source!r}: does not parse (exit {exc.code}): {err.getvalue().strip().splitlines()[-1:]}"]
    return check_drafter_options(source, args)


def check_drafter_options(source: str, args: argparse.Namespace) -> list[str]:
    from specdecode.drafters.registry import drafter_option_names
    options = dict(getattr(args, "drafter_options", None) or [])
    if not options:
        return []
    method = getattr(args, "method", None) or ("cascade" if getattr(args, "draft", None) else "ngram")
    if isinstance(method, list):                      # bench: --methods plain,model,...
        method = next((m for m in method if m not in ("plain", "none")), "ngram")
    known = set(drafter_option_names(method))
    return [f"{source!r}: --drafter-option {key} is not an option of method {method}" for key in options
            if key not in known]


def all_commands():
    for path in COMMAND_DOCS:
        for source, tokens in shell_commands(path):
            yield rel(path), source, tokens, False
        for source, tokens in inline_commands(path):
            yield rel(path), source, tokens, True


def test_the_extractor_finds_commands_and_the_checker_catches_drift(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("```bash\n.venv/bin/specdecode generate \"hi there\" --compare \\\n    -k 4   # note\n"
                   "bash x.sh && specdecode info --json | head\n```\n"
                   "Use `specdecode serve [--port N] [--bogus]` or `specdecode generate|serve --method NAME`.\n")
    cmds = shell_commands(doc)
    assert [t for _, t in cmds] == [["generate", "hi there", "--compare", "-k", "4"], ["info", "--json"]]
    assert all(not check(s, t, False) for s, t in cmds)
    (span, tokens), (span2, tokens2) = inline_commands(doc)
    assert any("--bogus" in p for p in check(span, tokens, True)) and not check(span2, tokens2, True)
    assert check("x", ["generate", "hi", "--max-tok", "3"], False)               # an abbreviation is drift
    assert check("x", ["generate", "hi", "-k", "many"], False)                   # a bad value does not parse
    assert check("x", ["frobnicate"], False)
    assert check("x", ["generate", "hi", "--drafter-option", "head_vocab=8"], False)   # ngram has no head_vocab
    assert not check("x", ["generate", "hi", "--draft", "d.gguf", "--drafter-option", "head_vocab=8"], False)
    assert not check("x", ["bench", "serve", "--concurrency", "1,4", "--compare-speculation"], False)


def test_docs_show_commands():
    found = {}
    for doc, source, _tokens, _synopsis in all_commands():
        found.setdefault(doc, []).append(source)
    for doc in ("README.md", "docs/models.md", "docs/serving.md", "docs/benchmarking.md", "docs/ray.md"):
        assert found.get(doc), f"no specdecode command found in {doc}: is the extractor broken?"


def test_every_documented_command_parses():
    problems = [f"{doc}: {p}" for doc, source, tokens, synopsis in all_commands()
                for p in check(source, tokens, synopsis)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "bench serve", "distill", "info"])
def test_help_of_every_subcommand_renders(command):
    out = io.StringIO()
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stdout(out):
        build_parser().parse_args([*command.split(), "--help"])
    assert exc.value.code == 0 and out.getvalue().startswith(f"usage: specdecode {command}")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(path.read_text()))
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


def test_slugs_follow_github():
    assert slug("Scale-out on Ray Serve") == "scale-out-on-ray-serve"
    assert slug("`specdecode bench serve`: load-testing a server") == "specdecode-bench-serve-load-testing-a-server"
    assert slug("Which method for which job") == "which-method-for-which-job"


def test_every_relative_link_points_to_something_that_exists():
    assert len(LINK_DOCS) > 10
    broken = []
    for doc in LINK_DOCS:
        for target in links(doc):
            if re.match(r"^[a-z]+:", target):            # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{rel(doc)}: {target} (no {dest})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{rel(doc)}: {target} (no heading #{anchor} in {rel(dest)})")
    assert not broken, "\n".join(broken)


def test_readme_is_short_and_links_every_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    guides = {Path(t).name for t in links(ROOT / "README.md") if t.startswith("docs/")}
    assert guides >= {p.name for p in (ROOT / "docs").glob("*.md")}, "a guide in docs/ is not linked from README.md"


# ---------------------------------------------------------------------------------- other commands

SCRIPT = re.compile(r"(?<![\w/.])scripts/[\w./-]*\.(?:py|sh|c)\b")
MODULE = re.compile(r"python3? -m (specdecode[\w.]*)")


def test_every_script_a_doc_names_exists():
    named = [(doc, path) for doc in COMMAND_DOCS for path in SCRIPT.findall(doc.read_text())]
    missing = [f"{rel(doc)}: {path}" for doc, path in named if not (ROOT / path).is_file()]
    assert len(named) > 10 and not missing, "\n".join(missing)


def test_every_module_a_doc_runs_exists():
    import importlib.util
    missing = [f"{rel(doc)}: python -m {name}" for doc in COMMAND_DOCS for name in MODULE.findall(doc.read_text())
               if importlib.util.find_spec(name) is None]
    assert not missing, "\n".join(missing)


def python_blocks(path: Path) -> list[str]:
    return ["\n".join(lines) for lang, lines in fenced_blocks(path.read_text()) if lang in ("python", "py")]


def test_every_python_block_compiles():
    bad = []
    for doc in COMMAND_DOCS:
        for i, block in enumerate(python_blocks(doc)):
            try:
                compile(block, f"{rel(doc)} block {i}", "exec")
            except SyntaxError as exc:
                bad.append(f"{rel(doc)}: python block {i}: {exc}")
    assert python_blocks(ROOT / "README.md") and not bad, "\n".join(bad)


def test_no_doc_installs_specdecode_from_an_index():
    """specdecode is not on PyPI: extras install from the clone (`pip install -e '.[llamacpp]'`)."""
    wrong = [f"{rel(doc)}: {m.group(0)}" for doc in COMMAND_DOCS
             for m in re.finditer(r"pip install [\"']?specdecode\b[^`\n]*", doc.read_text())]
    assert not wrong, "\n".join(wrong)


def test_openai_examples_call_the_served_name():
    """Against `specdecode serve` (the embedded model) a request names `smollm2`, or a name the same doc
    serves with --served-model-name; anything else is a 404."""
    from specdecode.models.loader import DEFAULT_MODEL
    assert DEFAULT_MODEL == "smollm2"
    problems, seen = [], 0
    for doc in COMMAND_DOCS:
        text = doc.read_text()
        served = {DEFAULT_MODEL, *(name for name in re.findall(r"--served-model-name (\w[\w.-]*)", text)
                                   if not name.isupper())}                   # NAME is a placeholder
        for block in python_blocks(doc):
            if "OpenAI(" not in block:
                continue
            for name in re.findall(r"\bmodel=[\"']([^\"']+)[\"']", block):
                seen += 1
                if name not in served:
                    problems.append(f"{rel(doc)}: model={name!r} (served: {sorted(served)})")
        for body in re.findall(r"-d '(\{.*?\})'", text, flags=re.S):
            name = json.loads(body).get("model")
            seen += name is not None
            if name is not None and name not in served:
                problems.append(f"{rel(doc)}: curl \"model\": {name!r} (served: {sorted(served)})")
    assert seen >= 3 and not problems, "\n".join(problems)


# ------------------------------------------------------------------------------- the newcomer's path

def readme_shell_lines() -> list[list[str]]:
    return [[line for line in lines if line.strip() and not line.lstrip().startswith("#")]
            for lang, lines in fenced_blocks((ROOT / "README.md").read_text()) if lang in SHELLS]


def test_readme_starts_with_two_setup_commands_then_activates_the_venv():
    readme = (ROOT / "README.md").read_text()
    blocks = readme_shell_lines()
    setup = blocks[0]
    assert len(setup) == 2 and all(line.startswith("bash scripts/setup/setup.sh && ") for line in setup), setup
    assert (ROOT / "scripts/setup/setup.sh").is_file()
    main_job = shlex.split(setup[0].split("&&", 1)[1])
    assert main_job[:2] == [".venv/bin/specdecode", "generate"] and "--compare" in main_job, main_job
    assert setup[1].endswith("&& .venv/bin/python -m pytest -q"), setup[1]
    # what CI runs is the README's test command, with the linter before the tests
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip() and line[0] != "#"][-1]
    assert ci.replace(" && .venv/bin/ruff check .", "") == setup[1], (ci, setup[1])
    # right after the set-up: the venv activated, and every later bare command runs in it
    assert blocks[1][0] == "source .venv/bin/activate", blocks[1]
    assert readme.index("source .venv/bin/activate") < readme.index("## Command line")
    bare = [line for block in blocks[:1] for line in block if re.match(r"(specdecode|python|pip|pytest) ", line)]
    assert not bare, bare


def test_readme_order_is_the_newcomers():
    headings = [h for h in re.findall(r"^## (.+)$", prose((ROOT / "README.md").read_text()), flags=re.M)]
    path = ["Set up", "Command line", "Python", "From an OpenAI client", "Results"]
    assert [h for h in headings if h in path] == path, headings
    assert headings[0] == "Set up", headings


def test_readme_says_what_to_expect_next_to_compare():
    readme = (ROOT / "README.md").read_text()
    cli = readme[readme.index("## Command line"):readme.index("## Python")]
    assert "--compare" in cli and "1.0x" in cli and "docs/drafters.md#terms" in cli
    python = readme[readme.index("## Python"):readme.index("## From an OpenAI client")]
    assert "chat=False" in python and "chat=True" in python        # generate continues raw text by default


# --------------------------------------------------------------------------- help and docs agree

def help_text(*command: str) -> str:
    out = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stdout(out):
        build_parser().parse_args([*command, "--help"])
    return " ".join(out.getvalue().split())


def test_every_method_is_in_the_drafters_guide():
    from specdecode.cli_common import method_choices
    table = {m for m in re.findall(r"^\| `([\w-]+)`", (ROOT / "docs" / "drafters.md").read_text(), flags=re.M)}
    missing = [m for m in method_choices() if m not in table]
    assert not missing, f"--method choices missing from docs/drafters.md's table: {missing}"


def test_the_methods_that_read_a_drafter_directory_agree():
    from specdecode.cli_common import DRAFTER_DIR_METHODS
    from specdecode.drafters.registry import drafter_option_names, method_names
    readers = [m for m in method_names() if "drafter_path" in drafter_option_names(m)]
    assert sorted(DRAFTER_DIR_METHODS.split(", ")) == sorted(readers)
    assert f"(methods {DRAFTER_DIR_METHODS})" in help_text("generate")
    guide = " ".join((ROOT / "docs" / "drafters.md").read_text().split())
    sentence = re.search(r"([^.]*) without `--draft` read a drafter directory", guide).group(1)
    assert sorted(re.findall(r"`([\w-]+)`", sentence)) == sorted(readers), sentence


def test_native_activations_are_said_alike():
    from specdecode.cli_common import NATIVE_ACTIVATIONS
    from specdecode.info import _describe
    assert NATIVE_ACTIVATIONS in help_text("generate")
    described = _describe({"isa": "avx512", "qamx_min_rows": 12, "amx_int8": False, "amx_bf16": False,
                           "loaded": False})
    assert NATIVE_ACTIVATIONS in described["gguf"]
    assert NATIVE_ACTIVATIONS in " ".join((ROOT / "docs" / "models.md").read_text().split())


def test_the_device_default_is_said_truthfully():
    args = build_parser().parse_args(["generate", "hi"])
    assert args.device == "cpu" and "cpu (the default" in help_text("generate")
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "CUDA where present" not in readme and "--device cuda" in readme


def test_every_serve_option_is_documented():
    docs = (ROOT / "docs" / "serving.md").read_text() + (ROOT / "docs" / "ray.md").read_text()
    shared = option_strings(subparsers(build_parser())["generate"])      # the model options: docs/models.md
    missing = [flag for flag in option_strings(subparsers(build_parser())["serve"])
               if flag.startswith("--") and flag not in shared and flag != "--help"
               and not re.search(re.escape(flag) + r"(?![\w-])", docs)]
    assert not missing, f"serve options in neither docs/serving.md nor docs/ray.md: {missing}"


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "bench serve", "distill", "info"])
def test_every_doc_a_help_text_points_to_exists(command):
    for target in re.findall(r"\bdocs/[\w-]+\.md(?:#[\w-]+)?", help_text(*command.split())):
        file, _, anchor = target.partition("#")
        assert (ROOT / file).is_file(), target
        assert not anchor or anchor in anchors(ROOT / file), target


def test_the_terms_are_defined_once_where_outputs_point():
    guide = (ROOT / "docs" / "drafters.md").read_text()
    assert "terms" in anchors(ROOT / "docs" / "drafters.md")
    terms = guide[guide.index("## Terms"):guide.index("\n## ", guide.index("## Terms") + 1)]
    for term in ("acceptance rate", "mean accepted length", "accepted", "recovered", "bonus"):
        assert f"**{term}**" in terms, term
    assert "docs/drafters.md#terms" in help_text("generate")
    for doc in USER_DOCS:                       # one definition: the other pages link to it
        if doc.name != "drafters.md":
            assert "**acceptance rate**" not in doc.read_text(), rel(doc)


def test_the_readme_defines_its_jargon_at_first_use():
    """A newcomer reads the README top down: each term of the trade is bold (defined there) where the
    prose first uses it, code blocks aside (they met "prompt lookup" or "Spec-Bench" in a table first)."""
    readme = " ".join(prose((ROOT / "README.md").read_text()).split())
    for term in ("prompt lookup", "cascade", "controller", "jump-forward", "Spec-Bench", "TTFT"):
        first = readme.find(term)
        assert first >= 0 and readme[first - 2:first] == "**", (term, readme[max(0, first - 80):first + 80])
