"""Smoke run of scripts/ngram_report.py on slices of the packaged validation text."""

from __future__ import annotations

import re
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_report_on_a_tiny_corpus(tmp_path, capsys):
    from decodekit.models.ngram import EOS_SYMBOL, NGramLM
    from decodekit.models.registry import ASSETS

    text = (ASSETS / "data" / "shakespeare_val.txt").read_text(encoding="utf-8")
    (tmp_path / "train.txt").write_text(text[:30_000] + EOS_SYMBOL + text[30_000:60_000])
    (tmp_path / "val.txt").write_text(text[60_000:66_000])
    sys.path.insert(0, str(SCRIPTS))
    try:
        import ngram_report
    finally:
        sys.path.remove(str(SCRIPTS))

    ngram_report.main(["--data", str(tmp_path), "--max-order", "3", "--sample-length", "30",
                       "--save", str(tmp_path / "model"), "--save-order", "3", "--name", "t3"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in out.splitlines()
            if line.startswith("| add") or line.startswith("| kneser")}
    add_constant = [float(x) for x in rows["add-constant"]]
    kneser_ney = [float(x) for x in rows["kneser-ney"]]
    assert kneser_ney[2] < kneser_ney[0] and add_constant[1] < add_constant[0]
    assert out.count("- **") == 4  # samples of orders 0, 1, 2, 3
    model = NGramLM.load(tmp_path / "model")
    assert model.name == "t3" and model.config.order == 3
    saved = float(re.search(r"validation perplexity ([0-9.]+)", out).group(1))
    assert abs(saved - kneser_ney[2]) <= 0.005  # the saved model is the table's KN k = 3
