"""Page faults of a CPU decode step at a real vocabulary: the step's large temporaries are
allocated afresh each step, and glibc hands them back to the kernel when they are freed.

    python benchmarks/page_faults.py [--shape qwen2.5-0.5b-16l] [--vocab 151936] [--rows 1,16,64]
        [--steps 12] [--rounds 2] [--temperature 1.0]

Random weights of the shape with a real vocabulary (Qwen2.5's 151,936 tokens by default;
the package's shapes have 2,048), float32, one torch thread, the eager engine. For each row
count, `rows` requests decode after their prompts, and `steps` decode steps are timed (wall
clock) with the minor page faults they cost (getrusage). Two kinds of process, alternating
for `rounds` rounds: malloc as it is, and glibc told to keep freed memory after the model's
load (mallopt: no mmap, a trim threshold of 1 GiB, one arena), the experiment of what the
faults cost. Prints one JSON
line per (rows, malloc, round): the median step, its faults and the resident size after.

A sampled step's temporaries at R rows and V tokens were the logits and their log-softmax
[R, V] float32, the float64 probabilities and their running sums [R, V], and the float64 copy
softmax was taken of: ~310 MB at 64 rows. glibc serves blocks of more than 32 MB with mmap and
unmaps them on free, and trims the top of its heap past a threshold, so each step faulted
them in again. sampling/select.py now works in a scratch buffer kept between steps; the
logits (the model's output) are still made each step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = "--child"


def keep_freed_memory() -> None:
    """glibc's mallopt: every block from the heap (M_MMAP_MAX 0), 1 GiB of free memory kept
    at its top (M_TRIM_THRESHOLD), one arena for every thread (M_ARENA_MAX). An experiment:
    torch's 64-byte aligned blocks freed and allocated alone can still miss the freed chunk
    and grow the heap (BENCHMARKS.md, "Page faults of a decode step")."""
    import ctypes

    mallopt = ctypes.CDLL(None).mallopt
    if not all(mallopt(parameter, value) == 1 for parameter, value in ((-4, 0), (-1, 1 << 30), (-8, 1))):
        raise RuntimeError("mallopt refused a setting")


def child(path: str, rows: int, steps: int, temperature: float, keep: bool) -> dict:
    import torch

    import decodekit as dk
    from decodekit.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    model = dk.load_model(path)
    if keep:  # after the load: its own temporaries were mapped and are gone
        keep_freed_memory()
    engine = Engine(model, EngineConfig(max_running=rows, compile=False))
    params = dk.SamplingParams(max_new_tokens=steps + 8, seed=0, ignore_eos=True, temperature=temperature)
    handles = [engine.submit([5 + i, 6, 7, 8], params) for i in range(rows)]
    for _ in range(3):  # the prompts and a first decode step
        engine.step()
    seconds, faults = [], []
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        engine.step()
        for handle in handles:
            handle.poll()
        seconds.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"ms_per_step_median": round(statistics.median(seconds) * 1e3, 2),
            "faults_per_step_median": int(statistics.median(faults)),
            "resident_mib": resident >> 20}  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == [CHILD]:
        path, rows, steps, temperature, keep = sys.argv[2:7]
        print(json.dumps(child(path, int(rows), int(steps), float(temperature), keep == "keep")))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b-16l")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    from decodekit.bench.decode import machine
    from decodekit.models import shapes

    with tempfile.TemporaryDirectory(prefix="decodekit-faults-") as folder:
        config = {**shapes.shape_config(args.shape), "vocab_size": args.vocab}
        path = shapes.save_checkpoint(config, Path(folder) / "checkpoint")
        for rows in (int(r) for r in args.rows.split(",")):
            for round_ in range(args.rounds):
                for malloc in ("as it is", "keep"):
                    command = [sys.executable, __file__, CHILD, str(path), str(rows), str(args.steps),
                               str(args.temperature), malloc]  # fmt: skip
                    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                    line = {"shape": args.shape, "vocab": args.vocab, "rows": rows,
                            "temperature": args.temperature, "malloc": malloc, "round": round_,
                            **json.loads(out.strip().splitlines()[-1]), "threads": 1,
                            "machine": machine()}  # fmt: skip
                    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
