#!/usr/bin/env bash
# The GPU first light on the borrowed GPU machine, as it is: no install, nothing fetched.
#   bash scripts/gpu_first_light.sh OUT [gpu_first_light flags, e.g. --dry-run --stages parity]
# 1. pip-installs the carried wheels ($GPU_CARRY/wheels/*.whl, default .gpu_carry; made by
#    `python -m iterserve.loadtests.studies.gpu_first_light.rehearse --prepare`) into a
#    private folder, never over the machine's own packages;
# 2. makes this checkout importable as iterserve.* without installing it (symbolic links, the
#    layout pyproject.toml's package-dir maps), the studies included;
# 3. runs the stages into OUT (report.md after every stage, the whole log in OUT/first_light.log).
# $PYTHON picks the interpreter (default python3): rehearse.py runs this very script on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/gpu_first_light.sh OUT [flags]}
shift
PYTHON=${PYTHON:-python3}
carry=${GPU_CARRY:-.gpu_carry}
site=$(mktemp -d "${TMPDIR:-/tmp}/iterserve-site.XXXXXX")
trap 'rm -rf "$site"' EXIT
if compgen -G "$carry/wheels/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" "$carry"/wheels/*.whl
fi
mkdir -p "$site/iterserve"
cp iterserve/__init__.py "$site/iterserve/"
for room in replica kernels deploy autoscale dashboards loadtests; do
    ln -s "$PWD/$room" "$site/iterserve/$room"
done
flags=()
if [ -f "$carry/smollm2/tokenizer.json" ]; then
    flags+=(--tokenizer "$carry/smollm2")
fi
mkdir -p "$out"
# PYTHONSAFEPATH: the checkout root (the working directory) holds iterserve/__init__.py alone;
# first on sys.path it would hide the linked package (python 3.11+).
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
"$PYTHON" -c 'import sys, torch, triton, iterserve; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.cuda.is_available()}, iterserve from {iterserve.__file__}")'
set +e
"$PYTHON" -m iterserve.loadtests.studies.gpu_first_light.gpu_first_light --out "$out" "${flags[@]}" "$@" \
    2>&1 | tee "$out/first_light.log"
exit "${PIPESTATUS[0]}"
