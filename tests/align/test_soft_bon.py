"""Soft best-of-n: the exact PMF against enumeration, the sampler against its PMF."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from decodekit.align.bon import bon_pmf
from decodekit.align.soft_bon import soft_bon_pmf, soft_bon_sample


def brute_force(p, r, n, lam):
    """Enumerate all n-tuples; candidate i is picked with probability softmax(r / lam)_i."""
    p, r = np.asarray(p, float), np.asarray(r, float)
    pmf = np.zeros(p.size)
    for tup in itertools.product(range(p.size), repeat=n):
        rewards = r[list(tup)]
        weights = np.exp((rewards - rewards.max()) / lam)
        for i, y in enumerate(tup):
            pmf[y] += np.prod(p[list(tup)]) * weights[i] / weights.sum()
    return pmf


@pytest.mark.parametrize(
    "p, r, n, lam",
    [
        ([0.5, 0.3, 0.2], [0, 1, 2], 4, 1.0),
        ([0.5, 0.3, 0.2], [0, 1, 2], 5, 0.1),
        ([0.1, 0.2, 0.3, 0.4], [1, 1, 0, 3], 4, 0.5),  # tied rewards
        ([0.25, 0.25, 0.5], [0, 1, 1e-3], 5, 1e-7),  # r / lam up to 1e7 apart
        ([0.9, 0.05, 0.05, 0.0], [0, 1, 2, 50], 6, 3.0),  # p = 0 outcome with the top reward
    ],
)
def test_pmf_matches_enumeration(p, r, n, lam):
    np.testing.assert_allclose(soft_bon_pmf(p, r, n, lam), brute_force(p, r, n, lam), atol=1e-12)


def test_hand_computed_n2():
    # n = 2, p = (1/2, 1/2), weights (1, e): pi(1) = 1/4 + 1/4 + 2 (1/4) e / (1 + e)
    pmf = soft_bon_pmf([0.5, 0.5], [0.0, 1.0], 2, 1.0)
    expected_top = 0.25 + 0.5 * math.e / (1 + math.e)
    np.testing.assert_allclose(pmf, [1 - expected_top, expected_top], atol=1e-13)


def test_limits_are_best_of_n_and_base():
    p, r = [0.5, 0.3, 0.2], [0.0, 1.0, 2.0]
    np.testing.assert_array_equal(soft_bon_pmf(p, r, 8, 0.0), bon_pmf(p, r, 8))
    np.testing.assert_allclose(soft_bon_pmf(p, r, 8, 1e-3), bon_pmf(p, r, 8), atol=1e-12)
    np.testing.assert_array_equal(soft_bon_pmf(p, r, 8, math.inf), p)
    np.testing.assert_allclose(soft_bon_pmf(p, r, 8, 1e6), p, atol=1e-5)
    assert soft_bon_pmf(p, r, 64, 0.5).sum() == pytest.approx(1.0, abs=1e-12)


def test_sampler_lam_zero_picks_uniformly_among_tied_maxima():
    rewards = torch.tensor([[1.0, 3.0, 3.0, 0.0]]).expand(6000, 4)  # [B, n]
    index = soft_bon_sample(rewards, 0.0, torch.Generator().manual_seed(0))
    assert index.shape == (6000,)
    counts = torch.bincount(index, minlength=4)
    assert counts[0] == 0 and counts[3] == 0
    assert abs(counts[1].item() - 3000) < 200  # binomial sd = 39


def test_sampler_frequencies_follow_softmax():
    rewards = torch.tensor([0.0, 1.0, 2.0])
    gen = torch.Generator().manual_seed(1)
    draws = 20000
    index = soft_bon_sample(rewards.expand(draws, 3), 0.5, gen)
    counts = torch.bincount(index, minlength=3).double().numpy()
    expected = draws * torch.softmax(rewards / 0.5, 0).double().numpy()
    chi2 = np.sum((counts - expected) ** 2 / expected)
    assert chi2 < 13.82  # 99.9% quantile of chi-square with 2 degrees of freedom
    assert soft_bon_sample(rewards, 0.5, gen).shape == ()


def test_end_to_end_sampling_matches_exact_pmf():
    p, r, n, lam, draws = np.array([0.4, 0.3, 0.2, 0.1]), np.array([0.0, 1.0, 1.0, 2.5]), 4, 0.7, 20000
    samples = np.random.default_rng(3).choice(4, size=(draws, n), p=p)  # [draws, n]
    chosen = soft_bon_sample(r[samples], lam, torch.Generator().manual_seed(3)).numpy()
    counts = np.bincount(samples[np.arange(draws), chosen], minlength=4)
    expected = draws * soft_bon_pmf(p, r, n, lam)
    chi2 = np.sum((counts - expected) ** 2 / expected)
    assert chi2 < 16.27  # 99.9% quantile of chi-square with 3 degrees of freedom


@pytest.mark.parametrize("lam", [-1.0, math.nan])
def test_bad_lam_raises(lam):
    with pytest.raises(ValueError, match="lam must be a number >= 0"):
        soft_bon_pmf([0.5, 0.5], [0, 1], 2, lam)
    with pytest.raises(ValueError, match="lam must be a number >= 0"):
        soft_bon_sample([0.0, 1.0], lam)


def test_bad_rewards_raise():
    with pytest.raises(ValueError, match=r"shape \[..., n\]"):
        soft_bon_sample(torch.zeros(2, 0), 1.0)
    with pytest.raises(ValueError, match="finite"):
        soft_bon_sample([0.0, math.inf], 1.0)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        soft_bon_pmf([0.5, 0.5], [0, 1], 0, 1.0)
