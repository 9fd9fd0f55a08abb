#!/usr/bin/env bash
# Install (idempotent) and serve the built-in default model on http://127.0.0.1:8000/v1.
# Extra arguments go to `iterserve serve` (e.g. --port 9000 --api-key KEY --num-replicas 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/iterserve serve "$@"
