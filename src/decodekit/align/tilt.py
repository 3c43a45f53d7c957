"""The KL-regularised optimum as a tilt of the base distribution (seed 000).

    max_pi E_pi[r] - beta KL(pi || p)   is solved by   pi_beta(y) = p(y) exp(r(y)/beta) / Z,

Z = E_p[exp(r/beta)], and along this family KL(pi_beta || p) = E_pi[r]/beta - log Z. With
r = log q for an "alignment distribution" q, pi_beta is seed 000's mismatched tilt
T(q, p, alpha) = p q^alpha / Z with alpha = 1/beta (Salamatian et al. 2019, Definition 1),
the unique solution of min_phi H(phi || q) subject to KL(phi || p) <= Delta (seed 000,
Lemma 1) for the alpha at which the KL equals Delta.

Seed 000's tabular example, p = (0.50, 0.30, 0.20), q = (0.22, 0.11, 0.67): see
docs/alignment.md for the tilts at several alpha and the alpha that reach a given KL.
KL(pi_beta || p) grows from 0 (beta = inf) to -log p(argmax r) (beta -> 0, all mass on the
top reward level), so targets at or above that are unreachable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from decodekit.align.pmf import check_pmf, check_rewards

__all__ = ["Tilt", "beta_for_kl", "mismatched_tilt", "tilt", "tilt_kl_max"]


@dataclass(frozen=True)
class Tilt:
    """pi [V] = p exp(r/beta) / Z with its expected reward E_pi[r], KL(pi || p) and log Z."""

    beta: float
    pi: np.ndarray
    expected_reward: float
    kl: float
    log_z: float


def _check_beta(beta) -> float:
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not beta > 0:
        raise ValueError(f"beta must be a number > 0 (inf = no tilt), got {beta!r}")
    return float(beta)


def _tilt(p: np.ndarray, r: np.ndarray, beta: float) -> Tilt:
    support = p > 0
    if math.isinf(beta):
        return Tilt(beta, p.copy(), float(p @ r), 0.0, 0.0)
    # log(pi/p) = (r - r_max)/beta - log Z', with Z' = E_p exp((r - r_max)/beta) <= 1, so
    # nothing overflows for small beta and the KL does not cancel two large numbers.
    r_top = r[support].max()
    shifted = np.where(support, (r - r_top) / beta, -np.inf)  # [V]
    with np.errstate(divide="ignore"):
        logits = np.log(p) + shifted
    log_z_shifted = float(np.logaddexp.reduce(logits))
    log_ratio = shifted - log_z_shifted  # [V]: log(pi / p)
    pi = np.where(support, np.exp(logits - log_z_shifted), 0.0)
    kl = float(np.sum(pi[support] * log_ratio[support]))
    return Tilt(beta, pi, float(pi @ r), max(kl, 0.0), float(log_z_shifted + r_top / beta))


def tilt(p, r, beta: float) -> Tilt:
    """The KL-regularised optimum pi_beta ∝ p exp(r/beta) for beta in (0, inf]."""
    p = check_pmf(p)
    return _tilt(p, check_rewards(r, p.size), _check_beta(beta))


def _log_q(p: np.ndarray, q) -> np.ndarray:
    q = check_pmf(q, "q")
    if q.size != p.size:
        raise ValueError(f"q must have one probability per outcome of p ({p.size}), got {q.size}")
    if np.any((q == 0) & (p > 0)):
        raise ValueError("q must be > 0 wherever p > 0 (r = log q must be finite)")
    with np.errstate(divide="ignore"):
        return np.where(q > 0, np.log(q), 0.0)


def mismatched_tilt(p, q, alpha: float) -> Tilt:
    """Seed 000's T(q, p, alpha) = p q^alpha / Z: the tilt with r = log q, beta = 1/alpha.

    `expected_reward` is then E_pi[log q] = -H(pi || q), the negative cross-entropy.
    """
    p = check_pmf(p)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha >= 0:
        raise ValueError(f"alpha must be a number >= 0, got {alpha!r}")
    beta = math.inf if alpha == 0 else 1.0 / alpha
    return _tilt(p, _log_q(p, q), _check_beta(beta))


def tilt_kl_max(p, r) -> float:
    """sup_beta KL(pi_beta || p) = -log p(r = max r): the limit beta -> 0."""
    p = check_pmf(p)
    r = check_rewards(r, p.size)
    support = p > 0
    return float(-math.log(p[support & (r == r[support].max())].sum()))


def beta_for_kl(p, r, kl: float, tol: float = 1e-9) -> float:
    """The beta whose tilt has KL(pi_beta || p) = kl (within tol), by bisection.

    Returns inf for kl = 0. KL is increasing in alpha = 1/beta, so the search brackets
    alpha by doubling and bisects on it. For the mismatched tilt use r = log q and take
    alpha = 1/beta. Raises ValueError when kl is not in [0, -log p(argmax r)).
    """
    p = check_pmf(p)
    r = check_rewards(r, p.size)
    if not isinstance(tol, int | float) or not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol!r}")
    if isinstance(kl, bool) or not isinstance(kl, int | float) or math.isnan(kl) or kl < 0:
        raise ValueError(f"kl must be a number >= 0, got {kl!r}")
    if kl == 0:
        return math.inf
    kl_max = tilt_kl_max(p, r)
    if kl >= kl_max:
        raise ValueError(
            f"kl must be < {kl_max:.6g} = -log p(argmax r) for this p and r (the KL of "
            f"the tilt as beta -> 0), got {kl!r}: the target is unreachable"
        )
    spread = float(np.ptp(r[p > 0]))  # > 0 here, since kl_max > 0

    def kl_at(alpha: float) -> float:
        return _tilt(p, r, 1.0 / alpha).kl

    lo, hi = 0.0, 1.0 / spread  # alpha bracket; kl_at(0) = 0 < kl
    while kl_at(hi) < kl:
        lo, hi = hi, 2.0 * hi
        if hi > 1e300:
            raise ValueError(f"kl={kl!r} is too close to its supremum {kl_max!r} to reach")
    for _ in range(2000):
        mid = 0.5 * (lo + hi)
        value = kl_at(mid)
        if abs(value - kl) <= tol or mid in (lo, hi):
            return 1.0 / mid
        lo, hi = (mid, hi) if value < kl else (lo, mid)
    raise AssertionError("bisection did not converge")  # unreachable: 2000 halvings
