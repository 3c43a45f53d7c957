"""Best-of-n theory against seed 000's closed forms, brute-force enumeration and sampling."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit.align.bon import (
    blockwise_kl_bound,
    bon_kl,
    bon_kl_bound,
    bon_kl_estimate,
    bon_kl_max,
    bon_kl_mc,
    bon_n_for_kl,
    bon_pmf,
    bon_win_rate,
    bon_win_rate_bound,
    bon_win_rate_mc,
)
from decodekit.align.pmf import kl_divergence
from decodekit.align.soft_bon import soft_bon_sample


def h(x: float) -> float:
    """Binary entropy in nats."""
    return -x * math.log(x) - (1 - x) * math.log(1 - x)


def brute_force(p, r, n):
    """Best-of-n PMF and win rate by enumerating all n-tuples, ties broken uniformly."""
    p, r = np.asarray(p, float), np.asarray(r, float)
    pmf, win = np.zeros(p.size), 0.0
    for tup in itertools.product(range(p.size), repeat=n):
        prob = np.prod(p[list(tup)])
        if prob == 0:
            continue
        best = max(r[y] for y in tup)
        winners = [y for y in tup if r[y] == best]
        for y in winners:
            pmf[y] += prob / len(winners)
        win += prob * (p[r < best].sum() + 0.5 * p[r == best].sum())
    return pmf, win


# Seed 000, Example 1: p = (1/2, 1/2), r = (0, 1): pi_n = (2^-n, 1 - 2^-n).
@pytest.mark.parametrize("n", range(1, 21))
def test_binary_example_kl_is_log2_minus_binary_entropy(n):
    assert bon_kl([0.5, 0.5], [0, 1], n) == pytest.approx(math.log(2) - h(2.0**-n), abs=1e-13)
    np.testing.assert_allclose(bon_pmf([0.5, 0.5], [0, 1], n), [2.0**-n, 1 - 2.0**-n], rtol=1e-13)


def test_binary_example_bound_is_strict_and_win_rate_closed_form():
    # n = 4: exact 0.4594 < bound log 4 - 3/4 = 0.6363; win rate 1 - (1/2)(1/32 + 17/32) = 23/32
    assert bon_kl([0.5, 0.5], [0, 1], 4) == pytest.approx(0.459355521853486, abs=1e-12)
    assert bon_kl_bound(4) == pytest.approx(math.log(4) - 0.75)
    assert bon_win_rate([0.5, 0.5], [0, 1], 4) == pytest.approx(23 / 32, abs=1e-15)
    assert bon_win_rate_bound(4) == pytest.approx(0.8)


@pytest.mark.parametrize(
    "p, r",
    [
        ([0.1, 0.2, 0.3, 0.4], [1.0, 1.0, 0.0, 2.0]),  # a tie between outcomes 0 and 1
        ([0.25, 0.25, 0.5, 0.0], [3.0, 3.0, 3.0, 9.0]),  # all tied; p = 0 outcome has top reward
        ([0.5, 0.3, 0.2], [0.0, 1.0, 2.0]),
        ([0.6, 0.1, 0.1, 0.2], [2.0, 0.0, 2.0, 1.0]),
    ],
)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_pmf_and_win_rate_match_enumeration_with_ties(p, r, n):
    pmf, win = brute_force(p, r, n)
    np.testing.assert_allclose(bon_pmf(p, r, n), pmf, atol=1e-13)
    assert bon_win_rate(p, r, n) == pytest.approx(win, abs=1e-13)


def test_hand_computed_pmf_with_tie_split_in_proportion_to_p():
    # top level {0, 1} has mass 0.5: F = 1, F^- = 0.5, it gets 1 - 0.5^3 = 0.875, split 2:3
    np.testing.assert_allclose(bon_pmf([0.2, 0.3, 0.5, 0.0], [1, 1, 0, 5], 3),
                               [0.35, 0.525, 0.125, 0.0], atol=1e-15)


def test_pmf_matches_monte_carlo_best_of_n():
    p, r, n, draws = np.array([0.4, 0.3, 0.2, 0.1]), np.array([0.0, 2.0, 2.0, 1.0]), 3, 20000
    rng = np.random.default_rng(0)
    import torch

    samples = rng.choice(p.size, size=(draws, n), p=p)  # [draws, n]
    chosen = soft_bon_sample(r[samples], 0.0, torch.Generator().manual_seed(0)).numpy()
    counts = np.bincount(samples[np.arange(draws), chosen], minlength=p.size)
    expected = draws * bon_pmf(p, r, n)
    chi2 = np.sum((counts - expected) ** 2 / expected)
    assert chi2 < 16.27  # 99.9% quantile of chi-square with 3 degrees of freedom


def test_continuous_limit_approaches_bound():
    # 10^4 equiprobable outcomes with distinct rewards: n * eps = 8e-4, the gap is tiny
    v = 10_000
    kl = bon_kl(np.full(v, 1 / v), np.arange(v), 8)
    assert bon_kl_bound(8) - 1e-3 < kl < bon_kl_bound(8)
    assert bon_win_rate(np.full(v, 1 / v), np.arange(v), 8) == pytest.approx(8 / 9, abs=1e-3)


@st.composite
def distributions(draw, max_size=8, integer_rewards=True):
    size = draw(st.integers(1, max_size))
    weights = draw(st.lists(st.floats(0.0, 1.0), min_size=size, max_size=size))
    if sum(weights) < 1e-3:
        weights[0] = 1.0
    p = np.asarray(weights) / sum(weights)
    rewards = st.integers(0, 3) if integer_rewards else st.floats(-5, 5)
    r = draw(st.lists(rewards, min_size=size, max_size=size))
    return p, np.asarray(r, dtype=float)


@settings(max_examples=60, deadline=None)
@given(st.one_of(distributions(), distributions(integer_rewards=False)), st.integers(1, 200))
def test_properties_on_random_distributions(dist, n):
    p, r = dist
    pmf = bon_pmf(p, r, n)
    assert pmf.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.all(pmf[p == 0] == 0)
    kl = bon_kl(p, r, n)
    assert kl == pytest.approx(kl_divergence(pmf, p), abs=1e-9)
    assert -1e-12 <= kl <= bon_kl_bound(n) + 1e-12
    assert kl <= bon_kl_max(p, r) + 1e-12
    assert bon_kl(p, r, n + 1) >= kl - 1e-12  # nondecreasing in n (bon_n_for_kl relies on it)
    win = bon_win_rate(p, r, n)
    assert 0.5 - 1e-12 <= win <= bon_win_rate_bound(n) + 1e-12
    estimate = bon_kl_estimate(p[pmf > 0], n)
    assert np.all(estimate >= -1e-12) and np.all(estimate <= bon_kl_bound(n) + 1e-12)


@settings(max_examples=25, deadline=None)
@given(distributions(max_size=4), st.integers(1, 4))
def test_random_distributions_match_enumeration(dist, n):
    p, r = dist
    pmf, win = brute_force(p, r, n)
    np.testing.assert_allclose(bon_pmf(p, r, n), pmf, atol=1e-12)
    assert bon_win_rate(p, r, n) == pytest.approx(win, abs=1e-12)


def test_estimator_hand_values_and_limits():
    # n = 2, eps = 1/2: (1/4)(log 2 - log 2 - 1/2) + (3/4) log(3/2)
    assert bon_kl_estimate(0.5, 2) == pytest.approx(-0.125 + 0.75 * math.log(1.5), abs=1e-15)
    assert bon_kl_estimate(1.0, 7) == 0.0
    assert bon_kl_estimate(1e-12, 16) == pytest.approx(bon_kl_bound(16), abs=1e-9)
    assert bon_kl_estimate(0.3, 1) == pytest.approx(0.0, abs=1e-15)
    np.testing.assert_allclose(bon_kl_estimate([0.5, 1.0], 2), [bon_kl_estimate(0.5, 2), 0.0])


def test_n_for_kl_from_bound_and_exact():
    # bound(6) = 0.958 < 1 <= bound(7) = 1.089
    assert bon_n_for_kl(1.0) == 7
    assert bon_n_for_kl(0.0) == 1
    # binary example: KL(4) = 0.459 < 0.5 <= KL(5) = log 2 - h(1/32) = 0.554
    assert bon_n_for_kl(0.5, [0.5, 0.5], [0, 1]) == 5
    assert bon_n_for_kl(0.69, [0.5, 0.5], [0, 1]) == 12  # KL(11) = 0.68893, KL(12) = 0.69086
    with pytest.raises(ValueError, match="never reaches"):
        bon_n_for_kl(math.log(2), [0.5, 0.5], [0, 1])


def test_blockwise_bound_holds_on_two_block_tree():
    rng = np.random.default_rng(1)
    k = 4
    p1 = rng.dirichlet(np.ones(3))  # block 1
    p2 = rng.dirichlet(np.ones(3), size=3)  # [3, 3] block 2 given block 1
    v1, v2 = rng.normal(size=3), rng.normal(size=(3, 3))  # values of the prefixes
    pi1 = bon_pmf(p1, v1, k)
    joint_pi = np.concatenate([pi1[a] * bon_pmf(p2[a], v2[a], k) for a in range(3)])
    joint_p = (p1[:, None] * p2).ravel()
    kl = kl_divergence(joint_pi, joint_p)
    chain = bon_kl(p1, v1, k) + sum(pi1[a] * bon_kl(p2[a], v2[a], k) for a in range(3))
    assert kl == pytest.approx(chain, abs=1e-12)
    assert 0 < kl <= blockwise_kl_bound(2, k)
    assert blockwise_kl_bound(3, 4) == pytest.approx(3 * (math.log(4) - 0.75))


def test_monte_carlo_counterparts():
    rng = np.random.default_rng(2)
    normal = rng.normal(size=20000)
    assert bon_kl_mc(normal, 8) == pytest.approx(bon_kl_bound(8), abs=0.01)
    assert bon_win_rate_mc(normal, 8) == pytest.approx(8 / 9, abs=0.01)
    binary = rng.integers(0, 2, size=20000).astype(float)  # rewards of p = (1/2, 1/2) draws
    assert bon_kl_mc(binary, 3) == pytest.approx(math.log(2) - h(1 / 8), abs=0.01)
    assert bon_win_rate_mc(binary, 3) == pytest.approx(bon_win_rate([0.5, 0.5], [0, 1], 3),
                                                       abs=0.01)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: bon_kl([0.5, 0.5], [0, 1], 0), "n must be an integer >= 1, got 0"),
        (lambda: bon_pmf([0.5, 0.4], [0, 1], 2), "p must sum to 1"),
        (lambda: bon_pmf([1.2, -0.2], [0, 1], 2), "p must contain probabilities >= 0"),
        (lambda: bon_win_rate([0.5, 0.5], [0, 1, 2], 2), r"one reward per outcome \(2\), got 3"),
        (lambda: bon_kl([0.5, 0.5], [0, math.nan], 2), "finite rewards"),
        (lambda: bon_kl_estimate(0.0, 4), r"eps must be probabilities in \(0, 1\]"),
        (lambda: bon_n_for_kl(-1.0), "kl must be a number >= 0"),
        (lambda: blockwise_kl_bound(0, 4), "num_blocks must be an integer >= 1"),
        (lambda: bon_kl_mc([], 4), "non-empty"),
    ],
)
def test_bad_inputs_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_non_integer_n_raises_type_error():
    with pytest.raises(TypeError, match="n must be an integer"):
        bon_kl_bound(2.5)
    assert bon_kl_bound(np.int64(4)) == bon_kl_bound(4)
