#!/usr/bin/env bash
# Build the external engines the `peer` tests run against, into .peers/ (ignored by git):
#   .peers/venv                 llama-cpp-python[server], compiled from source for this CPU
#                               (CMAKE_ARGS=-DGGML_NATIVE=ON; about 25 minutes on 2 cores)
#   .peers/shakespeare-f32.gguf the embedded `shakespeare` model converted by llama.cpp's own
#                               convert_hf_to_gguf.py (vendored in the llama-cpp-python sdist)
# Usage: bash scripts/peers.sh [PYTHON]
#   PYTHON: a Python with decodekit's dependencies (torch, transformers) for the converter;
#           default .venv/bin/python (scripts/setup.sh makes it).
#   PEERS_ISA=avx2: llama.cpp built for AVX2 + FMA + F16C without AVX-512 (GGML_NATIVE=OFF), to
#           compare with DECODEKIT_GEMV_ISA=avx2 on an AVX-512 machine; with DECODEKIT_PEERS
#           naming another folder (DECODEKIT_PEERS=.peers-avx2) beside the native build.
# Then: pytest -m peer (tests/server/test_peers.py, tests/bench/test_llamacpp_bench.py) and
# `decodekit bench packed --peer llamacpp` find .peers/ by themselves ($DECODEKIT_PEERS: elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
jobs=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
peers=${DECODEKIT_PEERS:-.peers}
case ${PEERS_ISA:-native} in
  native) ggml="-DGGML_NATIVE=ON" ;;
  avx2) ggml="-DGGML_NATIVE=OFF" ;;  # its defaults then: SSE4.2, AVX, AVX2, BMI2, FMA, F16C; no AVX-512
  *) echo "PEERS_ISA must be native or avx2, not ${PEERS_ISA}" >&2; exit 2 ;;
esac
src=$peers/src/llama_cpp_python-$version
step() { printf '==> %s\n' "$*"; }

mkdir -p "$peers/src"
if [ ! -d "$src" ]; then
  step "downloading the llama-cpp-python $version source"
  "$python" -m pip download --no-deps --no-binary :all: -d "$peers/src" "llama-cpp-python==$version"
  tar -xzf "$peers/src/llama_cpp_python-$version.tar.gz" -C "$peers/src"
fi

if [ ! -x "$peers/venv/bin/python" ]; then
  step "creating $peers/venv"
  python3 -m venv "$peers/venv"
fi
if ! "$peers/venv/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
  step "building llama-cpp-python[server] from source with $jobs jobs (about 25 minutes on 2 cores)"
  # LLAVA_BUILD=OFF: no multimodal library (51 of 178 objects); the peer benches
  # load text models only, and llama_cpp imports mtmd_cpp only for multimodal chat formats.
  CMAKE_ARGS="$ggml -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$jobs \
    "$peers/venv/bin/python" -m pip install --no-binary llama-cpp-python "$src[server]"
fi

# The converter runs on decodekit's Python (torch, transformers) with two more libraries of
# its own in $peers/convert-lib: llama.cpp's gguf-py and sentencepiece (the Llama converter
# tries a sentencepiece vocabulary first and needs the module to find there is none).
llama=$src/vendor/llama.cpp
if [ ! -d "$peers/convert-lib/sentencepiece" ]; then
  step "installing the converter's libraries into $peers/convert-lib"
  "$python" -m pip install --no-deps --target "$peers/convert-lib" sentencepiece "$llama/gguf-py"
fi
step "converting the embedded shakespeare model to $peers/shakespeare-f32.gguf"
model=$(PYTHONPATH=src "$python" -c "from decodekit.models.registry import resolve; print(resolve('shakespeare')[1])")
# src/decodekit/bench/gguf.py: the conversion `decodekit bench packed --peer llamacpp` also runs
# (it registers decodekit's byte-level BPE pre-tokeniser as GPT-2's; see its docstring).
PYTHONPATH="src:$peers/convert-lib:$llama" "$python" -m decodekit.bench.gguf "$model" "$peers/shakespeare-f32.gguf"
step "done: $peers/venv/bin/python -m llama_cpp.server --model $peers/shakespeare-f32.gguf"
