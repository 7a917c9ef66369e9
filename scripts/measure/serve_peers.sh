#!/usr/bin/env bash
# Serving against peers, one server after another on the same cores (never two at once):
# vLLM's CPU server and specdecode on the embedded model, llama.cpp's server and specdecode on the
# 1.5B Q4_K_M file, each measured by `specdecode bench serve --url` at concurrency 1, 4 and 16
# (64 tokens, Spec-Bench prompts, each level its own prompts) after a warm-up run on HumanEval prompts.
#
#   VLLM_PY=/path/to/vllm-venv/bin/python LLAMACPP_PY=/path/to/llamacpp-venv/bin/python \
#       bash scripts/measure/serve_peers.sh [OUT_DIR]
#
# Installing the peers (their own venvs, out of specdecode's): docs/benchmarking.md. A peer whose
# python is not given is skipped. The embedded model's dense
# HF directory for vLLM is the one `specdecode info --model` / the HF export writes under
# ~/.cache/specdecode/converted/ (bf16 weights from the same file); set EMBEDDED_HF to override.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-benchmarks/serve-peers}
SD=${SD:-.venv/bin/specdecode}
M15=${M15:-$HOME/.cache/specdecode/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
EMBEDDED_HF=${EMBEDDED_HF:-$(ls -d "$HOME"/.cache/specdecode/converted/SmolLM2-135M-Instruct* 2>/dev/null | head -1)}
LOGS=$(mktemp -d)
wait_up() { for _ in $(seq 1 150); do sleep 2; curl -s "localhost:$1/v1/models" > /dev/null 2>&1 && return 0; done; return 1; }
stop() { kill "$1" 2> /dev/null; wait "$1" 2> /dev/null; sleep 3; }
bench() {  # port, out dir, extra args
    # warm-up on other prompts (HumanEval): no measured prompt is in a server's cache beforehand
    "$SD" bench serve --url "http://127.0.0.1:$1" --tasks humaneval --concurrency 1 --max-tokens 16 --num-requests 4 \
        --out "$LOGS/warm" > /dev/null 2>&1
    "$SD" bench serve --url "http://127.0.0.1:$1" --concurrency 1,4,16 --max-tokens 64 $3 --out "$2" 2>&1 | grep -E "^\| concurrency"
}
echo "CPU: $(.venv/bin/python -c 'from specdecode.fast.linear import cpu_label; print(cpu_label())')"
if [ -n "${VLLM_PY:-}" ] && [ -n "$EMBEDDED_HF" ]; then
    VLLM_CPU_KVCACHE_SPACE=4 "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$EMBEDDED_HF" \
        --served-model-name smollm2 --dtype bfloat16 --max-model-len 4096 --host 127.0.0.1 --port 8100 > "$LOGS/vllm.log" 2>&1 &
    pid=$!; wait_up 8100 && { echo "vllm-embedded"; bench 8100 "$OUT/vllm-embedded" ""; }; stop $pid
fi
"$SD" serve --port 8101 --log-level warning > "$LOGS/sd-embedded.log" 2>&1 &
pid=$!; wait_up 8101 && { echo "specdecode-embedded"; bench 8101 "$OUT/specdecode-embedded-defaults" ""; }; stop $pid
if [ -n "${LLAMACPP_PY:-}" ] && [ -f "$M15" ]; then
    "$LLAMACPP_PY" -m llama_cpp.server --model "$M15" --n_threads 2 --n_ctx 8192 --host 127.0.0.1 --port 8102 \
        --model_alias qwen --interrupt_requests False > "$LOGS/llamacpp.log" 2>&1 &
    pid=$!; wait_up 8102 && { echo "llamacpp-1.5b"; bench 8102 "$OUT/llamacpp-1.5b" "--num-requests 16"; }; stop $pid
fi
if [ -f "$M15" ]; then
    "$SD" serve --model "$M15" --port 8103 --log-level warning > "$LOGS/sd-1.5b.log" 2>&1 &
    pid=$!; wait_up 8103 && { echo "specdecode-1.5b"; bench 8103 "$OUT/specdecode-1.5b" "--num-requests 16"; }; stop $pid
fi
echo "logs: $LOGS"
