"""Accuracy against compute on the embedded `arith` task (seed 001, "Scaling meta-generators").

For every strategy and budget N: accuracy (the chosen answer equals the true value) and
what it cost per problem (generated tokens, prompt tokens computed, reused, scorer calls).

- Parallel strategies sample once at the largest N per problem and seed; the curve at a
  smaller N averages over the largest N // N disjoint subsets of those samples (REFERENCES.md:
  "generate once at the largest N and subsample"). single = one sample; majority = self-
  consistency; bon-* = best-of-N; weighted-* = weighted vote.
- Tree strategies (beam, dvts, rebase) run at every N with N samples per depth, all problems
  in lockstep (`tree_search_batch`), final answer by a vote weighted by the last step score.
- Scorers: *-orm / *-prm are the learned reward models `arith-orm` / `arith-prm`; *-oracle
  are the exact checkers (check_answer, check_steps), the upper reference.
- calculator: one sample with a tool call between steps (`generate_with_tool`): the model
  writes each operation, a calculator writes its result (seed 001, "chain"); N = 1 only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from decodekit.meta.generator import LocalGenerator, derive_seed
from decodekit.meta.parallel import choose_best, vote
from decodekit.meta.result import Candidate
from decodekit.meta.tree import TreeConfig, tree_search_batch
from decodekit.params import SamplingParams
from decodekit.runtime import advance_to
from decodekit.runtime import progress as progress_bar

PARALLEL = ("single", "majority", "bon-orm", "weighted-orm", "bon-oracle", "weighted-oracle")
TREE = ("beam-prm", "dvts-prm", "rebase-prm", "beam-oracle", "dvts-oracle", "rebase-oracle")
CHAIN = ("calculator",)
STRATEGIES = PARALLEL + TREE + CHAIN
TASKS = ("arith",)

# The held-out problems of scripts/train_arith.py: its task distribution (the default
# ArithConfig: 2-4 operations on 1..20), its test stream, and no question of its training
# stream (200k problems from seed 1).
TRAIN_SEED, TRAIN_PROBLEMS, TEST_SEED = 1, 200_000, 4


@dataclass(frozen=True)
class EvalConfig:
    strategies: tuple[str, ...] = STRATEGIES
    ns: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    seeds: int = 3
    problems: int = 50
    temperature: float = 1.0
    max_new_tokens: int = 96  # a whole solution (parallel strategies)
    step_tokens: int = 24  # one step (tree search)
    width: int = 4
    tau: float = 0.2
    aggregate: str = "last"
    tree_final: str = "weighted_vote"
    tree_max_n: int | None = None  # tree search only up to this N (it is run at every N)
    model: str = "arith"
    orm: str = "arith-orm"
    prm: str = "arith-prm"
    rows: int = 512  # samples per generator call when sampling in parallel

    def __post_init__(self):
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
        if not self.ns or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.ns):
            raise ValueError(f"every N must be an integer >= 1, got {list(self.ns)}")
        for name in ("seeds", "problems", "max_new_tokens", "step_tokens", "rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        TreeConfig(width=self.width, aggregate=self.aggregate, final=self.tree_final, tau=self.tau)


def eval_problems(count: int):
    """`count` arith problems none of which `arith` was trained on."""
    from decodekit.meta.tasks.arith import ArithConfig, generate_problems

    task = ArithConfig()
    train = {p.question for p in generate_problems(TRAIN_PROBLEMS, TRAIN_SEED, task)}
    pool = generate_problems(4 * count + 100, TEST_SEED, task)
    return [p for p in pool if p.question not in train][:count]


def arith_scorers(config: EvalConfig) -> dict[str, Callable]:
    """Batched scorers: orm([(prompt, solution)]) -> [score], prm([(prompt, steps)]) ->
    [[score]]; a learned one carries its reward model's `score_kind` (meta/scorers.py)."""
    from decodekit.meta.rewards import load_reward_model
    from decodekit.meta.tasks.arith import DELIMITER, check_answer, check_steps, format_prompt

    def learned(name: str, whole: bool):
        scorer = load_reward_model(name)

        def score(items):  # the segments of arith.load_orm / load_prm, all in one call
            segments = [[s.strip() + DELIMITER] if whole else [t.strip() + DELIMITER for t in s]
                        for _, s in items]
            scores = scorer.score_batch([(format_prompt(q), seg) for (q, _), seg in zip(items, segments)])
            return [s[0] for s in scores] if whole else scores

        score.score_kind = scorer.score_kind
        return score

    scorers = {
        "orm-oracle": lambda items: [float(check_answer(q, s)) for q, s in items],
        "prm-oracle": lambda items: [[float(x) for x in check_steps(q, s)] for q, s in items],
    }
    if any(s.endswith("-orm") for s in config.strategies):
        scorers["orm"] = learned(config.orm, whole=True)
    if any(s.endswith("-prm") for s in config.strategies):
        scorers["prm"] = learned(config.prm, whole=False)
    return scorers


def sample_parallel(generator, prompts: list[str], n: int, config: EvalConfig, seed: int,
                    entropies: bool = False, on_progress: Callable[[float], None] | None = None):
    """n completions per prompt, each prompt its own seed, `config.rows` samples per call
    (entropies: SamplingParams.entropies, what a probe of the policy reads); `on_progress`:
    the share of the prompts done, after each call."""
    params = SamplingParams(temperature=config.temperature, max_new_tokens=config.max_new_tokens,
                            entropies=entropies)
    per_call = max(1, config.rows // n)
    results = []
    for start in range(0, len(prompts), per_call):
        chunk = range(start, min(start + per_call, len(prompts)))
        seeded = [params.replace(seed=derive_seed(seed, "sample", i)) for i in chunk]
        results += generator.generate([prompts[i] for i in chunk], n, seeded)
        if on_progress is not None:
            on_progress(len(results) / len(prompts))
    return results


def parallel_point(strategy: str, candidates: list[Candidate], truth, score_kind: str | None = None) -> bool:
    """Is the strategy's answer on this candidate set right? (scores: see `evaluate_parallel`;
    score_kind: the scorer's, for a weighted vote: meta/scorers.py)"""
    if strategy in ("single", "majority"):
        return vote(candidates)[0] == truth
    if strategy.startswith("bon-"):
        chosen = choose_best(candidates)
        return chosen is not None and chosen.answer == truth
    return vote(candidates, weighted=True, score_kind=score_kind)[0] == truth


def subset_curve(strategy: str, problems: list[list[Candidate]], truths: list, tokens: list[list[int]],
                 n: int, score_kind: str | None = None) -> tuple[float, float]:
    """(accuracy, generated tokens per problem) at N = n, averaged over the disjoint n-subsets."""
    accuracy, spent = [], []
    for candidates, truth, counts in zip(problems, truths, tokens):
        chunks = range(0, len(candidates) - n + 1, n)
        accuracy.append(statistics.fmean(parallel_point(strategy, candidates[c : c + n], truth, score_kind)
                                         for c in chunks))
        spent.append(statistics.fmean(sum(counts[c : c + n]) for c in chunks))
    return statistics.fmean(accuracy), statistics.fmean(spent)


def evaluate_parallel(generator, problems, scorers, config: EvalConfig, seed: int,
                      on_progress: Callable[[float], None] | None = None) -> list[dict]:
    """The parallel strategies' rows; `on_progress`: the share done (of the sampling, which
    is most of the time) after each generator call."""
    from decodekit.meta.tasks.arith import extract_answer, format_prompt

    strategies = [s for s in config.strategies if s in PARALLEL]
    if not strategies:
        return []
    prompts = [format_prompt(p) for p in problems]
    start = time.perf_counter()
    samples = sample_parallel(generator, prompts, max(config.ns), config, seed, on_progress=on_progress)
    sampled = time.perf_counter() - start
    texts = [(prompt, c.text) for prompt, cs in zip(prompts, samples) for c in cs]
    scores = {kind: scorers[kind](texts) for kind in ("orm", "orm-oracle") if kind in scorers}
    truths = [p.answer for p in problems]
    tokens = [[c.usage.completion_tokens for c in cs] for cs in samples]
    prompt_tokens = statistics.fmean(cs[0].usage.prompt_tokens for cs in samples)
    rows = []
    for strategy in strategies:
        kind = "orm" if strategy.endswith("-orm") else "orm-oracle"
        flat = iter(scores.get(kind, [None] * len(texts)))
        sets = [[Candidate(c.text, answer=extract_answer(c.text), score=next(flat)) for c in cs]
                for cs in samples]
        for n in [1] if strategy == "single" else config.ns:
            score_kind = getattr(scorers.get(kind), "score_kind", None)
            accuracy, spent = subset_curve(strategy, sets, truths, tokens, n, score_kind)
            scored = strategy not in ("single", "majority")
            rows.append({"strategy": strategy, "n": n, "seed": seed, "accuracy": accuracy,
                         "generated_tokens": spent, "prompt_tokens": prompt_tokens,
                         "reused_prefix_tokens": prompt_tokens * (n - 1), "scorer_calls": n * scored,
                         "seconds_to_sample_max_n": sampled})
    return rows


def evaluate_tree(generator, problems, scorers, config: EvalConfig, seed: int,
                  on_progress: Callable[[float], None] | None = None) -> list[dict]:
    """The tree strategies' rows; `on_progress`: the share done after each strategy and N,
    each weighted by its N (a search's work grows with its beams)."""
    from decodekit.meta.tasks.arith import extract_answer, format_prompt

    prompts = [format_prompt(p) for p in problems]
    truths = [p.answer for p in problems]
    tree = TreeConfig(width=config.width, aggregate=config.aggregate, final=config.tree_final,
                      tau=config.tau)
    runs = [(strategy, n) for strategy in config.strategies if strategy in TREE for n in config.ns
            if config.tree_max_n is None or n <= config.tree_max_n]
    work, done = sum(n for _, n in runs), 0
    rows = []
    for strategy, n in runs:
        method, kind = strategy.split("-")
        prm = scorers["prm" if kind == "prm" else "prm-oracle"]
        params = SamplingParams(temperature=config.temperature, max_new_tokens=config.step_tokens,
                                seed=derive_seed(seed, strategy, n))
        start = time.perf_counter()
        results = tree_search_batch(generator, prompts, prm, n, method, params, tree,
                                    extract=extract_answer, prm_kind="batch",
                                    is_final=lambda step: step.startswith("Answer"))
        row = {"strategy": strategy, "n": n, "seed": seed,
               "accuracy": statistics.fmean(r.answer == t for r, t in zip(results, truths)),
               "seconds": time.perf_counter() - start}
        for key in ("generated_tokens", "prompt_tokens", "reused_prefix_tokens", "scorer_calls"):
            row[key] = statistics.fmean(r.budget[key] for r in results)
        rows.append(row)
        done += n
        if on_progress is not None:
            on_progress(done / work)
    return rows


def evaluate_chain(generator, problems, scorers, config: EvalConfig, seed: int,
                   on_progress: Callable[[float], None] | None = None) -> list[dict]:
    """The calculator's row; `on_progress`: the share of the problems done, after each."""
    from decodekit.meta.pipeline import generate_with_tool
    from decodekit.meta.tasks.arith import check_answer, format_prompt

    if "calculator" not in config.strategies:
        return []
    params = SamplingParams(temperature=config.temperature, max_new_tokens=config.step_tokens)
    start = time.perf_counter()
    results = []
    for i, p in enumerate(problems):
        results.append(generate_with_tool(generator, format_prompt(p),
                                          params=params.replace(seed=derive_seed(seed, "calculator", i))))
        if on_progress is not None:
            on_progress(len(results) / len(problems))
    row = {"strategy": "calculator", "n": 1, "seed": seed,
           "accuracy": statistics.fmean(check_answer(p, r.text) for p, r in zip(problems, results)),
           "seconds": time.perf_counter() - start}
    for key in ("generated_tokens", "prompt_tokens", "reused_prefix_tokens", "tool_calls"):
        row[key] = statistics.fmean(r.budget[key] for r in results)
    return [row]


def summarize(rows: list[dict]) -> list[dict]:
    """Mean, min, max and standard deviation over seeds of each (strategy, N)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["strategy"], row["n"]), []).append(row)
    summary = []
    for (strategy, n), group in groups.items():
        acc = [r["accuracy"] for r in group]
        summary.append({
            "strategy": strategy, "n": n, "seeds": len(group), "accuracy": statistics.fmean(acc),
            "accuracy_min": min(acc), "accuracy_max": max(acc),
            "accuracy_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "generated_tokens": statistics.fmean(r["generated_tokens"] for r in group),
        })
    return summary


def evaluate_arith(config: EvalConfig, generator=None, scorers: dict | None = None, problems=None,
                   progress: bool = False, desc: str = "eval arith") -> dict:
    """Run the configured strategies; returns {"config", "problems", "rows", "summary"}.
    generator, scorers (as `arith_scorers` returns) and problems default to the embedded
    model, its reward models and `eval_problems(config.problems)`. `progress` shows a bar
    on stderr (named `desc`) over seeds x parts (parallel, tree, chain), moving within each
    part (issue 35), each part's time beside it."""
    if generator is None:
        from decodekit.models.registry import load_model

        generator = LocalGenerator(load_model(config.model))
    scorers = scorers if scorers is not None else arith_scorers(config)
    problems = problems if problems is not None else eval_problems(config.problems)
    rows = []
    parts = (evaluate_parallel, evaluate_tree, evaluate_chain)
    with progress_bar(total=config.seeds * len(parts), desc=desc, enabled=progress) as bar:
        for seed in range(config.seeds):
            for i, part in enumerate(parts):
                start, finished = time.perf_counter(), seed * len(parts) + i
                rows += part(generator, problems, scorers, config, seed,
                             on_progress=lambda share, at=finished: advance_to(bar, at + share))
                bar.set_postfix_str(f"seed {seed}: {part.__name__} in {time.perf_counter() - start:.1f} s",
                                    refresh=False)
                advance_to(bar, finished + 1)
    return {"config": asdict(config), "problems": len(problems), "rows": rows, "summary": summarize(rows)}


def plot(report: dict, path: str) -> None:
    """Accuracy against generated tokens per problem: a line per strategy, a min-max band over
    seeds; oracle scorers dashed, in the colour of their learned counterpart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"single": "black", "calculator": "tab:brown", "majority": "tab:gray", "bon": "tab:red",
              "weighted": "tab:orange", "beam": "tab:blue", "dvts": "tab:green", "rebase": "tab:purple"}
    fig, ax = plt.subplots(figsize=(10, 5.5))
    strategies = dict.fromkeys(r["strategy"] for r in report["summary"])
    for strategy in strategies:
        points = sorted((r for r in report["summary"] if r["strategy"] == strategy), key=lambda r: r["n"])
        x = [r["generated_tokens"] for r in points]
        style = dict(color=colors[strategy.split("-")[0]], linestyle="--" if "oracle" in strategy else "-")
        ax.plot(x, [r["accuracy"] for r in points], marker="o", markersize=3 if len(points) > 1 else 7,
                label=strategy, **style)
        ax.fill_between(x, [r["accuracy_min"] for r in points], [r["accuracy_max"] for r in points],
                        color=style["color"], alpha=0.12, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("generated tokens per problem")
    ax.set_ylabel("accuracy")
    config = report["config"]
    ax.set_title(f"arith: {report['problems']} problems, {config['seeds']} seeds, N = "
                 f"{', '.join(map(str, config['ns']))}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(report: dict) -> str:
    """The summary as text: one row per strategy, accuracy (tokens) per N."""
    ns = sorted({r["n"] for r in report["summary"]})
    lines = [f"{'strategy':<16}" + "".join(f"{'N=' + str(n):>16}" for n in ns)]
    for strategy in dict.fromkeys(r["strategy"] for r in report["summary"]):
        cells = {r["n"]: r for r in report["summary"] if r["strategy"] == strategy}
        lines.append(f"{strategy:<16}" + "".join(
            f"{cells[n]['accuracy']:>8.3f} ({cells[n]['generated_tokens']:>5.0f})" if n in cells
            else f"{'':>16}" for n in ns))
    return "\n".join(lines)
