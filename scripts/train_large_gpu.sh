#!/usr/bin/env bash
# shakespeare-large on one GPU (issue 36): the CPU recipe (scripts/train_large.sh: 1,600 steps
# of 8 x 512 tokens) and a twice-as-long schedule side by side on the same GPU, under bfloat16
# autocast; each run keeps `best/` at its lowest validation loss. Then validation and test
# perplexity of both (the shipped protocol, float32), and the better run by validation stored
# as int8 shards (models/int8_storage.py) with its perplexity after the rounding.
#
#     DATA=/path/to/corpus OUT=/path/out bash scripts/train_large_gpu.sh [--tiny]
#
# DATA holds train.txt and val.txt (scripts/prepare_corpus.py); OUT gets the logs, the
# perplexities (ppl.json) and the int8 shards (OUT/int8). --tiny: a CPU smoke run.
set -euo pipefail
DATA=${DATA:?DATA: the corpus folder}
OUT=${OUT:?OUT: where the logs and the int8 model go}
RUNS=${RUNS:-/tmp/large-runs}
PYTHON=${PYTHON:-python3}
MINUTES=${MINUTES:-5}
device=cuda
tiny=()
schedules=(1600 3200)
if [[ "${1:-}" == "--tiny" ]]; then device=cpu; tiny=(--tiny); schedules=(6 12); fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT" "$RUNS"
for steps in "${schedules[@]}"; do
    "$PYTHON" scripts/train_lm.py --config shakespeare-large --steps "$steps" --out "$RUNS/s$steps" \
        --data "$DATA" --tokenizer src/decodekit/models/assets/shakespeare --device "$device" \
        --threads 2 --eval-every 50 --keep-best --max-minutes "$MINUTES" "${tiny[@]}" \
        > "$OUT/train-$steps.log" 2>&1 &
done
wait
"$PYTHON" - "$RUNS" "$OUT" "$device" "${schedules[@]}" <<'EOF'
import json, math, subprocess, sys
from pathlib import Path
from decodekit.cli import main as cli

runs, out, device, schedules = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]

def ppl(model, split):
    path = out / f"ppl-{model.parent.name}-{model.name}-{split}.json"
    with open(path, "w") as f, __import__("contextlib").redirect_stdout(f):
        cli(["eval", "perplexity", str(model), "--split", split, "--device", device, "--json"])
    return json.loads(path.read_text())

results = {}
for steps in schedules:
    best = runs / f"s{steps}" / "best"
    results[steps] = {split: ppl(best, split) for split in ("val", "test")}
    print(steps, {s: r.get("perplexity", r) for s, r in results[steps].items()}, flush=True)
key = lambda s: results[s]["val"].get("perplexity", math.inf)
chosen = min(schedules, key=key)
int8_dir = out / "int8"  # stored as the package ships it (models/int8_storage.py)
subprocess.run([sys.executable, "-m", "decodekit.models.int8_storage", str(runs / f"s{chosen}" / "best"),
                str(int8_dir)], check=True)
results["chosen"] = chosen
results["int8"] = {split: ppl(int8_dir, split) for split in ("val", "test")}
(out / "ppl.json").write_text(json.dumps(results, indent=1))
print(json.dumps(results, indent=1))
EOF
