"""Smoke run of scripts/train_arith.py on a tiny model and a handful of problems."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def train_arith():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import train_arith

        yield train_arith
    finally:
        sys.path.remove(str(SCRIPTS))


def test_auc_by_hand(train_arith):
    # positives 0.35, 0.8 vs negatives 0.1, 0.4: 3 of 4 pairs ordered right
    assert train_arith.auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == 0.75
    assert train_arith.auc([0.5, 0.5], [True, False]) == 0.5  # a tie counts half
    assert train_arith.auc([0.9, 0.1], [True, False]) == 1.0


def test_tiny_run_trains_evaluates_and_resumes(train_arith, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decodekit.meta.tasks.arith import load_orm, load_prm

    threads = torch.get_num_threads()
    try:
        metrics = train_arith.main(["--out", str(tmp_path), "--tiny"])
    finally:
        torch.set_num_threads(threads)
    assert 0.0 <= metrics["accuracy_t1"] <= 1.0 and metrics["test_problems"] == 4
    assert json.loads((tmp_path / "metrics.json").read_text())["parameters"]["arith"] > 0

    lm_dir = tmp_path / "lm" / "final"
    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    text = "Compute: 17+4*3-8=\n4*3=12\nAnswer: 21"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tokenizer.decode(ids) == text  # one token per character
    assert tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id) == "<|endoftext|>"
    assert AutoModelForCausalLM.from_pretrained(lm_dir).config.vocab_size == len(tokenizer)

    orm, prm = load_orm(tmp_path / "orm"), load_prm(tmp_path / "prm")
    assert 0.0 < orm("17+4*3-8", "4*3=12\n17+12=29\n29-8=21\nAnswer: 21") < 1.0
    scores = prm("Compute: 17+4*3-8=\n", ["4*3=12", "17+12=29", "Answer: 29"])
    assert len(scores) == 3 and all(0.0 < s < 1.0 for s in scores)

    # a second run finds every stage done and only re-evaluates
    stamp = (tmp_path / "orm" / "probe.json").stat().st_mtime_ns
    again = train_arith.main(["--out", str(tmp_path), "--tiny"])
    assert again["accuracy_t1"] == metrics["accuracy_t1"]
    assert (tmp_path / "orm" / "probe.json").stat().st_mtime_ns == stamp


def test_eval_sizes_end_to_end_on_two_random_sizes(train_arith, tmp_path, capsys, monkeypatch,
                                                   one_thread):
    """`decodekit eval arith --model A --model B --plot`: two untrained sizes with the arith
    tokenizer and hand-set probes installed as `train_arith.install` lays them out."""
    from dataclasses import replace

    from decodekit.cli import main
    from decodekit.meta import compute_optimal
    from decodekit.meta.tasks.arith import format_prompt, generate_problems

    # the held-out filter builds arith's 200k training questions (seconds): two problems do
    monkeypatch.setattr(compute_optimal, "eval_problems", lambda count: generate_problems(count, 5))
    from decodekit.meta.rewards import FEATURES, ProbeRewardModel

    tokenizer = train_arith.build_tokenizer(tmp_path / "tokenizer")
    probe = {"features": list(FEATURES), "mean": [-1.0] * 6, "std": [1.0] * 6,
             "weights": [0.5, 0.2, -0.3, 0.1, 0.4, -0.2], "bias": 0.0}
    parameters = {}
    for name, hidden in (("a", 16), ("b", 32)):
        model = train_arith.build_model(replace(train_arith.RUNS["tiny"].lm, hidden_size=hidden),
                                        tokenizer)
        model.save_pretrained(tmp_path / "lm" / name)
        tokenizer.save_pretrained(tmp_path / "lm" / name)
        parameters[name] = sum(p.numel() for p in model.parameters())
        scorers = {kind: ProbeRewardModel(model, tokenizer, probe) for kind in ("orm", "prm")}
        train_arith.install(tmp_path / "lm" / name, scorers, tmp_path, name)
    png = tmp_path / "sizes.png"
    capsys.readouterr()  # install's lines
    assert main(["eval", "arith", "--model", str(tmp_path / "a"), "--model", str(tmp_path / "b"),
                 "--budgets", "1,2", "--seeds", "1", "--problems", "2", "--json", "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["parameters"] for s in report["models"]] == [parameters["a"], parameters["b"]]
    for size in report["models"]:
        assert size["orm"] == size["model"] + "-orm"
        strategies = {(p["strategy"], p["n"]) for p in size["points"]}
        assert strategies == {(s, n) for s in ("majority", "weighted-orm", "rebase-prm") for n in (1, 2)}
        for p in size["points"]:  # 2 x parameters x (prompt + generated tokens)
            # one character a token: the mean prompt length of the two problems
            assert p["prompt_tokens"] == sum(len(format_prompt(q)) for q in generate_problems(2, 5)) / 2
            assert p["generated_tokens"] > 0
            assert p["flops"] == pytest.approx(2 * size["parameters"] * (p["prompt_tokens"] +
                                                                         p["generated_tokens"]))
    points = [p for size in report["models"] for p in size["points"]]
    assert report["frontier"][0]["flops"] == min(p["flops"] for p in points)
    assert all(b["accuracy"] == max(p["accuracy"] for p in points if p["flops"] <= b["budget_flops"])
               for b in report["budgets"])
    for strategy, budgets in report["budgets_by_strategy"].items():  # the size winning each budget
        assert all(b["strategy"] == strategy for b in budgets)
    assert png.stat().st_size > 10_000
    assert main(["eval", "arith", "--model", str(tmp_path / "a"), "--model", str(tmp_path / "b"),
                 "--budgets", "1", "--seeds", "1", "--problems", "1", "--strategies", "majority"]) == 0
    assert "best within each budget, majority" in capsys.readouterr().out
