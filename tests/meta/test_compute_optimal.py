"""Accuracy against inference FLOPs across sizes: the FLOPs count, the frontier and the
budget winners by hand, and the CLI's pairing of --model with --orm/--prm.
(End to end on two random tiny sizes: tests/scripts/test_train_arith_smoke.py.)"""

from __future__ import annotations

import pytest

from decodekit.cli import main
from decodekit.meta.compute_optimal import (
    budget_winners,
    frontier,
    inference_flops,
    reward_names,
    size_points,
)


def point(model, strategy, n, accuracy, flops):
    return {"model": model, "strategy": strategy, "n": n, "accuracy": accuracy, "flops": flops}


def test_flops_are_two_per_parameter_per_token_prompt_included():
    assert inference_flops(1000, 20, 80) == 2 * 1000 * 100
    summary = [{"strategy": "majority", "n": 2, "accuracy": 0.5, "generated_tokens": 80.0}]
    rows = [{"strategy": "majority", "n": 2, "prompt_tokens": 18.0},
            {"strategy": "majority", "n": 2, "prompt_tokens": 22.0},
            {"strategy": "majority", "n": 4, "prompt_tokens": 99.0}]  # another N: not averaged in
    [p] = size_points(summary, rows, parameters=1000, prompt_tokens=19.0)
    assert p["prompt_tokens_computed"] == 20.0  # what the engine computed, over the seeds
    assert p["prompt_tokens"] == 19.0 and p["flops"] == 2 * 1000 * (19 + 80)


def test_frontier_keeps_only_points_no_cheaper_point_beats():
    points = [point("small", "majority", 1, 0.30, 10), point("small", "majority", 4, 0.50, 40),
              point("large", "majority", 1, 0.45, 40), point("small", "majority", 16, 0.52, 160),
              point("large", "majority", 4, 0.70, 160), point("large", "majority", 16, 0.69, 640)]
    edge = frontier(points)
    # at 40 FLOPs small N=4 (0.50) beats large N=1 (0.45); at 160 large N=4 (0.70) wins;
    # large N=16 is dearer and no better
    assert [(p["model"], p["n"]) for p in edge] == [("small", 1), ("small", 4), ("large", 4)]
    budgets = budget_winners(points, per_decade=1)  # budgets 10, 100, 1000
    assert [b["budget_flops"] for b in budgets] == pytest.approx([10, 100, 1000])
    assert [(b["model"], b["n"], b["accuracy"]) for b in budgets] == [
        ("small", 1, 0.30), ("small", 4, 0.50), ("large", 4, 0.70)]
    assert budgets[0]["best_per_model"] == {"small": 0.30, "large": None}
    assert budgets[1]["best_per_model"] == {"small": 0.50, "large": 0.45}


def test_reward_models_pair_with_their_policy_by_name():
    assert reward_names("arith-small") == ("arith-small-orm", "arith-small-prm")
    assert reward_names("runs/x/arith/") == ("runs/x/arith-orm", "runs/x/arith-prm")


def test_cli_rejects_unpaired_reward_models_and_endpoint_with_sizes(capsys):
    assert main(["eval", "arith", "--model", "a", "--model", "b", "--orm", "x"]) == 2
    assert "give --orm once per --model (2) or not at all, got 1" in capsys.readouterr().err
    assert main(["eval", "arith", "--model", "a", "--model", "b",
                 "--endpoint", "http://127.0.0.1:9/v1"]) == 2
    assert "--endpoint serves one model; got 2 --model" in capsys.readouterr().err
    assert main(["eval", "perplexity", "--model", "a", "--model", "b"]) == 2
    assert "several --model compare sizes in eval arith only, not eval perplexity" in capsys.readouterr().err
