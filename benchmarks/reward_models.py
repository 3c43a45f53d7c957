"""What scoring on the engine buys (issue 28): tree search with a PRM, best-of-N with an ORM.

    python benchmarks/reward_models.py [--problems 50] [--n 16] [--bon-problems 100] [--json]

1. Tree search (`decodekit eval arith`'s tree part, meta/evaluate.py `evaluate_tree`: step
   beam, DVTS, REBASE, N = `--n`, width 4, all problems in lockstep, seed 0) with three PRMs:
   - "probe": today's `arith-prm`, a ProbeRewardModel whose policy runs through
     transformers over every path, whole;
   - "hf, transformers": the token-classification PRM `arith-hf-prm`
     (scripts/build_arith_reward_models.py) through transformers, every path whole;
   - "hf, engine": the same PRM on decodekit's engine (reward_engine.py).
   Per run: wall time, the PRM's share of it (its calls timed), reward-model tokens
   computed per problem against those a whole-path forward per node computes, accuracy.
2. Best-of-N (`--bon-n` samples of `--bon-problems` problems, sampled once) scored by the
   ORMs: the probe `arith-orm` through transformers, `arith-hf-orm` through transformers,
   and on the engine; candidates scored per second, each scorer over all candidates in one
   call, and whether best-of-N picks the same answers; with the bare prompts and with
   `--shots` solved problems before each (a prompt of about 140 tokens the candidates share).
   "probe, from generation": the probe reading the log-probs and entropies the sampling
   computed (meta/rewards.py; the policy is `arith` itself), no forward; the sampling is
   timed with and without `SamplingParams.entropies` (what recording them costs).

Each run loads its reward model afresh (an empty prefix cache) and the policy's engine is
dropped between runs. One torch thread; wall and CPU time (the process's: on a shared
machine the steadier of the two).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from decodekit.engine.engine import forget_engine
from decodekit.meta.evaluate import EvalConfig, eval_problems, evaluate_tree, sample_parallel
from decodekit.meta.generator import LocalGenerator
from decodekit.meta.rewards import load_reward_model
from decodekit.meta.tasks.arith import (
    DELIMITER,
    extract_answer,
    format_prompt,
    format_solution,
    generate_problems,
)
from decodekit.models.registry import load_model

SCORERS = (("probe", "arith-{}", None), ("hf, transformers", "arith-hf-{}", False),
           ("hf, engine", "arith-hf-{}", True))  # fmt: skip


class Timed:
    """A batched arith PRM (meta/evaluate.py `arith_scorers`'s shape) whose calls are timed."""

    def __init__(self, model, whole: bool):
        self.model, self.whole, self.seconds, self.cpu_seconds = model, whole, 0.0, 0.0
        self.score_kind = model.score_kind

    def __call__(self, items):
        start, cpu = time.perf_counter(), time.process_time()
        segments = [[s.strip() + DELIMITER] if self.whole else [t.strip() + DELIMITER for t in s]
                    for _, s in items]
        scores = self.model.score_batch([(format_prompt(q), seg) for (q, _), seg in zip(items, segments)])
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu
        return [s[0] for s in scores] if self.whole else scores


def counters(model) -> tuple[int, int]:
    """(tokens computed, tokens a whole-path forward per item computes); probes: whole paths."""
    scorer = getattr(model, "scorer", None)
    if scorer is None:
        return 0, 0
    return scorer.tokens_computed, scorer.tokens_scored


def tree(policy, problems, n: int) -> list[dict]:
    rows = []
    for method in ("beam", "dvts", "rebase"):
        for label, name, native in SCORERS:
            model = load_reward_model(name.format("prm"), native=native)
            prm = Timed(model, whole=False)
            forget_engine(policy)
            config = EvalConfig(strategies=(f"{method}-prm",), ns=(n,), problems=len(problems))
            start, cpu = time.perf_counter(), time.process_time()
            [row] = evaluate_tree(LocalGenerator(policy), problems, {"prm": prm}, config, 0)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            computed, whole = counters(model)
            rows.append({"method": method, "prm": label, "accuracy": row["accuracy"], "wall_seconds": wall,
                         "prm_seconds": prm.seconds, "prm_share": prm.seconds / wall, "cpu_seconds": cpu,
                         "prm_cpu_seconds": prm.cpu_seconds, "prm_cpu_share": prm.cpu_seconds / cpu,
                         "rm_tokens_computed_per_problem": computed / len(problems),
                         "rm_tokens_whole_paths_per_problem": whole / len(problems)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def wide_prm(path) -> str:
    """A random token-classification PRM with a wider body than arith's (hidden 512, 8 layers,
    8 heads / 2 KV heads, FFN 1,536: 20 M parameters) on arith's tokenizer: the shape where
    scoring is arithmetic rather than per-call overhead. Its scores mean nothing; its cost does."""
    import shutil

    from transformers import Qwen2Config, Qwen2ForTokenClassification

    from decodekit.models.registry import ASSETS

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=37, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         num_labels=2, pad_token_id=0)
    Qwen2ForTokenClassification(config).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / "arith" / name, path / name)
    return str(path)


def tree_wide(policy, problems, n: int, path: str) -> list[dict]:
    """Step beam search with the wide PRM, through transformers and on the engine."""
    rows = []
    for label, native in (("wide, transformers", False), ("wide, engine", True)):
        model = load_reward_model(path, native=native)
        prm = Timed(model, whole=False)
        forget_engine(policy)
        config = EvalConfig(strategies=("beam-prm",), ns=(n,), problems=len(problems))
        start, cpu = time.perf_counter(), time.process_time()
        [row] = evaluate_tree(LocalGenerator(policy), problems, {"prm": prm}, config, 0)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        computed, whole = counters(model)
        rows.append({"method": "beam", "prm": label, "problems": len(problems), "accuracy": row["accuracy"],
                     "wall_seconds": wall, "prm_seconds": prm.seconds, "prm_share": prm.seconds / wall,
                     "cpu_seconds": cpu, "prm_cpu_seconds": prm.cpu_seconds,
                     "prm_cpu_share": prm.cpu_seconds / cpu,
                     "rm_tokens_computed_per_problem": computed / len(problems),
                     "rm_tokens_whole_paths_per_problem": whole / len(problems)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def few_shot(shots: int) -> str:
    """`shots` solved problems, each ending in EOS (benchmarks/meta_prefix_sharing.py's prefix)."""
    examples = generate_problems(shots, seed=99)
    return "".join(format_prompt(p) + format_solution(p) + "<|endoftext|>" for p in examples)


def best_of_n(policy, problems, n: int, shots: int = 0) -> list[dict]:
    """Best-of-n of each problem scored by each ORM, the reward model's prompt the policy's
    (`shots` solved problems first); every candidate in one `score_batch` call."""
    config = EvalConfig(problems=len(problems))
    prompts = [few_shot(shots) + format_prompt(p) for p in problems]
    sampling = {}
    for entropies in (False, True):  # the same seeds: the same samples, with or without entropies
        forget_engine(policy)
        start, cpu = time.perf_counter(), time.process_time()
        samples = sample_parallel(LocalGenerator(policy), prompts, n, config, 0, entropies=entropies)
        sampling[entropies] = (time.perf_counter() - start, time.process_time() - cpu)
    completions = [c for cs in samples for c in cs]
    items = [(prompt, [c.text.strip() + DELIMITER]) for prompt, cs in zip(prompts, samples) for c in cs]
    rows, picks = [], {}
    for label, name, native in (*SCORERS, ("probe, from generation", "arith-{}", None)):
        model = load_reward_model(name.format("orm"), native=native)
        reuse = {"completions": completions, "model": policy} if label.endswith("generation") else {}
        start, cpu = time.perf_counter(), time.process_time()
        scores = [s[0] for s in model.score_batch(items, **reuse)]
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        chosen = [max(range(n), key=scores[i * n : (i + 1) * n].__getitem__) for i in range(len(problems))]
        picks[label] = [extract_answer(samples[i][c].text) for i, c in enumerate(chosen)]
        accuracy = statistics.fmean(a == p.answer for a, p in zip(picks[label], problems))
        computed, whole = counters(model)
        rows.append({"orm": label, "shots": shots, "candidates": len(items), "seconds": seconds,
                     "candidates_per_second": len(items) / seconds, "cpu_seconds": cpu,
                     "candidates_per_cpu_second": len(items) / cpu, "accuracy": accuracy,
                     "rm_tokens_computed": computed, "rm_tokens_whole": whole,
                     "reused": getattr(model, "reused", 0)})
        print(json.dumps(rows[-1]), flush=True)
    same = picks["hf, engine"] == picks["hf, transformers"]
    reused_same = picks["probe, from generation"] == picks["probe"]
    return rows + [{"shots": shots, "engine_picks_equal_transformers": same,
                    "probe_from_generation_picks_equal_probe": reused_same,
                    "sampling_seconds": sampling[False][0], "sampling_cpu_seconds": sampling[False][1],
                    "sampling_with_entropies_seconds": sampling[True][0],
                    "sampling_with_entropies_cpu_seconds": sampling[True][1]}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=50, help="tree search problems")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--bon-problems", type=int, default=100)
    parser.add_argument("--bon-n", type=int, default=16)
    parser.add_argument("--shots", type=int, default=2, help="best-of-N: also with this many solved "
                        "problems before each prompt (0: only without)")
    parser.add_argument("--skip-tree", action="store_true")
    parser.add_argument("--wide-problems", type=int, default=0, help="also step beam search on this "
                        "many problems with a 20 M-parameter random PRM (`wide_prm`)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = load_model("arith")
    report = {"threads": 1, "n": args.n, "problems": args.problems,
              "tree": [] if args.skip_tree else tree(policy, eval_problems(args.problems), args.n),
              "best_of_n": [row for shots in sorted({0, args.shots}) for row in
                            best_of_n(policy, eval_problems(args.bon_problems), args.bon_n, shots)],
              "load_average": os.getloadavg()}  # fmt: skip
    if args.wide_problems:
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            path = wide_prm(Path(tmp) / "wide-prm")
            report["tree_wide"] = tree_wide(policy, eval_problems(args.wide_problems), args.n, path)
    if args.json:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
