"""Speculative decoding against plain decoding in alternated rounds: a speedup that holds on a
noisy machine.

`speculative_large.py` sweeps many configurations, each timed once or twice beside the plain
runs around it; on a shared machine one disturbed plain run moves a ratio by tens of percent.
This script times few configurations many times: at each temperature a round runs plain
decoding, then every configuration, then plain again, and a configuration's ratio in that
round is the mean CPU time of the two plain runs over its own. It prints each configuration's
median ratio and its range over the rounds (JSON).

    OMP_NUM_THREADS=1 python benchmarks/speculative_rounds.py --target shakespeare-large \\
        --draft shakespeare-large-draft --rounds 8

Configurations (one torch thread, held-out prompts, `--new-tokens` each, seed 0): at T = 0 and
T = 1, the draft at `--gammas` with block verification and with the adaptive rule from γ = 4.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import decodekit as dk
from decodekit.bench.decode import machine
from decodekit.bench.speculative import bench_params, heldout_prompts, run_plain, run_speculative, summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="shakespeare-large")
    parser.add_argument("--draft", default="shakespeare-large-draft")
    parser.add_argument("--gammas", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    target = dk.load_model(args.target)
    prompts = heldout_prompts(target, args.prompts)
    configs = [(g, False) for g in args.gammas] + [(4, True)]  # (γ, adaptive) at each temperature
    warm = bench_params(args.new_tokens, 1.0)
    run_speculative(target, args.draft, prompts[:1], warm, 2, "block")  # warm-up
    ratios: dict[str, list[float]] = {}
    figures: dict[str, dict] = {}
    for r in range(args.rounds):
        line = []
        for temperature in args.temperatures:
            p = bench_params(args.new_tokens, temperature)
            before = run_plain(target, prompts, p)
            timed = []
            for gamma, adaptive in configs:
                stats, timing = run_speculative(target, args.draft, prompts, p, gamma, "block", adaptive)
                key = f"t{temperature:g}_gamma{gamma}{'_adaptive' if adaptive else ''}"
                timed.append((key, stats, timing))
            after = run_plain(target, prompts, p)
            for key, stats, timing in timed:
                row = summary(stats, timing, before, beside=(before, after))
                ratios.setdefault(key, []).append(row["speedup_cpu_beside"])
                figures[key] = {k: row[k] for k in ("alpha", "acceptance_rate", "block_efficiency")}
                line.append(f"{key} {row['speedup_cpu_beside']:.2f}x")
        print(f"round {r + 1}: " + ", ".join(line), flush=True)
    result = {"target": args.target, "draft": args.draft, "new_tokens": args.new_tokens,
              "prompts": len(prompts), "rounds": args.rounds, "machine": machine(),
              "load_average": os.getloadavg()[0],
              "speedup": {k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
                              "max": round(max(v), 3), **figures[k]} for k, v in ratios.items()}}  # fmt: skip
    print(json.dumps(result["speedup"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
