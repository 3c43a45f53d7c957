"""KL-regularised tilting: seed 000's tabular example, the KL identity, the KL search."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit.align.pmf import kl_divergence
from decodekit.align.tilt import beta_for_kl, mismatched_tilt, tilt, tilt_kl_max

# Seed 000, "The solution for a tabular model"
P = [0.50, 0.30, 0.20]
Q = [0.22, 0.11, 0.67]


def test_seed_example_alpha_one_by_hand():
    # p q = (0.110, 0.033, 0.134), Z = 0.277
    t = mismatched_tilt(P, Q, 1.0)
    np.testing.assert_allclose(t.pi, np.array([0.110, 0.033, 0.134]) / 0.277, rtol=1e-12)
    assert t.log_z == pytest.approx(math.log(0.277), abs=1e-12)
    assert t.expected_reward == pytest.approx(t.pi @ np.log(Q), abs=1e-12)  # -H(pi || q)
    assert t.kl == pytest.approx(kl_divergence(t.pi, P), abs=1e-12)


def test_mismatched_tilt_is_tilt_with_log_q():
    for alpha in (0.0, 0.5, 2.0):
        a = mismatched_tilt(P, Q, alpha)
        b = tilt(P, np.log(Q), math.inf if alpha == 0 else 1 / alpha)
        np.testing.assert_allclose(a.pi, b.pi, atol=1e-15)
    np.testing.assert_array_equal(mismatched_tilt(P, Q, 0.0).pi, P)


@pytest.mark.parametrize("target", [1e-4, 0.01, 0.1, 0.5, 1.0, 1.5, 1.6])
def test_seed_example_reaches_target_kl(target):
    beta = beta_for_kl(P, np.log(Q), target)
    t = mismatched_tilt(P, Q, 1 / beta)
    assert t.kl == pytest.approx(target, abs=1e-9)
    # KL = E_pi[r]/beta - log Z along the optimal family
    assert t.kl == pytest.approx(t.expected_reward / beta - t.log_z, abs=1e-9)


def test_kl_supremum_and_unreachable_targets():
    assert tilt_kl_max(P, np.log(Q)) == pytest.approx(-math.log(0.2))
    assert tilt_kl_max([0.5, 0.25, 0.25], [0, 1, 1]) == pytest.approx(-math.log(0.5))  # tied top
    with pytest.raises(ValueError, match=r"kl must be < 1.60944.*unreachable"):
        beta_for_kl(P, np.log(Q), -math.log(0.2))
    with pytest.raises(ValueError, match="unreachable"):
        beta_for_kl(P, np.log(Q), 3.0)
    with pytest.raises(ValueError, match="unreachable"):
        beta_for_kl([0.5, 0.5], [1.0, 1.0], 0.1)  # constant reward: the tilt is p
    assert beta_for_kl(P, np.log(Q), 0.0) == math.inf


def test_small_beta_concentrates_on_top_level():
    t = tilt([0.4, 0.2, 0.3, 0.1], [0.0, 5.0, 5.0, 1.0], 1e-6)
    np.testing.assert_allclose(t.pi, [0.0, 0.4, 0.6, 0.0], atol=1e-15)
    assert t.kl == pytest.approx(-math.log(0.5), abs=1e-12)


@st.composite
def problems(draw):
    size = draw(st.integers(2, 8))
    p = np.asarray(draw(st.lists(st.floats(0.05, 1.0), min_size=size, max_size=size)))
    r = np.asarray(draw(st.lists(st.floats(-3.0, 3.0), min_size=size, max_size=size)))
    if np.ptp(r) < 1e-3:
        r[0] += 1.0
    # A reward within 1e-3 of the best one ties it exactly: near the top of the KL range a
    # near-tie (3.0 against 2.9999999999999996, drawn once) needs a beta of ~1e-16, where
    # E[r] / beta - log Z cancels two numbers of ~1e16 and keeps no digit of the KL.
    r[(r < r.max()) & (r > r.max() - 1e-3)] = r.max()
    return p / p.sum(), r


@settings(max_examples=40, deadline=None)
@given(problems(), st.floats(0.01, 0.99))
def test_random_targets_reached_and_tilt_is_optimal(problem, fraction):
    p, r = problem
    target = fraction * tilt_kl_max(p, r)
    beta = beta_for_kl(p, r, target)
    t = tilt(p, r, beta)
    assert t.kl == pytest.approx(target, abs=1e-6)
    assert t.kl == pytest.approx(t.expected_reward / beta - t.log_z, abs=1e-8)
    # Seed 000 Lemma 1: no distribution within the same KL ball earns more reward.
    rng = np.random.default_rng(0)
    for other in rng.dirichlet(np.ones(p.size), size=200):
        mix = 0.5 * other + 0.5 * t.pi
        if kl_divergence(mix, p) <= t.kl:
            assert mix @ r <= t.expected_reward + 1e-9


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: tilt(P, [0, 1, 2], 0.0), ValueError, "beta must be a number > 0"),
        (lambda: tilt(P, [0, 1], 1.0), ValueError, r"one reward per outcome \(3\), got 2"),
        (lambda: tilt([0.5, 0.3, 0.3], [0, 1, 2], 1.0), ValueError, "p must sum to 1"),
        (lambda: mismatched_tilt(P, [0.5, 0.5], 1.0), ValueError, r"q must have one.*\(3\)"),
        (lambda: mismatched_tilt(P, [0.0, 0.5, 0.5], 1.0), ValueError, "q must be > 0"),
        (lambda: mismatched_tilt(P, Q, -1.0), ValueError, "alpha must be a number >= 0"),
        (lambda: beta_for_kl(P, [0, 1, 2], -0.1), ValueError, "kl must be a number >= 0"),
    ],
)
def test_bad_inputs(call, error, message):
    with pytest.raises(error, match=message):
        call()
