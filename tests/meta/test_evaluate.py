"""The arith evaluation: subsampled curves by hand, batched reward scoring, a small end-to-end
run on a character k-gram model of arith solutions, the plot and the CLI's errors."""

from __future__ import annotations

import pytest
import torch

from decodekit.cli import main
from decodekit.meta.evaluate import (
    EvalConfig,
    arith_scorers,
    evaluate_arith,
    plot,
    subset_curve,
    table,
)
from decodekit.meta.generator import LocalGenerator
from decodekit.meta.result import Candidate
from decodekit.meta.tasks.arith import ArithConfig, format_prompt, format_solution, generate_problems
from decodekit.models.ngram import NGramConfig, train_ngram


def test_subset_curve_averages_disjoint_subsets():
    answers, scores = [1, 2, 2, 1], [0.1, 0.9, 0.2, 0.3]
    candidates = [[Candidate(f"y{i}", answer=a, score=s) for i, (a, s) in enumerate(zip(answers, scores))]]
    tokens = [[10, 20, 30, 40]]
    # N = 1: each sample alone, 2 of 4 right; tokens 25 on average
    assert subset_curve("single", candidates, [1], tokens, 1) == (0.5, 25.0)
    # N = 2: subsets {1, 2} (tie, first occurrence wins: 1, right) and {2, 1} (2, wrong)
    assert subset_curve("majority", candidates, [1], tokens, 2) == (0.5, 50.0)
    # best-of-2 by score: 0.9 -> answer 2 (wrong), 0.3 -> answer 1 (right)
    assert subset_curve("bon-orm", candidates, [1], tokens, 2)[0] == 0.5
    # N = 4: weighted vote 1: 0.4, 2: 1.1 -> 2, wrong; majority 2 vs 2 -> 1, right
    assert subset_curve("weighted-orm", candidates, [1], tokens, 4) == (0.0, 100.0)
    assert subset_curve("majority", candidates, [1], tokens, 4)[0] == 1.0
    # N = 3 uses the one full subset {0, 1, 2}: majority 2
    assert subset_curve("majority", candidates, [1], tokens, 3) == (0.0, 60.0)


def test_batched_reward_scores_match_one_at_a_time(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decodekit.meta.rewards import FEATURES, ProbeRewardModel

    policy = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    probe = {"features": list(FEATURES), "mean": [-3.0] * 6, "std": [2.0] * 6,
             "weights": [0.5, -0.2, 0.3, 0.1, 0.4, -0.6], "bias": 0.1}
    scorer = ProbeRewardModel(policy, tokenizer, probe)
    items = [("ROMEO: ", ["But soft", " what light"]), ("JULIET:", ["O"]),
             ("The quick brown fox", [" jumps", " over the", " lazy dog."])]
    batched = scorer.score_batch(items, batch_size=2)
    assert [len(scores) for scores in batched] == [2, 1, 3]
    for (prompt, segments), scores in zip(items, batched):
        assert scores == pytest.approx(scorer.score_segments(prompt, segments), abs=1e-6)


@pytest.fixture(scope="module")
def arith_ngram():
    """A character 6-gram of reference solutions: often right, sometimes not."""
    problems = generate_problems(300, seed=11, config=ArithConfig(2, 3, 9))
    texts = [format_prompt(p) + format_solution(p) for p in problems]
    vocabulary = sorted(set("".join(texts))) + ["$"]
    return train_ngram(texts, NGramConfig(6, "kneser-ney"), level="char", vocabulary=vocabulary, eos="$")


class RecordingBar:
    """tqdm's interface as evaluate_arith uses it, recording the bar's position at each move."""

    def __init__(self, total, desc, enabled):
        self.total, self.n, self.positions = total, 0, []

    def update(self, n=1):
        self.n += n
        self.positions.append(self.n)

    def set_postfix_str(self, text, refresh=True):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_evaluate_end_to_end_with_oracle_scorers(arith_ngram, tmp_path, one_thread, monkeypatch):
    from decodekit.meta import evaluate

    strategies = ("single", "majority", "bon-oracle", "beam-oracle", "rebase-oracle", "calculator")
    # rows=8: two prompts of 4 samples a generator call, so the sampling has calls to show
    config = EvalConfig(strategies=strategies, ns=(1, 2, 4), seeds=2, problems=4, width=2, rows=8)
    scorers = arith_scorers(config)  # oracle scorers only: no learned model is loaded
    problems = generate_problems(4, seed=12, config=ArithConfig(2, 3, 9))
    bars = []
    monkeypatch.setattr(evaluate, "progress_bar", lambda **kw: bars.append(RecordingBar(**kw)) or bars[-1])
    report = evaluate_arith(config, LocalGenerator(arith_ngram), scorers, problems, progress=True)
    # Issue 35: the bar moves within each of its units (a seed's parallel, tree and chain part)
    [bar] = bars
    assert bar.total == 6 and bar.positions[-1] == 6 and bar.positions == sorted(bar.positions)
    for unit in range(6):
        assert any(unit < p < unit + 1 for p in bar.positions), (unit, bar.positions)
    summary = {(r["strategy"], r["n"]): r for r in report["summary"]}
    assert set(summary) == {("single", 1), ("calculator", 1)} | {
        (s, n) for s in strategies[1:-1] for n in (1, 2, 4)}
    assert summary[("calculator", 1)]["accuracy"] >= 0 and report["rows"][-1]["tool_calls"] > 0
    assert all(r["seeds"] == 2 for r in report["summary"])
    assert all(r["accuracy_min"] <= r["accuracy"] <= r["accuracy_max"] for r in report["summary"])
    # the oracle's best-of-N is pass@N: it cannot drop when N doubles (see subset_curve)
    oracle = [summary[("bon-oracle", n)]["accuracy"] for n in (1, 2, 4)]
    assert oracle == sorted(oracle)
    tokens = [summary[("majority", n)]["generated_tokens"] for n in (1, 2, 4)]
    assert tokens[1] == pytest.approx(2 * tokens[0]) and tokens[2] == pytest.approx(4 * tokens[0])
    assert all(r["generated_tokens"] > 0 for r in report["rows"])
    plot(report, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    assert "bon-oracle" in table(report)


def test_eval_config_and_cli_errors(capsys):
    with pytest.raises(ValueError, match="unknown strategies"):
        EvalConfig(strategies=("best-of-everything",))
    with pytest.raises(ValueError, match="every N must be an integer >= 1"):
        EvalConfig(ns=(0, 2))
    with pytest.raises(ValueError, match="aggregate must be one of"):
        EvalConfig(aggregate="mean")
    assert main(["eval", "arith", "--strategies", "majority,mcts"]) == 2
    assert "unknown strategies ['mcts']" in capsys.readouterr().err
    assert main(["eval", "arith", "--budgets", "1,two"]) == 2
    assert "--budgets must be comma-separated integers" in capsys.readouterr().err
