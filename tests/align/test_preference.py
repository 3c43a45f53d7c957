"""Bradley–Terry fitting and Elo ratings."""

from __future__ import annotations

import math

import numpy as np
import pytest

from decodekit.align.preference import (
    bt_probability,
    bt_to_elo,
    elo_expected,
    elo_ratings,
    elo_to_bt,
    elo_update,
    fit_bradley_terry,
)


def test_two_items_closed_form():
    # A beats B 3 times out of 4: the MLE has sigma(s_A - s_B) = 3/4, s_A - s_B = log 3
    s = fit_bradley_terry([0, 0, 0, 1], [1, 1, 1, 0])
    np.testing.assert_allclose(s, [math.log(3) / 2, -math.log(3) / 2], atol=1e-9)
    # ties count half a win each way: 1 win each and 2 ties -> equal scores
    s = fit_bradley_terry([0, 1, 0, 1], [1, 0, 1, 0], [1.0, 1.0, 0.5, 0.5])
    np.testing.assert_allclose(s, [0.0, 0.0], atol=1e-12)


def test_recovers_planted_scores():
    rng = np.random.default_rng(0)
    true = np.array([-1.2, -0.4, 0.0, 0.5, 1.1])
    true -= true.mean()
    m = 20000
    first = rng.integers(0, 5, m)
    second = (first + rng.integers(1, 5, m)) % 5  # never the same item
    outcome = (rng.random(m) < bt_probability(true[first], true[second])).astype(float)
    s = fit_bradley_terry(first, second, outcome)
    assert s.mean() == pytest.approx(0.0, abs=1e-12)
    np.testing.assert_allclose(s, true, atol=0.08)  # standard error about 0.03 per item


def test_stationarity_of_the_fit():
    # at the MLE each item's observed wins equal its expected wins
    first, second = [0, 1, 2, 0, 2, 1, 1], [1, 2, 0, 2, 1, 0, 2]
    s = fit_bradley_terry(first, second)
    wins, expected = np.zeros(3), np.zeros(3)
    for a, b in zip(first, second):
        wins[a] += 1
        expected[a] += bt_probability(s[a], s[b])
        expected[b] += bt_probability(s[b], s[a])
    np.testing.assert_allclose(wins, expected, atol=1e-8)


def test_nonexistent_mle_needs_l2():
    with pytest.raises(ValueError, match="never scored against the rest.*l2 > 0"):
        fit_bradley_terry([0, 0, 1], [1, 2, 2])  # item 0 never lost
    s = fit_bradley_terry([0, 0, 1], [1, 2, 2], l2=0.5)
    assert s[0] > s[1] > s[2]
    # the penalised optimum for one game: sigma(-2x) = l2 x with s = (x, -x)
    x = fit_bradley_terry([0], [1], l2=1.0)[0]
    assert 0.5 * (1 - math.tanh(x)) == pytest.approx(x, abs=1e-9)


def test_elo_expected_score_formula():
    assert elo_expected(1600, 1400) == pytest.approx(1 / (1 + 10 ** (-0.5)), abs=1e-15)
    assert elo_expected(1500, 1500) == 0.5
    np.testing.assert_allclose(elo_expected([1400, 1800], 1600), [1 / (1 + 10**0.5), 1 / (1 + 10**-0.5)])


def test_elo_and_bt_are_one_model_on_two_scales():
    scores = np.array([-0.7, 0.1, 1.3])
    ratings = bt_to_elo(scores, offset=1500)
    assert ratings[1] - ratings[0] == pytest.approx(0.8 * 400 / math.log(10))
    np.testing.assert_allclose(elo_to_bt(ratings, offset=1500), scores, atol=1e-12)
    assert elo_expected(ratings[2], ratings[0]) == pytest.approx(
        bt_probability(scores[2], scores[0]), abs=1e-14
    )


def test_elo_updates_by_hand():
    assert elo_update(1500, 1500, 1.0, k=32) == (1516.0, 1484.0)
    assert elo_update(1500, 1500, 0.5, k=32) == (1500.0, 1500.0)
    # game 1: 0 beats 1 -> (1016, 984); game 2: 1 beats 0 with E_1 = 1/(1 + 10^(32/400))
    ratings = elo_ratings([0, 1], [1, 0], num_items=2, k=32)
    delta = 32 * (1 - 1 / (1 + 10 ** (32 / 400)))
    np.testing.assert_allclose(ratings, [1016 - delta, 984 + delta], atol=1e-12)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: fit_bradley_terry([0, 1], [1]), ValueError, "equal length"),
        (lambda: fit_bradley_terry([0], [1], [1.5]), ValueError, r"outcome must be .*\[0, 1\]"),
        (lambda: fit_bradley_terry([0], [3], num_items=2), ValueError, r"in \[0, 2\), got 3"),
        (lambda: fit_bradley_terry([1], [1]), ValueError, "compared with itself, got item 1"),
        (lambda: fit_bradley_terry([0.5], [1.0]), TypeError, "integer item indices"),
        (lambda: fit_bradley_terry([0], [1], l2=-1.0), ValueError, "l2 must be a number >= 0"),
        (lambda: elo_update(1500, 1500, 2.0), ValueError, r"score_a must be in \[0, 1\]"),
        (lambda: elo_update(1500, 1500, 1.0, k=0.0), ValueError, "k must be > 0"),
    ],
)
def test_bad_inputs(call, error, message):
    with pytest.raises(error, match=message):
        call()
