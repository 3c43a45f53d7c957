"""benchmarks/speculative_large.py (issue 36): the best-γ summary and the table, on rows of
known figures (the sweep itself is timed work, run by hand on a checkpoint)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "speculative_large.py"
spec = importlib.util.spec_from_file_location("speculative_large", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def row(draft, temperature, gamma, verify, speedup, adaptive=False, mean_gamma=None, best_plain=None):
    """`speedup` beside plain; `best_plain` (default the same): against the sweep's best plain."""
    return {"draft": draft, "temperature": temperature, "gamma": gamma, "verify": verify,
            "adaptive": adaptive, "mean_gamma": mean_gamma or gamma, "alpha": 0.5,
            "acceptance_rate": 0.4, "block_efficiency": 1.5, "speedup_cpu_beside": speedup,
            "speedup_cpu": best_plain or speedup, "speedup": best_plain or speedup}


def test_best_gamma_per_draft_temperature_and_rule_beside_the_adaptive_run():
    # the best by the speedup beside plain (γ = 4), not against the best plain (γ = 6)
    rows = [row("d", 0.0, 2, "block", 1.1), row("d", 0.0, 4, "block", 1.4, best_plain=0.9),
            row("d", 0.0, 6, "block", 1.2, best_plain=1.0),
            row("d", 0.0, 4, "block", 1.3, adaptive=True, mean_gamma=3.5),
            row("d", 1.0, 2, "block", 0.9), row("d", 1.0, 2, "token", 1.05), row("d", 1.0, 4, "token", 1.0)]
    best = {(b["temperature"], b["verify"]): b for b in bench.best_gammas(rows)}
    assert set(best) == {(0.0, "block"), (1.0, "block"), (1.0, "token")}
    assert best[0.0, "block"]["best_gamma"] == 4 and best[0.0, "block"]["best_speedup_cpu"] == 1.4
    assert best[0.0, "block"]["adaptive_mean_gamma"] == 3.5
    assert best[0.0, "block"]["adaptive_speedup_cpu"] == 1.3
    assert best[1.0, "token"]["best_gamma"] == 2 and best[1.0, "token"]["adaptive_speedup_cpu"] is None


def test_markdown_names_the_label_and_every_row():
    rows = [row("shakespeare", 0.0, 2, "block", 1.25, best_plain=0.8),
            row("shakespeare", 0.0, 4, "block", 1.5, True, 3.2)]
    result = {"target": "ckpt", "label": "step 0, untrained", "new_tokens": 32, "prompts": 1,
              "plain": {"t0": {"tok_s": 10.0}}, "rows": rows,
              "copy_workload": {"gamma4": {"speedup_cpu": 1.44, "block_efficiency": 1.88}},
              "paired_t1": {"shakespeare": {2: {"gain": -0.011}}}}
    text = bench.markdown(result)
    assert "step 0, untrained" in text
    assert "| shakespeare | 0 | 2 | block | 0.50 | 0.40 | 1.50 | 1.25x | 0.80x |" in text
    assert "adaptive (mean 3.2)" in text and "gamma4: 1.44x CPU" in text
    assert "shakespeare γ=2: -1.1 %" in text


def test_a_configuration_beside_plain_is_against_the_plain_runs_around_it():
    from decodekit.bench.speculative import Timing, summary

    stats = {"drafted_tokens": 8, "target_calls": 4, "alpha_sum": 2.0, "alpha_count": 4, "accepted_tokens": 6,
             "emitted_tokens": 10, "draft_calls": 8, "draft_seconds": 0.5, "wall_seconds": 1.0}  # fmt: skip
    spec, best_plain = Timing(wall=1.0, cpu=1.0), Timing(wall=1.2, cpu=1.2)
    out = summary(stats, spec, best_plain, beside=(Timing(wall=2.0, cpu=1.8), Timing(wall=2.0, cpu=2.2)))
    assert out["speedup_cpu"] == 1.2 and out["speedup_cpu_beside"] == 2.0  # (1.8 + 2.2) / 2 / 1.0
    assert out["block_efficiency"] == 2.5 and out["alpha"] == 0.5
    assert "speedup_cpu_beside" not in summary(stats, spec, best_plain)
