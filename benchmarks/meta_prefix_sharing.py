"""What sharing a prompt's prefill saves meta-generators (issue 7, "Measurements").

    python benchmarks/meta_prefix_sharing.py [--model arith] [--problems 8] [--n 16]
                                             [--shots 0] [--repeats 3] [--json]

Times best-of-N and step-level beam search (N beams, width 4, the exact step checker as
PRM so that scoring costs nothing) on held-out arith problems through `LocalGenerator` in
three modes: "shared" (each request's prompt prefilled once, its KV forked into the n
samples), "replicated" (n copies of the prompt in one batch, each prefilled) and "separate"
(one generate call per sample). `--shots K` prepends K solved problems (each ending in EOS,
as in training) to every prompt, so prompts are long and the prefill matters. Modes are
interleaved across repeats; the median wall time is reported with the tokens each spent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from decodekit.meta.evaluate import eval_problems
from decodekit.meta.generator import PREFIX_MODES, LocalGenerator
from decodekit.meta.parallel import best_of_n
from decodekit.meta.tasks.arith import (
    check_steps,
    format_prompt,
    format_solution,
    generate_problems,
)
from decodekit.meta.tree import TreeConfig, tree_search
from decodekit.models.registry import load_model
from decodekit.params import SamplingParams

EOS = "<|endoftext|>"


def prompts_for(problems, shots: int) -> list[str]:
    examples = generate_problems(shots, seed=99)
    prefix = "".join(format_prompt(p) + format_solution(p) + EOS for p in examples)
    return [prefix + format_prompt(p) for p in problems]


def run_once(model, mode: str, prompts: list[str], n: int, seed: int) -> dict:
    out = {}
    gen = LocalGenerator(model, prefix=mode)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        best_of_n(gen, prompt, n, len, SamplingParams(max_new_tokens=96, seed=seed + i))
    out["best_of_n"] = {"seconds": time.perf_counter() - start, **gen.budget.counts()}
    gen = LocalGenerator(model, prefix=mode)

    def oracle(question, steps):
        return [float(x) for x in check_steps(question.rsplit(EOS, 1)[-1], steps)]

    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        tree_search(gen, prompt, oracle, n, "beam", SamplingParams(max_new_tokens=24, seed=seed + i),
                    TreeConfig(width=4), is_final=lambda step: step.startswith("Answer"))
    out["beam_search"] = {"seconds": time.perf_counter() - start, **gen.budget.counts()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="arith")
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--shots", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the one place threading is set
    model = load_model(args.model)
    prompts = prompts_for(eval_problems(args.problems), args.shots)
    runs: dict[str, list[dict]] = {mode: [] for mode in PREFIX_MODES}
    for repeat in range(args.repeats):
        for mode in PREFIX_MODES if repeat % 2 == 0 else PREFIX_MODES[::-1]:
            runs[mode].append(run_once(model, mode, prompts, args.n, seed=1000 * repeat))
    report = {"model": args.model, "problems": args.problems, "n": args.n, "shots": args.shots,
              "prompt_tokens_each": len(model.encode(prompts[0])), "repeats": args.repeats,
              "threads": args.threads, "results": {}}
    for mode, mode_runs in runs.items():
        for task in ("best_of_n", "beam_search"):
            seconds = statistics.median(r[task]["seconds"] for r in mode_runs)
            counts = {k: statistics.fmean(r[task][k] for r in mode_runs) for k in mode_runs[0][task]
                      if k != "seconds"}
            report["results"].setdefault(task, {})[mode] = {"seconds": seconds, **counts}
    for modes in report["results"].values():
        for row in modes.values():
            row["time_vs_shared"] = row["seconds"] / modes["shared"]["seconds"]
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{args.problems} problems, N = {args.n}, prompt {report['prompt_tokens_each']} tokens")
    print(f"{'task':<12} {'mode':<11} {'seconds':>8} {'x shared':>8} {'prompt tok':>10} "
          f"{'reused':>8} {'generated':>9} {'calls':>6}")
    for task, modes in report["results"].items():
        for mode, row in modes.items():
            print(f"{task:<12} {mode:<11} {row['seconds']:>8.2f} {row['time_vs_shared']:>8.2f} "
                  f"{row['prompt_tokens']:>10.0f} {row['reused_prefix_tokens']:>8.0f} "
                  f"{row['generated_tokens']:>9.0f} {row['generator_calls']:>6.0f}")


if __name__ == "__main__":
    main()
