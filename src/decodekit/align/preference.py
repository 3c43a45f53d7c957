"""Pairwise preferences: Bradley–Terry scores and Elo ratings (seed 000, "Side-by-side").

Bradley–Terry: P(i beats j) = sigma(s_i - s_j). Elo: E_A = 1 / (1 + 10^((R_B - R_A)/400)).
The two are the same model on different scales, E_A = sigma((R_A - R_B) ln 10 / 400), so

    R = 400 / ln 10 * s + offset.

Comparisons are three parallel arrays: `first`, `second` (item indices) and `outcome`, the
score of `first` (1 win, 0 loss, 0.5 tie; default 1, i.e. `first` is the winner). A tie
counts half a win each way, the convention of seed 000's win rate.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "bt_probability",
    "bt_to_elo",
    "elo_expected",
    "elo_ratings",
    "elo_to_bt",
    "elo_update",
    "fit_bradley_terry",
]

ELO_SCALE = 400.0 / math.log(10.0)  # Elo points per unit of Bradley–Terry score


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))


def bt_probability(score_i, score_j):
    """P(i beats j) = sigma(s_i - s_j) under Bradley–Terry."""
    out = _sigmoid(np.subtract(score_i, score_j))
    return out if out.ndim else float(out)


def _comparisons(first, second, outcome, num_items):
    first = np.asarray(first)
    second = np.asarray(second)
    if first.ndim != 1 or first.shape != second.shape:
        raise ValueError(f"first and second must be 1-D of equal length, got shapes "
                         f"{first.shape} and {second.shape}")
    if first.size and not (np.issubdtype(first.dtype, np.integer)
                           and np.issubdtype(second.dtype, np.integer)):
        raise TypeError("first and second must hold integer item indices")
    outcome = np.ones(first.size) if outcome is None else np.asarray(outcome, dtype=np.float64)
    if outcome.shape != first.shape:
        raise ValueError(f"outcome must have one score per comparison ({first.size}), "
                         f"got shape {outcome.shape}")
    if np.any((outcome < 0) | (outcome > 1)) or not np.all(np.isfinite(outcome)):
        raise ValueError(f"outcome must be scores in [0, 1] (1 win, 0.5 tie, 0 loss), got "
                         f"{outcome[(outcome < 0) | (outcome > 1) | ~np.isfinite(outcome)][0]}")
    if num_items is None:
        num_items = int(max(first.max(initial=-1), second.max(initial=-1))) + 1
    if num_items < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items!r}")
    both = np.concatenate([first, second])
    if both.size and (both.min() < 0 or both.max() >= num_items):
        raise ValueError(f"item indices must be in [0, {num_items}), got "
                         f"{both[(both < 0) | (both >= num_items)][0]}")
    if np.any(first == second):
        raise ValueError(f"an item cannot be compared with itself, got item "
                         f"{first[first == second][0]}")
    return first.astype(np.int64), second.astype(np.int64), outcome, int(num_items)


def _strongly_connected(wins: np.ndarray) -> bool:
    """Whether every item reaches every other along "beat (or tied with)" edges."""
    edges = wins > 0  # [K, K]: i -> j when i scored against j
    for adjacency in (edges, edges.T):
        seen = np.zeros(len(wins), dtype=bool)
        seen[0], frontier = True, [0]
        while frontier:
            nxt = np.flatnonzero(adjacency[frontier].any(axis=0) & ~seen)
            seen[nxt] = True
            frontier = nxt.tolist()
        if not seen.all():
            return False
    return True


def fit_bradley_terry(first, second, outcome=None, num_items: int | None = None,
                      l2: float = 0.0, tol: float = 1e-10, max_iter: int = 100) -> np.ndarray:
    """Maximum-likelihood Bradley–Terry scores [K] with mean zero (the gauge).

    Newton's method on the concave log-likelihood sum w_ij log sigma(s_i - s_j), with
    w_ij the score i earned against j, plus an optional L2 penalty l2/2 * |s|^2 (a Gaussian
    prior). Without a penalty the maximum exists only when every item has won and lost
    within one strongly connected comparison graph (Zermelo 1929); otherwise pass l2 > 0.
    """
    first, second, outcome, k = _comparisons(first, second, outcome, num_items)
    if not (isinstance(l2, int | float) and l2 >= 0):
        raise ValueError(f"l2 must be a number >= 0, got {l2!r}")
    wins = np.zeros((k, k))  # [K, K]: score item i earned against item j
    np.add.at(wins, (first, second), outcome)
    np.add.at(wins, (second, first), 1.0 - outcome)
    games = wins + wins.T  # [K, K] comparisons between i and j
    if l2 == 0 and k > 1 and not _strongly_connected(wins):
        raise ValueError(
            "the Bradley-Terry maximum likelihood does not exist: some group of items never "
            "scored against the rest (e.g. an item that never lost or never won); pass l2 > 0"
        )

    def objective(s):
        diff = s[:, None] - s[None, :]
        return float(np.sum(wins * -np.logaddexp(0.0, -diff)) - 0.5 * l2 * s @ s)

    s = np.zeros(k)
    value = objective(s)
    centre = np.full((k, k), 1.0 / k)  # fixes the gauge: solve in the space of sum(s) = 0
    for _ in range(max_iter):
        prob = _sigmoid(s[:, None] - s[None, :])  # [K, K]: P(i beats j)
        grad = np.sum(wins - games * prob, axis=1) - l2 * s  # [K]
        if np.max(np.abs(grad)) <= tol:
            break
        curvature = games * prob * prob.T  # [K, K]
        laplacian = np.diag(curvature.sum(axis=1)) - curvature + l2 * np.eye(k)
        step = np.linalg.solve(laplacian + (centre if l2 == 0 else 0.0), grad)
        t = 1.0  # backtracking keeps each step an ascent step
        while objective(s + t * step) < value - 1e-12 * abs(value) and t > 1e-8:
            t *= 0.5
        s = s + t * step
        value = objective(s)
    return s - s.mean()


def bt_to_elo(scores, offset: float = 1000.0):
    """Elo ratings from Bradley–Terry scores: R = 400 / ln 10 * s + offset."""
    out = ELO_SCALE * np.asarray(scores, dtype=np.float64) + offset
    return out if out.ndim else float(out)


def elo_to_bt(ratings, offset: float = 1000.0):
    """Bradley–Terry scores from Elo ratings: s = (R - offset) ln 10 / 400."""
    out = (np.asarray(ratings, dtype=np.float64) - offset) / ELO_SCALE
    return out if out.ndim else float(out)


def elo_expected(rating_a, rating_b):
    """Expected score of A against B: 1 / (1 + 10^((R_B - R_A) / 400))."""
    out = 1.0 / (1.0 + np.power(10.0, (np.subtract(rating_b, rating_a)) / 400.0))
    return out if out.ndim else float(out)


def elo_update(rating_a: float, rating_b: float, score_a: float,
               k: float = 32.0) -> tuple[float, float]:
    """Ratings after one game: R_A += k (S_A - E_A), R_B += k (E_A - S_A)."""
    if not 0 <= score_a <= 1:
        raise ValueError(f"score_a must be in [0, 1] (1 win, 0.5 draw, 0 loss), got {score_a!r}")
    if not k > 0:
        raise ValueError(f"k must be > 0, got {k!r}")
    delta = k * (score_a - elo_expected(rating_a, rating_b))
    return float(rating_a + delta), float(rating_b - delta)


def elo_ratings(first, second, outcome=None, num_items: int | None = None,
                k: float = 32.0, initial: float = 1000.0) -> np.ndarray:
    """Online Elo ratings [K] after playing the comparisons in order (order matters)."""
    first, second, outcome, num = _comparisons(first, second, outcome, num_items)
    ratings = np.full(num, float(initial))
    for a, b, score in zip(first.tolist(), second.tolist(), outcome.tolist()):
        ratings[a], ratings[b] = elo_update(ratings[a], ratings[b], score, k)
    return ratings
