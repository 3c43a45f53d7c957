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
# decodekit's CPU kernels (src/decodekit/models/csrc, every *.cpp compiled side by side with g++):
# built once per source, torch version and CPU into src/decodekit/models/_native/, so a later run
# only finds them (a few seconds, mostly importing torch). A cold build costs about 80 s of CPU
# time with g++ 12 on an AMD EPYC Zen 3: about a minute on two idle cores, several on a busy
# machine (464 s at a load of 12 on 2 cores). Without a compiler, or if the build fails, setup
# goes on and the pure-torch paths run (`decodekit doctor` says which, and what it costs).
step "building decodekit's CPU kernels unless built (optional)"
.venv/bin/python -m decodekit.models.kernels --build || echo "    kernels not built: the pure-torch paths will run"
if [[ ",$extras," == *",dev,"* ]]; then
  # Optional: the lab's browser tests (tests/server/test_lab_browser.py) drive Debian's
  # chromium through playwright; without either they skip. Nothing here can fail the setup.
  step "optional: playwright and chromium for the lab's browser tests (they skip without them)"
  pip install playwright || echo "    playwright not installed: the browser tests will skip"
  as_root=""
  [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null && sudo -n true 2>/dev/null && as_root="sudo -n"; }
  if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && { [ "$(id -u)" = 0 ] || [ -n "$as_root" ]; }; then
    { timeout 300 $as_root apt-get install -y -q chromium >/dev/null 2>&1 ||
      { timeout 120 $as_root apt-get update -q >/dev/null 2>&1 &&
        timeout 300 $as_root apt-get install -y -q chromium >/dev/null 2>&1; }; } ||
      echo "    chromium not installed: the browser tests will skip"
  fi
fi
step "done: .venv/bin/decodekit --help lists the commands"
