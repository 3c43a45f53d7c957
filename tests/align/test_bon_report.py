"""The best-of-n calculator report and plot."""

from __future__ import annotations

import json
import math

import pytest

from decodekit.align.report import bon_report, plot_bon


def test_binary_example_report_by_hand():
    report = bon_report([0.5, 0.5], [0, 1], 4)
    h = -(1 / 16) * math.log(1 / 16) - (15 / 16) * math.log(15 / 16)
    assert report["kl"] == pytest.approx(math.log(2) - h, abs=1e-13)
    assert report["kl_bound"] == pytest.approx(math.log(4) - 0.75)
    assert report["kl_max"] == pytest.approx(math.log(2))
    # both outcomes have eps = 1/2, so every estimate is D^(1/2) for n = 4:
    # (1/16)(log 4 + 3 log(1/2) - 3/4) + (15/16) log((15/16) / (1/2))
    estimate = (math.log(4) + 3 * math.log(0.5) - 0.75) / 16 + (15 / 16) * math.log(15 / 8)
    assert report["kl_estimate"] == pytest.approx(estimate, abs=1e-13)
    assert report["kl_estimate_at_mode"] == pytest.approx(estimate, abs=1e-13)
    assert report["win_rate"] == pytest.approx(23 / 32, abs=1e-15)
    assert report["win_rate_bound"] == pytest.approx(0.8)
    assert report["pmf"] == pytest.approx([1 / 16, 15 / 16])
    assert "curve" not in report


def test_curve_and_json():
    report = bon_report([0.5, 0.3, 0.2], [0, 1, 2], 16, curve=True)
    assert [row["n"] for row in report["curve"]] == list(range(1, 17))
    assert report["curve"][-1]["kl"] == report["kl"]
    assert report["curve"][0]["kl"] == 0.0
    assert report["curve"][0]["win_rate"] == pytest.approx(0.5, abs=1e-15)
    json.dumps(report)  # plain floats and lists only


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_bon([0.5, 0.3, 0.2], [0, 1, 2], 16, tmp_path / "bon.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_validates():
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        bon_report([0.5, 0.5], [0, 1], 0)
