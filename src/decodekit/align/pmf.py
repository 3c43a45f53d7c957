"""Discrete distributions for the alignment calculators: validation, reward levels, KL.

Every calculator in `align/` takes a base distribution `p` over a finite set of outcomes
and a reward `r` per outcome as 1-D array-likes. They are validated here once, so that
bad input raises a `ValueError` naming the value and what is allowed (STYLE.md, rule 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Probabilities may sum to 1 up to this tolerance; they are then renormalised exactly.
SUM_TOLERANCE = 1e-6


def check_pmf(p, name: str = "p") -> np.ndarray:
    """A probability vector as float64 [V]: finite, >= 0, summing to 1 within 1e-6."""
    arr = np.asarray(p, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D list of probabilities, got shape "
                         f"{arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must contain finite probabilities, got {arr.tolist()}")
    if np.any(arr < 0):
        bad = arr[arr < 0][0]
        raise ValueError(f"{name} must contain probabilities >= 0, got {bad!r} in {name}")
    total = float(arr.sum())
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise ValueError(f"{name} must sum to 1 (within {SUM_TOLERANCE:g}), got sum {total!r}")
    return arr / total


def check_rewards(r, size: int, name: str = "r") -> np.ndarray:
    """Rewards as float64 [V], finite, one per outcome of the base distribution."""
    arr = np.asarray(r, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D list of rewards, got shape {arr.shape}")
    if arr.size != size:
        raise ValueError(f"{name} must have one reward per outcome ({size}), got {arr.size}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must contain finite rewards, got {arr.tolist()}")
    return arr


@dataclass(frozen=True)
class RewardLevels:
    """Outcomes of p grouped by reward value, over the support of p only.

    values [L]: the distinct rewards in increasing order; mass [L]: the base mass of each
    level; below [L] / above [L]: the mass strictly below / strictly above it; level [V]:
    each outcome's level index (-1 where p is 0). In seed 000's notation ("The PMF of
    best-of-n") F^-(y) = below and F(y) = below + mass = 1 - above; keeping both sides
    lets F be accurate near 0 and near 1.
    """

    values: np.ndarray
    mass: np.ndarray
    below: np.ndarray
    above: np.ndarray
    level: np.ndarray


def reward_levels(p: np.ndarray, r: np.ndarray) -> RewardLevels:
    """Group the outcomes of a validated p by their reward r."""
    support = p > 0
    values, inverse = np.unique(r[support], return_inverse=True)
    mass = np.bincount(inverse, weights=p[support], minlength=values.size)  # [L]
    below = np.concatenate([[0.0], np.cumsum(mass)[:-1]])  # [L]
    above = np.concatenate([np.cumsum(mass[::-1])[::-1][1:], [0.0]])  # [L]
    level = np.full(p.shape, -1, dtype=np.int64)
    level[support] = inverse
    return RewardLevels(values, mass, below, above, level)


def kl_divergence(pi, p) -> float:
    """KL(pi || p) in nats for two probability vectors; inf when pi is not dominated by p."""
    pi = np.asarray(pi, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    mask = pi > 0
    if np.any(p[mask] == 0):
        return float("inf")
    return float(np.sum(pi[mask] * (np.log(pi[mask]) - np.log(p[mask]))))
