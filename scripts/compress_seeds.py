"""Spread of the calibrated methods over calibration seeds, and 2-bit quantisation.

`decodekit bench compress` runs GPTQ and SparseGPT with calibration seed 0 only. Their result
also moves with tiny numerical changes (the greedy column-by-column rounding or pruning
flips on float rounding differences; the same seed gave different perplexities with one and
two torch threads), so this script repeats every calibrated configuration with other seeds
(other random calibration windows) and adds 2-bit round-to-nearest vs GPTQ, where
round-to-nearest has no headroom left. Prints one JSON line per row, then a summary.

    python scripts/compress_seeds.py --model shakespeare --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import torch

from decodekit.bench.compress import measure
from decodekit.compress.recipe import CompressConfig

CALIBRATED = (
    CompressConfig("gptq", bits=4),
    CompressConfig("gptq", bits=3),
    CompressConfig("gptq", bits=2),
    CompressConfig("sparsegpt", sparsity=0.5),
    CompressConfig("sparsegpt", n_m="2:4"),
)
UNCALIBRATED = (CompressConfig("rtn", bits=2),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="shakespeare")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results: dict[str, list[float]] = {}
    runs = [(c, 0) for c in UNCALIBRATED] + [(c, s) for c in CALIBRATED for s in args.seeds]
    for config, seed in runs:
        row, _ = measure(args.model, replace(config, seed=seed))
        row["seed"] = seed
        print(json.dumps(row), flush=True)
        results.setdefault(row["config"], []).append(row["perplexity"])
    summary = {
        name: {"min": min(v), "median": statistics.median(v), "max": max(v), "runs": len(v)}
        for name, v in results.items()
    }
    print(json.dumps({"model": args.model, "threads": args.threads, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
