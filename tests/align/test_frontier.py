"""The reward–KL frontier report (`decodekit eval alignment`) on a tiny configuration."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from decodekit.align import frontier
from decodekit.cli import main

SMALL = frontier.FrontierConfig(base_samples=16, samples=4, max_tokens=6, bon_n=(1, 2, 4),
                                soft_lams=(0.5,), betas=(1.0,), lams=(2.0,), blocks=((2, 3),),
                                train_top_k=8, train_steps=3)


class RecordingBar:
    """tqdm's interface as the frontier uses it, recording the bar's position at each move."""

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
        self.positions.append(self.n)  # where it ended (advance_to sets n exactly)


@pytest.fixture(scope="module")
def run():
    bars = []
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(frontier, "progress_bar", lambda **kw: bars.append(RecordingBar(**kw)) or bars[-1])
        out = frontier.alignment_frontier(SMALL, progress=True)  # runs on SMALL.threads = 1 thread
    assert torch.get_num_threads() == before  # and restores the setting
    return out, bars[0]


@pytest.fixture(scope="module")
def report(run):
    return run[0]


def test_progress_moves_within_every_stage(run):
    """Issue 35: the bar read 0/21 for ten minutes, one unit a stage. Each stage (the base
    samples, each training, each token-wise and blockwise run) now moves it in between."""
    bar = run[1]
    stages = 3 + 2 * len(SMALL.lams) + 2 * len(SMALL.blocks)
    assert bar.total == stages and bar.positions[-1] == stages
    assert bar.positions == sorted(bar.positions)
    for stage in range(stages):
        assert any(stage < p < stage + 1 for p in bar.positions), (stage, bar.positions)


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


def test_cli_alignment_flags_reach_the_config(report, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(frontier, "alignment_frontier",
                        lambda config, progress: seen.append(config) or report)
    main(["eval", "alignment", "--value", "hidden", "--reward", "style"])
    main(["eval", "alignment", "--base-samples", "512", "--samples", "128"])
    assert [(c.value, c.reward, c.base_samples, c.samples) for c in seen] == [
        ("hidden", "style", 4096, 64), ("bag", "keywords", 512, 128)]
    assert main(["eval", "alignment", "--samples", "0"]) == 2
    capsys.readouterr()
    assert main(["eval", "arith", "--value", "hidden"]) == 2
    assert "--value applies to eval alignment, not eval arith" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^value must be one of bag, hidden, got 'tree'"):
        frontier.FrontierConfig(value="tree")
    with pytest.raises(ValueError, match="^reward must be one of"):
        frontier.FrontierConfig(reward="length")


def test_bon_n_same_reward_inverts_the_best_of_n_curve():
    r = [0.0, 1.0] * 8  # best-of-n's expected reward is 1 - 2^-n
    assert frontier.bon_n_same_reward(r, 0.4) == 1.0  # at or below the mean
    assert frontier.bon_n_same_reward(r, 0.75) == pytest.approx(2.0)
    assert frontier.bon_n_same_reward(r, 0.8) == pytest.approx(2 + 0.05 / 0.125)
    assert frontier.bon_n_same_reward(r, 1 - 2.0**-9) == pytest.approx(9.0)
    assert frontier.bon_n_same_reward(r, 1.0) is None  # above best-of-16


def test_hidden_value_frontier_with_the_style_reward():
    config = replace(SMALL, value="hidden", reward="style", train_epochs=1, head_width=4)
    out = frontier.alignment_frontier(config)
    base = _by(out, "base")[0]
    assert -20 < base["reward"] < 0  # a mean log-likelihood per token
    assert [p["setting"] for p in _by(out, "token-wise CD (CD-Q)")] == ["lam=2"]
    for name in ("CD-Q", "CD-FUDGE"):
        [block] = _by(out, f"blockwise CD ({name})")
        same, (low, high) = block["bon_n_same_reward"], block["bon_n_range"]
        assert same is None or 1.0 <= same <= config.base_samples
        assert low is not None and low <= (same if same is not None else math.inf)
        assert high is None or same is None or high >= same
    assert "n/K" in frontier.table(out) or "above the largest n" in frontier.table(out)
