#!/usr/bin/env bash
# Schemathesis' full run (every check, every phase) against `decodekit serve` on the embedded
# shakespeare model, with small bounds so each generated request is fast.
# Usage: bash scripts/fuzz_server.sh [MAX_EXAMPLES]   (default 50 per operation)
# Needs schemathesis (pip install schemathesis). Exit status: schemathesis'.
#
# positive_data_acceptance: a schema-valid body the server refuses. The published schema
# (server/openapi.py) carries every single-field bound; checks across fields (best_of >= n,
# a prompt longer than the context, min_p with top_k ...) cannot be written in it, so a 400
# naming its field is an expected answer to a schema-valid body.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
schemathesis=${SCHEMATHESIS:-$(dirname "$python")/schemathesis}
examples=${1:-50}
port=${PORT:-8123}
work=$(mktemp -d)
cat > "$work/schemathesis.toml" <<'TOML'
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "404", "503"]
TOML
# --strict-fields: the schema closes the bodies, so an unknown key must be refused (negative data)
PYTHONPATH=src "$python" -m decodekit.cli serve --model shakespeare --max-tokens 8 --max-n 4 --timeout 30 \
  --strict-fields --port "$port" > "$work/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  sleep 0.5
done
"$schemathesis" --config-file "$work/schemathesis.toml" run "http://127.0.0.1:$port/openapi.json" \
  --checks all --max-examples "$examples" --seed 1 --no-color
