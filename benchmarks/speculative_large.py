"""Speculative decoding with a memory-bound target: issue 36's "pair and its numbers".

The target is `shakespeare-large` (a checkpoint directory while it trains, e.g.
/work/runs/shakespeare-large/best) or any model load_model takes; the drafts are the shipped
`shakespeare` (3.4M) and `shakespeare-draft` (0.2M), the target's own int4 copy ("self-int4")
and n-gram prompt lookup. For each at temperature 0 and 1, on held-out prompts (the shipped
test plays, as `decodekit bench speculative`):

- every γ in --gammas with block and token verification side by side (at T = 0 both rules
  accept the same tokens, so block only), and the adaptive rule starting from γ = 4;
- α (mean Σ min(p, q) at verified positions), acceptance rate, block efficiency (tokens per
  target call), speedup over plain decoding of the same target in CPU time of this process
  (each configuration the best of --repeats; plain is timed between configurations): beside
  plain, against the mean of the plain runs just before and after it (the load it shared: the
  figure to read on a shared machine), and against the sweep's best plain run;
- per draft and temperature: the best γ by measurement, and what the adaptive rule reached;
- at T = 1, block verification's gain in expected block efficiency over token verification
  on the same blocks (`paired_block_efficiency`, which removes sampling noise);
- prompt lookup also on a prompt that repeats its text (`copy_prompts`), where it can pay.

One torch thread. Prints a Markdown table and writes --json.

    python benchmarks/speculative_large.py --target /work/runs/shakespeare-large/best \\
        --label "step 1600" --json benchmarks/results/speculative_large.json
    python benchmarks/speculative_large.py --target ... --quick    # a check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import decodekit as dk
from decodekit.bench.decode import machine
from decodekit.bench.speculative import (
    Timing,
    copy_prompts,
    heldout_prompts,
    paired_block_efficiency,
    run_plain,
    run_speculative,
    summary,
)
from decodekit.bench.speculative import (
    bench_params as params,
)
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import DEFAULT_CONFIG, engine_for

DRAFTS = ("shakespeare", "shakespeare-draft", "self-int4", "prompt-lookup")


def sweep(target, drafts, prompts, new_tokens, gammas, repeats, log) -> tuple[list[dict], dict]:
    """Rows for every (temperature, draft, γ, rule) and the adaptive rule, and the plain
    decoding reference per temperature (tokens per CPU / wall second)."""
    rows, plain_rates = [], {}
    for temperature in (0.0, 1.0):
        p = params(new_tokens, temperature)
        rules = ("block",) if temperature == 0 else ("block", "token")
        configs = [(d, g, r, False) for d in drafts for g in gammas for r in rules]
        configs += [(d, 4, "block", True) for d in drafts]
        plains, runs = [], []
        for draft, gamma, verify, adaptive in configs:
            plains.append(run_plain(target, prompts, p))
            stats, timing = run_speculative(target, draft, prompts, p, gamma, verify, adaptive, repeats)
            runs.append((draft, gamma, verify, adaptive, stats, timing))
            log(f"t={temperature:g} {draft} gamma={gamma} {verify}{' adaptive' if adaptive else ''}: "
                f"{plains[-1].cpu / timing.cpu:.2f}x CPU")  # fmt: skip
        plain = Timing(min(t.wall for t in plains), min(t.cpu for t in plains))
        tokens = new_tokens * len(prompts)
        plain_rates[f"t{temperature:g}"] = {"tok_s": round(tokens / plain.wall, 2),
                                            "cpu_tok_s": round(tokens / plain.cpu, 2)}
        plains.append(run_plain(target, prompts, p))  # the last configuration's plain after it
        for i, (draft, gamma, verify, adaptive, stats, timing) in enumerate(runs):
            rows.append({"draft": draft, "temperature": temperature, "gamma": gamma, "verify": verify,
                         "adaptive": adaptive, "mean_gamma": round(stats["drafted_tokens"]
                                                                   / max(stats["target_calls"], 1), 2),
                         **summary(stats, timing, plain, beside=(plains[i], plains[i + 1]))})  # fmt: skip
    return rows, plain_rates


def best_gammas(rows: list[dict]) -> list[dict]:
    """Per draft, temperature and rule: the γ with the highest CPU speedup, beside the
    adaptive rule's run."""
    out = []
    def key(r: dict) -> tuple:
        return r["draft"], r["temperature"], r["verify"]

    for draft, temperature, verify in sorted({key(r) for r in rows if not r["adaptive"]}):
        same = [r for r in rows if key(r) == (draft, temperature, verify)]
        fixed = [r for r in same if not r["adaptive"]]
        best = max(fixed, key=lambda r: r["speedup_cpu_beside"])
        adaptive = next((r for r in same if r["adaptive"]), None)
        out.append({"draft": draft, "temperature": temperature, "verify": verify,
                    "best_gamma": best["gamma"], "best_speedup_cpu": best["speedup_cpu_beside"],
                    "adaptive_mean_gamma": adaptive and adaptive["mean_gamma"],
                    "adaptive_speedup_cpu": adaptive and adaptive["speedup_cpu_beside"]})  # fmt: skip
    return out


def markdown(result: dict) -> str:
    lines = [f"target {result['target']} ({result['label']}), {result['new_tokens']} new tokens x "
             f"{result['prompts']} prompts; plain: {result['plain']}", "",
             "| draft | T | γ | verify | α | accept rate | block eff. | speedup (CPU, beside plain) | "
             "speedup (CPU, best plain) |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        gamma = f"adaptive (mean {r['mean_gamma']})" if r["adaptive"] else str(r["gamma"])
        lines.append(f"| {r['draft']} | {r['temperature']:g} | {gamma} | {r['verify']} | {r['alpha']:.2f} | "
                     f"{r['acceptance_rate']:.2f} | {r['block_efficiency']:.2f} | "
                     f"{r['speedup_cpu_beside']:.2f}x | {r['speedup_cpu']:.2f}x |")  # fmt: skip
    copies = result["copy_workload"].items()
    lines += ["", "prompt lookup, copying prompt: " + ", ".join(
        f"{k}: {v['speedup_cpu']:.2f}x CPU, block eff. {v['block_efficiency']:.2f}" for k, v in copies)]
    lines += ["", "block vs token verification at T = 1 (paired E[block efficiency]): "
              + ", ".join(f"{d} γ={g}: {100 * v['gain']:+.1f} %" for d, per in result["paired_t1"].items()
                          for g, v in per.items())]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="checkpoint directory or model name")
    parser.add_argument("--label", default="", help="what the target is (e.g. 'step 200, untrained')")
    parser.add_argument("--drafts", nargs="+", default=list(DRAFTS))
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="γ 2 and 4, 32 tokens, one prompt, one repeat")
    parser.add_argument("--compile", action="store_true",
                        help="the target's engine compiles at once (EngineConfig(compile=True)): plain "
                             "decoding, the draft's one-token step, verification spans")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.gammas, args.new_tokens, args.prompts, args.repeats = [2, 4], 32, 1, 1

    torch.set_num_threads(1)
    target = dk.load_model(args.target)
    if args.compile:  # the persistent engine every run below uses (engine/engine.py `engine_for`)
        engine_for(target, EngineConfig(**{**vars(DEFAULT_CONFIG), "compile": True}))
    prompts = heldout_prompts(target, args.prompts)
    start = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {line}", flush=True)

    run_speculative(target, args.drafts[0], prompts[:1], params(8, 1.0), 2, "block")  # warm-up
    rows, plain = sweep(target, args.drafts, prompts, args.new_tokens, args.gammas, args.repeats, log)
    model_drafts = [d for d in args.drafts if d != "prompt-lookup"]
    paired = {d: {g: paired_block_efficiency(target, d, prompts, params(args.new_tokens, 1.0), g)
                  for g in args.gammas} for d in model_drafts}  # fmt: skip
    copies, p0 = copy_prompts(target, args.prompts), params(args.new_tokens, 0.0)
    copy_workload = {}
    for gamma in (4, 8):
        reference = run_plain(target, copies, p0, args.repeats)
        stats, timing = run_speculative(target, "prompt-lookup", copies, p0, gamma, "block", False,
                                        args.repeats)  # fmt: skip
        copy_workload[f"gamma{gamma}"] = summary(stats, timing, reference)
    result = {"target": args.target, "label": args.label, "target_parameters": target.num_parameters(),
              "dtype": str(getattr(target, "dtype", "")).removeprefix("torch."),
              "new_tokens": args.new_tokens, "prompts": len(prompts), "machine": machine(),
              "load_average": os.getloadavg()[0], "plain": plain, "rows": rows,
              "best_gamma": best_gammas(rows), "paired_t1": paired,
              "copy_workload": copy_workload}  # fmt: skip
    print(markdown(result))
    print(json.dumps(result["best_gamma"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
