#!/usr/bin/env bash
# The GPU check (issue 33): every strategy on CUDA (tests/test_cuda.py: greedy equal to the
# CPU's, seeded equal to itself; the CUDA graphs equal to the eager engine; one host sync a
# step) and the engine's speed table against transformers' generate() and its static cache
# in the same run, the engine's decode steps replayed from CUDA graphs (its default on a GPU;
# `bench engine --eager` times the eager step). On an H200, 2026-11-28: the tests 7 s; one
# scenario group at a time, 128 new tokens, one repeat, 30-100 s each. Run from the
# repository root with the venv:
#
#     bash scripts/gpu_check.sh [--dtype bfloat16]
#
# Its output goes into BENCHMARKS.md with the GPU's name ("On a GPU").
set -euo pipefail
dtype=bfloat16
while [ $# -gt 0 ]; do
    case "$1" in
        --dtype) dtype="$2"; shift 2 ;;
        *) echo "gpu_check.sh: unknown argument $1 (allowed: --dtype NAME)" >&2; exit 2 ;;
    esac
done
python="${PYTHON:-python}"
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: no CUDA GPU')"
"$python" -c "import torch; print('GPU:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
echo "==> pytest -m cuda (every strategy on the GPU)"
timeout 240 "$python" -m pytest -m cuda tests/test_cuda.py -q -p no:cacheprovider
for shape in qwen2.5-0.5b llama-3.2-1b; do
    # the table: batch 1, 16 samples of a 512-token prompt, 64 concurrent requests
    echo "==> decodekit bench engine --device cuda --shape $shape --dtype $dtype (against transformers)"
    timeout 300 "$python" -c "import sys; from decodekit.cli import main; sys.exit(main(sys.argv[1:]))" \
        bench engine --device cuda --shape "$shape" --dtype "$dtype" --new-tokens 128 --repeats 2
done
# where a graphed step's time goes, for each attention form of the graph (2026-11-29: the writing
# SDPA form and the written-out one): GPU replay against the host; and n samples of one prompt
# with its KV shared (the prefixed graphs) and not, where engine/rows.py's GPU_SHARE_MIN_BYTES
# (an estimate) says 16 x 512 does not pay and 64 x 8192 does (none of it yet run on a GPU)
echo "==> scripts/gpu_step_profile.py --shape qwen2.5-0.5b (a step's wall time, its graph's GPU time, the host's profile)"
timeout 240 "$python" scripts/gpu_step_profile.py --shape qwen2.5-0.5b --device cuda --dtype "$dtype" \
    --attention both --shared 16:512,64:8192
