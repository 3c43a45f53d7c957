"""scripts/size_lm.py: the expected-speedup arithmetic behind "the acceptance a draft needs"."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))  # size_lm imports train_lm beside it
spec = importlib.util.spec_from_file_location("size_lm", REPO / "scripts" / "size_lm.py")
size_lm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(size_lm)


def test_speedup_is_tokens_per_block_over_block_cost():
    assert size_lm.speedup(0.0, 3, 0.1, 1.0) == pytest.approx(1 / 1.3)  # one token per block
    assert size_lm.speedup(1.0, 4, 0.0, 1.0) == pytest.approx(5.0)  # free draft, all accepted
    # α = 0.5, γ = 2: 1 + 0.5 + 0.25 tokens for 2 * 0.25 + 1.5 target steps
    assert size_lm.speedup(0.5, 2, 0.25, 1.5) == pytest.approx(1.75 / 2.0)


def test_alpha_needed_is_the_smallest_alpha_that_reaches_the_goal():
    alpha, gamma = size_lm.alpha_needed(2.0, 0.1, 1.2)
    verify = 1 + 0.2 * gamma / 4
    assert size_lm.speedup(alpha, gamma, 0.1, verify) == pytest.approx(2.0, abs=1e-6)
    for g in range(1, 17):  # no γ reaches 2x at a slightly lower α
        assert size_lm.speedup(alpha - 0.01, g, 0.1, 1 + 0.2 * g / 4) < 2.0
    # a costlier draft needs a higher acceptance; a goal no γ reaches gives α = 1
    assert size_lm.alpha_needed(2.0, 0.2, 1.2)[0] > alpha
    assert size_lm.alpha_needed(20.0, 0.1, 1.2)[0] == 1.0
