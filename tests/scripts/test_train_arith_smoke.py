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
