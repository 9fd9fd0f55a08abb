#!/usr/bin/env bash
# Install Debian's Prometheus (prometheus + promtool) for the integration tests. Idempotent:
# does nothing when both binaries are already on PATH. Needs root (CI containers) and apt.
#   bash dashboards/install_prometheus.sh
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "prometheus already installed: $(prometheus --version 2>&1 | head -n 1)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "apt-get not found: install Prometheus >= 2.42 by other means" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# --no-install-recommends: skip prometheus-node-exporter; the tests need only the server.
$SUDO apt-get install -y -q --no-install-recommends prometheus
# The package's service is not wanted here (and containers have no systemd to run it).
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    $SUDO systemctl stop prometheus
fi
prometheus --version 2>&1 | head -n 1
