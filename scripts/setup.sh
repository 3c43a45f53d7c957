#!/usr/bin/env bash
# Create .venv with the CPU build of PyTorch and decodekit installed (editable).
# Usage: bash scripts/setup.sh [EXTRAS]   e.g. "dev" for the test dependencies.
# torch is pinned first so that resolving transformers never pulls CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}
[ -x .venv/bin/python ] || python3 -m venv .venv
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" 2>&1 | quiet
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e "$spec" 2>&1 | quiet
.venv/bin/python -c "import decodekit, torch, transformers" 
