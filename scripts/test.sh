#!/usr/bin/env bash
# Install everything (idempotent) and run the whole test suite: unit, kernel (Triton
# interpreter), Ray Serve integration and the Prometheus dashboard test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
if ! command -v prometheus >/dev/null 2>&1; then
    bash dashboards/install_prometheus.sh || echo "prometheus not installed: its test will skip"
fi
.venv/bin/ruff check .
.venv/bin/python scripts/deadcode.py
exec .venv/bin/python -m pytest "$@"
