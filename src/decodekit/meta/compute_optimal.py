"""Accuracy against inference FLOPs across model sizes (seed 001: "smaller models can be
compute optimal", Wu et al. 2024b, Inference Scaling Laws).

Each model runs `evaluate_arith` (meta/evaluate.py) on the same problems with its own
reward models; every (model, strategy, N) point then costs

    FLOPs per problem = 2 x parameters x (prompt tokens + generated tokens)

(the usual 2N FLOPs per token of a forward pass; Wu et al.'s cost(N, T, S)). The prompt
counts once per problem, its length in the model's tokens: every strategy here prefills it
once and shares its KV among its N samples or tree nodes. The tokens the engine actually
recomputed are kept beside it ("prompt_tokens_computed": budget.py's `prompt_tokens`, which
depends on what the persistent engine's prefix cache held from the run before, and in tree
search adds one delimiter token per expanded node). The reward models are not counted: they
are probes over the policy's own log-probs and entropies of the tokens it sampled, which a
sampler has in hand when it draws them (meta/rewards.py runs a second forward only for
convenience).

The compute-optimal frontier is the upper envelope of accuracy against FLOPs over every
model, strategy and N: at a budget B, the best accuracy any point costing at most B reaches.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, replace

from decodekit.meta.evaluate import EvalConfig, eval_problems, evaluate_arith

STRATEGIES = ("majority", "weighted-orm", "rebase-prm")  # the three meta-generators
NS = (1, 2, 4, 8, 16, 32, 64)


def inference_flops(parameters: int, prompt_tokens: float, generated_tokens: float) -> float:
    """2 x parameters x tokens, prompt included (Kaplan et al. 2020's forward-pass FLOPs)."""
    return 2.0 * parameters * (prompt_tokens + generated_tokens)


def reward_names(model: str) -> tuple[str, str]:
    """The ORM and PRM paired with a policy by name: `M-orm`, `M-prm` (registry names, or
    sibling directories of a checkpoint directory M)."""
    stem = str(model).rstrip("/")
    return f"{stem}-orm", f"{stem}-prm"


def size_points(summary: list[dict], rows: list[dict], parameters: int,
                prompt_tokens: float) -> list[dict]:
    """The summary of one model's report with its FLOPs, for prompts of `prompt_tokens`
    tokens on average, and the prompt tokens the engine computed (mean over seeds, rows)."""
    points = []
    for entry in summary:
        group = [r for r in rows if r["strategy"] == entry["strategy"] and r["n"] == entry["n"]]
        points.append({**entry, "prompt_tokens": prompt_tokens,
                       "prompt_tokens_computed": statistics.fmean(r["prompt_tokens"] for r in group),
                       "flops": inference_flops(parameters, prompt_tokens, entry["generated_tokens"])})
    return points


def frontier(points: list[dict]) -> list[dict]:
    """The points no cheaper-or-equal point matches in accuracy, cheapest first: the upper
    envelope of accuracy against FLOPs (each point carries its "model")."""
    best, out = -math.inf, []
    for point in sorted(points, key=lambda p: (p["flops"], -p["accuracy"])):
        if point["accuracy"] > best:
            best = point["accuracy"]
            out.append(point)
    return out


def budget_winners(points: list[dict], per_decade: int = 2) -> list[dict]:
    """At budgets 10^(k / per_decade) FLOPs from the cheapest point to the dearest: which
    model and strategy reach the best accuracy within the budget, and each model's best."""
    low, high = min(p["flops"] for p in points), max(p["flops"] for p in points)
    first, last = math.ceil(per_decade * math.log10(low)), math.ceil(per_decade * math.log10(high))
    models = list(dict.fromkeys(p["model"] for p in points))
    out = []
    for k in range(first, last + 1):
        budget = 10 ** (k / per_decade)
        within = [p for p in points if p["flops"] <= budget]
        best = max(within, key=lambda p: (p["accuracy"], -p["flops"]))
        per_model = {}
        for model in models:
            mine = [p for p in within if p["model"] == model]
            per_model[model] = max((p["accuracy"] for p in mine), default=None)
        out.append({"budget_flops": budget, "model": best["model"], "strategy": best["strategy"],
                    "n": best["n"], "accuracy": best["accuracy"], "best_per_model": per_model})
    return out


def evaluate_size(config: EvalConfig, model: str, orm: str, prm: str, problems,
                  progress: bool = False) -> dict:
    """One model's points: `evaluate_arith` with its own reward models, FLOPs per point;
    `progress`: evaluate_arith's, named after the model."""
    from decodekit.meta.generator import LocalGenerator
    from decodekit.meta.tasks.arith import format_prompt
    from decodekit.models.registry import load_model

    lm = load_model(model)
    parameters = lm.num_parameters()
    prompt_tokens = statistics.fmean(len(lm.encode(format_prompt(p))) for p in problems)
    report = evaluate_arith(replace(config, model=model, orm=orm, prm=prm),
                            generator=LocalGenerator(lm), problems=problems, progress=progress,
                            desc=f"eval arith {model}")
    points = [{**p, "model": model}
              for p in size_points(report["summary"], report["rows"], parameters, prompt_tokens)]
    return {"model": model, "orm": orm, "prm": prm, "parameters": parameters, "points": points}


def compare_sizes(config: EvalConfig, sizes: list[dict], problems: int) -> dict:
    """The report over `evaluate_size` results (same config and problems): {"config",
    "problems", "models", "frontier", "budgets" (the best of every point within each budget),
    "budgets_by_strategy" (the seed's question 1: strategy fixed, which size is best within
    each budget)}."""
    points = [p for size in sizes for p in size["points"]]
    by_strategy = {s: budget_winners([p for p in points if p["strategy"] == s])
                   for s in dict.fromkeys(p["strategy"] for p in points)}
    return {"config": asdict(config), "problems": problems, "models": sizes,
            "frontier": frontier(points), "budgets": budget_winners(points),
            "budgets_by_strategy": by_strategy}


def evaluate_sizes(config: EvalConfig, models: Sequence[tuple[str, str, str]],
                   problems=None, progress: bool = False) -> dict:
    """`evaluate_size` for each (model, orm, prm) on the same problems, then `compare_sizes`;
    `progress` shows each model's progress in turn."""
    if not models:
        raise ValueError("evaluate_sizes needs at least one (model, orm, prm)")
    problems = problems if problems is not None else eval_problems(config.problems)
    sizes = []
    for model, orm, prm in models:
        sizes.append(evaluate_size(config, model, orm, prm, problems, progress))
    return compare_sizes(config, sizes, len(problems))


def plot_sizes(report: dict, path: str) -> None:
    """Accuracy against FLOPs per problem (log scale): a colour per model, a line style per
    strategy, the compute-optimal frontier as a wide green band beneath (the seed's figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"majority": ":", "weighted-orm": "--", "rebase-prm": "-"}
    markers = {"majority": "s", "weighted-orm": "^", "rebase-prm": "o"}
    colors = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(10, 5.5))
    edge = report["frontier"]
    ax.step([p["flops"] for p in edge], [p["accuracy"] for p in edge], where="post",
            color="tab:green", linewidth=7, alpha=0.25, label="compute-optimal frontier")
    count = len(report["models"])
    for i, size in enumerate(report["models"]):
        color = colors(0.85 * i / max(1, count - 1))
        for strategy in dict.fromkeys(p["strategy"] for p in size["points"]):
            line = sorted((p for p in size["points"] if p["strategy"] == strategy), key=lambda p: p["n"])
            ax.plot([p["flops"] for p in line], [p["accuracy"] for p in line], color=color,
                    linestyle=styles.get(strategy, "-."), marker=markers.get(strategy, "x"),
                    markersize=4, label=f"{size['model']} ({size['parameters'] / 1e3:,.0f}k), {strategy}")
    ax.set_xscale("log")
    ax.set_xlabel("inference FLOPs per problem (2 x parameters x tokens, prompt included)")
    ax.set_ylabel("accuracy")
    ns = ", ".join(map(str, report["config"]["ns"]))
    ax.set_title(f"arith: {report['problems']} problems, {report['config']['seeds']} seeds, N = {ns}")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table_sizes(report: dict) -> str:
    """Accuracy (FLOPs) per model, strategy and N, then the winner at each budget."""
    ns = sorted({p["n"] for size in report["models"] for p in size["points"]})
    lines = [f"{'model, strategy':<36}" + "".join(f"{'N=' + str(n):>18}" for n in ns)]
    for size in report["models"]:
        for strategy in dict.fromkeys(p["strategy"] for p in size["points"]):
            cells = {p["n"]: p for p in size["points"] if p["strategy"] == strategy}
            lines.append(f"{size['model'] + ', ' + strategy:<36}" + "".join(
                f"{cells[n]['accuracy']:>8.3f} ({cells[n]['flops']:>7.1e})" if n in cells
                else f"{'':>18}" for n in ns))
    sections = [("any strategy", report["budgets"])] + list(report["budgets_by_strategy"].items())
    for title, budgets in sections:
        lines += ["", f"best within each budget, {title} (compute-optimal)"]
        for row in budgets:
            lines.append(f"  <= {row['budget_flops']:.1e} FLOPs: {row['model']}, {row['strategy']} "
                         f"N={row['n']} ({row['accuracy']:.3f})")
    return "\n".join(lines)
