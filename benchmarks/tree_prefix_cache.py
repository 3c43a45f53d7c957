"""What the persistent engine's prefix cache saves tree search (issue 14, item 2).

    python benchmarks/tree_prefix_cache.py [--problems 20] [--n 16] [--seeds 1] [--json]

Runs `decodekit eval arith`'s tree part (meta/evaluate.py `evaluate_tree`: step beam, DVTS
and REBASE with the learned `arith-prm`, width 4, all problems in lockstep) at one N, one
thread, and reports per strategy: accuracy, wall time, and prompt tokens per problem, both
as the engine computed them (every engine's scheduler, counted by wrapping
`Scheduler._admit`, so the same script measures the code before the change, where each
`generate` call built its own engine) and as the budget reports them. Run it on the code
before and after (PYTHONPATH) with the same arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from decodekit.engine import scheduler as scheduler_module
from decodekit.meta.evaluate import EvalConfig, arith_scorers, eval_problems, evaluate_tree
from decodekit.meta.generator import LocalGenerator
from decodekit.models.registry import load_model

try:
    from decodekit.engine.engine import forget_engine
except ImportError:  # the code before the persistent engine: an engine per call
    forget_engine = None

COMPUTED = {"prefill_tokens": 0, "cached_tokens": 0}


def count_admissions() -> None:
    """Add every scheduler's newly computed and cached prompt tokens to COMPUTED."""
    admit = scheduler_module.Scheduler._admit

    def counted(self, step):
        before = self.prefill_tokens, self.cached_tokens
        admit(self, step)
        COMPUTED["prefill_tokens"] += self.prefill_tokens - before[0]
        COMPUTED["cached_tokens"] += self.cached_tokens - before[1]

    scheduler_module.Scheduler._admit = counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=20)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    count_admissions()
    strategies = ("beam-prm", "dvts-prm", "rebase-prm")
    config = EvalConfig(strategies=strategies, ns=(args.n,), seeds=args.seeds, problems=args.problems)
    model = load_model(config.model)
    scorers = arith_scorers(config)
    problems = eval_problems(config.problems)
    rows = []
    for seed in range(args.seeds):
        for strategy in strategies:
            one = EvalConfig(strategies=(strategy,), ns=(args.n,), problems=args.problems)
            if forget_engine is not None:  # each strategy starts with an empty prefix cache
                forget_engine(model)
            before = dict(COMPUTED)
            start = time.perf_counter()
            [row] = evaluate_tree(LocalGenerator(model), problems, scorers, one, seed)
            row["wall_seconds"] = time.perf_counter() - start
            for key in COMPUTED:
                row[f"engine_{key}_per_problem"] = (COMPUTED[key] - before[key]) / len(problems)
            rows.append(row)
            if not args.json:
                print(json.dumps(row), flush=True)
    summary = {}
    for strategy in strategies:
        mine = [r for r in rows if r["strategy"] == strategy]
        summary[strategy] = {
            key: statistics.fmean(r[key] for r in mine)
            for key in ("accuracy", "wall_seconds", "engine_prefill_tokens_per_problem",
                        "engine_cached_tokens_per_problem", "prompt_tokens", "generated_tokens")
        }  # fmt: skip
    report = {"n": args.n, "problems": args.problems, "seeds": args.seeds, "threads": 1,
              "load_average": os.getloadavg(), "rows": rows, "summary": summary}  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
