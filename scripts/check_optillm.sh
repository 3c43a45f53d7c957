#!/usr/bin/env bash
# optillm's proxy in front of `decodekit serve` (issue 38): its `bon`, `moa` and
# `self_consistency` approaches, asked through the proxy, must answer 200. They hard-code
# max_tokens 256, 512 and 4096 whatever the model, which the server shortens to fit the
# context (finish_reason "length"), and send only OpenAI's fields.
#
# Not run in CI: optillm 0.4.0 requires torch, transformers < 5.13 (decodekit's venv has a
# newer one), spacy, gradio, google-cloud-aiplatform, presidio, selenium, peft, bitsandbytes
# and more, so it gets its own venv (CPU torch, installed first so that pip does not pull
# CUDA wheels). The server runs from decodekit's venv.
#
# `bon` and `moa` feed earlier answers back as prompts, longer than the shipped models' context
# (512 and 256 tokens): against them the server needs `--truncate-prompts` (SERVE_ARGS below).
#
# Usage: bash scripts/check_optillm.sh [MODEL]   (default shakespeare)
#   SERVE_ARGS="..."  more `decodekit serve` options, e.g. SERVE_ARGS=--truncate-prompts
#   VENV=/path   optillm's venv (default /tmp/decodekit-optillm; made when missing)
#   TORCH="..."  pip's arguments for the CPU torch installed first (default: torch from
#                PyTorch's CPU index; give "torch==2.13.0+cpu" where a local wheel provides it)
#   PYTHON=...   decodekit's Python (default .venv/bin/python); PORT, PROXY_PORT
#   URL=...      an OpenAI-compatible server already serving MODEL (a vLLM, to compare) instead
#                of starting `decodekit serve`
# Prints one line per approach (HTTP status, seconds, the start of the answer); exit status 0
# when all three answered 200.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
venv=${VENV:-/tmp/decodekit-optillm}
model=${1:-shakespeare}
port=${PORT:-8131}
proxy=${PROXY_PORT:-8132}
work=$(mktemp -d)

if [ ! -x "$venv/bin/optillm" ]; then
  python3 -m venv "$venv"
  # shellcheck disable=SC2086 # TORCH is a list of pip arguments
  "$venv/bin/pip" install -q ${TORCH:-torch --index-url https://download.pytorch.org/whl/cpu}
  "$venv/bin/pip" install -q "optillm==0.4.0"
fi

server=
base=${URL:-http://127.0.0.1:$port}
if [ -z "${URL:-}" ]; then
  # shellcheck disable=SC2086 # SERVE_ARGS is a list of options
  PYTHONPATH=src "$python" -m decodekit.cli serve --model "$model" --port "$port" --threads 1 \
    ${SERVE_ARGS:-} > "$work/server.log" 2>&1 &
  server=$!
else
  echo "(the server at $URL is not ours: no log)" > "$work/server.log"
fi
OPENAI_API_KEY=unused "$venv/bin/optillm" --base-url "$base/v1" --port "$proxy" > "$work/optillm.log" 2>&1 &
optillm=$!
trap 'kill $server $optillm 2>/dev/null; wait $server $optillm 2>/dev/null || true; rm -rf "$work"' EXIT
for url in "$base/health" "http://127.0.0.1:$proxy/health"; do
  for _ in $(seq 240); do
    curl -sf "$url" > /dev/null && break
    sleep 0.5
  done
  curl -sf "$url" > /dev/null || { echo "no answer from $url"; tail -20 "$work"/*.log; exit 1; }
done

failed=0
for approach in bon moa self_consistency; do
  body=$(printf '{"model": "%s-%s", "messages": [{"role": "user", "content": "ROMEO: What light?"}]}' \
    "$approach" "$model")
  start=$(date +%s.%N)
  status=$(curl -s -o "$work/answer.json" -w '%{http_code}' -H "Content-Type: application/json" \
    -H "Authorization: Bearer unused" -d "$body" "http://127.0.0.1:$proxy/v1/chat/completions")
  seconds=$(echo "$(date +%s.%N) - $start" | bc)
  printf '%-17s %s  %6.1f s  %s\n' "$approach" "$status" "$seconds" "$(head -c 160 "$work/answer.json")"
  [ "$status" = 200 ] || failed=1
done
if [ "$failed" != 0 ]; then
  echo "--- decodekit serve"; tail -20 "$work/server.log"
  echo "--- optillm"; tail -20 "$work/optillm.log"
fi
exit "$failed"
