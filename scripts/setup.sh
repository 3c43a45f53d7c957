#!/usr/bin/env bash
# Create .venv with the CPU build of PyTorch and decodekit installed (editable).
# Usage: bash scripts/setup.sh [EXTRAS]
#   (none)  extras "all": everything the README's examples use (constrained decoding,
#           the server, evaluation plots, the openai client)
#   dev     "all" plus the test tools and the training corpus
#   any pyproject extras, comma-separated, e.g. "constrained,server"
# torch is pinned first so that resolving transformers never pulls CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-all}
step() { printf '==> %s\n' "$*"; }
# pip warns about every missing local index directory: not news to a user.
quiet() { grep --line-buffered -v "is ignored: it is neither a file nor a directory" || true; }
pip() { .venv/bin/python -m pip --disable-pip-version-check "$@" 2>&1 | quiet; }

if [ -x .venv/bin/python ]; then
  step "using the existing .venv"
else
  step "creating .venv ($(python3 --version))"
  python3 -m venv .venv
fi
step "installing torch 2.13.0 (CPU) first"
pip install "torch==2.13.0"
step "installing decodekit (editable) with extras [$extras]; this takes a minute or two"
pip install -e ".[$extras]"
.venv/bin/python -c "import decodekit, torch, transformers"
step "done: .venv/bin/decodekit --help lists the commands"
