"""The cost of NativeLM's batch-invariant mode: generation tok/s with and without it.

    python -m decodekit.bench.batch_invariant [model] [--threads 1]   # prints JSON

Scenarios, each run by `decodekit.generate` (the paged engine) on the same weights:
- `single`: one request, greedy, `new_tokens` new tokens (EOS ignored);
- `batch`: `batch` requests of different prompt lengths, sampled (temperature 1, seeded),
  submitted together.
Each figure is the median over `repeats` runs after one warm-up, the two modes
alternating so that both see the same load; CPU time of this process is reported beside
wall time (what an oversubscribed machine distorts least with one thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

PROMPT = "ROMEO: But soft, what light through yonder window breaks? It is the east"


def _timed(fn) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def bench_batch_invariant(
    model_name: str = "shakespeare", new_tokens: int = 64, batch: int = 8, repeats: int = 3
) -> dict:
    """tok/s (wall and CPU) of each scenario in the default and the batch-invariant mode."""
    import decodekit as dk
    from decodekit.models.native import NativeLM

    base = dk.load_model(model_name)
    if not isinstance(base, NativeLM):
        raise ValueError(f"the batch-invariant mode is NativeLM's; {model_name!r} is not one")
    models = {mode: NativeLM(base.net, base.config, base.name, base.tokenizer,
                             base.eos_token_ids, batch_invariant=mode == "batch_invariant")
              for mode in ("default", "batch_invariant")}  # fmt: skip
    words = PROMPT.split()
    prompts = [" ".join(words[: 2 + (3 * i) % len(words)]) for i in range(batch)]
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    sampled = [greedy.replace(temperature=1.0, seed=i) for i in range(batch)]
    scenarios = {"single": ([PROMPT], [greedy]), "batch": (prompts, sampled)}
    report: dict = {"model": model_name, "threads": torch.get_num_threads(),
                    "new_tokens": new_tokens, "batch_size": batch, "repeats": repeats}  # fmt: skip
    for scenario, (scenario_prompts, params) in scenarios.items():
        tokens = new_tokens * len(scenario_prompts)
        runs: dict[str, list[dict]] = {mode: [] for mode in models}
        for attempt in range(repeats + 1):
            for mode, model in models.items():
                timing = _timed(lambda m=model, x=scenario_prompts, p=params: dk.generate(m, x, p))
                if attempt:  # the first is a warm-up
                    runs[mode].append(timing)
        result = {}
        for mode, timings in runs.items():
            wall = statistics.median(t["wall_s"] for t in timings)
            cpu = statistics.median(t["cpu_s"] for t in timings)
            result[mode] = {"tok_per_s_wall": tokens / wall, "tok_per_s_cpu": tokens / cpu}
        result["slowdown_cpu"] = (result["default"]["tok_per_s_cpu"]
                                  / result["batch_invariant"]["tok_per_s_cpu"])  # fmt: skip
        report[scenario] = result
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="shakespeare")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = bench_batch_invariant(args.model, args.new_tokens, args.batch, args.repeats)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
