"""The reward–KL frontier report (`decodekit eval alignment`) on a tiny configuration."""

from __future__ import annotations

import json
import math

import pytest
import torch

from decodekit.align import frontier
from decodekit.cli import main

SMALL = frontier.FrontierConfig(base_samples=16, samples=4, max_tokens=6, bon_n=(1, 2, 4),
                                soft_lams=(0.5,), betas=(1.0,), lams=(2.0,), blocks=((2, 3),),
                                train_top_k=8, train_steps=3)


@pytest.fixture(scope="module")
def report():
    before = torch.get_num_threads()
    out = frontier.alignment_frontier(SMALL)  # runs on SMALL.threads = 1 thread
    assert torch.get_num_threads() == before  # and restores the setting
    return out


def _by(report, method):
    return [p for p in report["points"] if p["method"] == method]


def test_report_points(report):
    base = _by(report, "base")[0]
    bon = _by(report, "best-of-n")
    assert [p["setting"] for p in bon] == ["n=1", "n=2", "n=4"]
    assert bon[0]["kl"] == pytest.approx(0.0, abs=1e-12)
    assert bon[0]["reward"] == pytest.approx(base["reward"], abs=1e-9)  # plug-in: same samples
    assert [p["reward"] for p in bon] == sorted(p["reward"] for p in bon)
    for p in bon:
        assert p["kl"] <= p["kl_bound"] + 1e-12
    block = _by(report, "blockwise CD (CD-Q)")[0]
    assert block["kl"] == pytest.approx(2 * (math.log(2) - 0.5))  # 6 tokens / M=3 = 2 blocks
    assert len(_by(report, "token-wise CD (CD-Q)")) == 1
    assert len(_by(report, "token-wise CD (CD-FUDGE)")) == 1
    text = frontier.table(report)
    assert "blockwise CD (CD-Q)" in text and "<= " in text


def test_plot(report, tmp_path):
    path = tmp_path / "frontier.png"
    frontier.plot_frontier(report, path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_cli_eval_alignment(report, monkeypatch, capsys, tmp_path):
    seen = []
    monkeypatch.setattr(frontier, "alignment_frontier",
                        lambda config, progress: seen.append(config) or report)
    main(["eval", "alignment", "--json", "--plot", str(tmp_path / "f.png")])
    out = json.loads(capsys.readouterr().out)
    assert isinstance(seen[0], frontier.FrontierConfig)
    assert out["points"] == report["points"]
    assert (tmp_path / "f.png").exists()
    main(["eval", "alignment"])
    assert "best-of-n" in capsys.readouterr().out
