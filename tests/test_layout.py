"""docs/layout.md cannot drift from the tree.

* Every file under scripts/ (tracked by git; every file when this is not a git checkout) and every
  package folder directly under specdecode/ is named in docs/layout.md.
* Every path docs/layout.md names exists.

The names are read from the fenced blocks of docs/layout.md: a line's names are what comes before
its first run of two spaces (`api.py, cli.py` names two), each a file (`x.py`) or a folder (`x/`);
an indented line is inside the nearest folder above it that is indented less, and a line whose
text before two spaces is not a list of names continues the description above it.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = ROOT / "docs" / "layout.md"
NAME = re.compile(r"^[\w.-]+(/|\.\w+)$")       # a folder (`cache/`) or a file (`setup.sh`)


def named_paths(text: str) -> list[str]:
    """The paths the fenced blocks of a layout text name, relative to the repository root
    (folders end with a slash)."""
    out: list[str] = []
    folders: list[tuple[int, str]] = []                 # (indent, path) of the folders the line may be in
    inside = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside, folders = not inside, []
            continue
        if not inside or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        names = [n.strip() for n in re.split(r"\s{2,}", line.strip(), maxsplit=1)[0].split(",")]
        if not all(NAME.match(n) for n in names):
            continue                                    # a description's continuation
        while folders and folders[-1][0] >= indent:
            folders.pop()
        if indent > (folders[-1][0] + 2 if folders else 0):
            continue                                    # deeper than a child: a continuation
        parent = folders[-1][1] if folders else ""
        for name in names:
            out.append(parent + name)
            if name.endswith("/") and len(names) == 1:
                folders.append((indent, parent + name))
    return out


def repo_files(folder: str) -> list[str]:
    """Files under `folder` (relative paths): tracked ones, or every one outside a git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", folder], cwd=ROOT, capture_output=True, check=True)
        return [p for p in listed.stdout.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        return sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts)


def test_the_reader_follows_folders_and_skips_descriptions():
    text = ("```\npkg/\n  a.py          what a is\n                continued, over  two lines\n"
            "                x.py  a continuation that looks like a name\n"
            "  sub/          a folder\n    b.sh        in it\n  c.py, d/      two names\n"
            "top.md        at the top\n          y.py  also a continuation\n```\nprose/ outside  a block\n")
    assert named_paths(text) == ["pkg/", "pkg/a.py", "pkg/sub/", "pkg/sub/b.sh", "pkg/c.py", "pkg/d/", "top.md"]


def test_layout_names_every_script_and_package_folder():
    named = set(named_paths(LAYOUT.read_text()))
    scripts = [p for p in repo_files("scripts") if p not in named]
    assert repo_files("scripts"), "no files under scripts/: is the listing broken?"
    packages = sorted({f"specdecode/{Path(p).parts[1]}/" for p in repo_files("specdecode") if len(Path(p).parts) > 2})
    missing = [p for p in packages if p not in named]
    assert not scripts + missing, f"docs/layout.md does not name: {', '.join(scripts + missing)}"


def test_every_path_in_the_layout_exists():
    named = named_paths(LAYOUT.read_text())
    assert len(named) > 20, "docs/layout.md names few paths: is the reader broken?"
    gone = [p for p in named if not (ROOT / p).exists() or p.endswith("/") != (ROOT / p).is_dir()]
    assert not gone, f"docs/layout.md names what does not exist: {', '.join(gone)}"
