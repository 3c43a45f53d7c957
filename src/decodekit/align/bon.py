"""Best-of-n theory for a discrete base distribution (seed 000, "Best-of-n" sections).

Best-of-n draws y_1..y_n i.i.d. from the base policy p and returns the one with the
highest reward r, ties broken uniformly at random. Everything here is exact for a finite
outcome set, computed per reward level (outcomes with equal reward), with

    F(y) = P_{z~p}[r(z) <= r(y)],    F^-(y) = P_{z~p}[r(z) < r(y)].

- PMF: pi_n(y) = p(y) (F^n - F^-^n) / (F - F^-)   (= F^n - F^-^n when rewards are distinct)
- KL(pi_n || p) <= log n - (n-1)/n               (seed 000, Theorem 2; the "popular formula"
  that Stiennon et al. 2020 and Hilton & Gao 2022 quote as exact is only this bound)
- win rate = 1 - 1/2 E_{y~p}[F^n + F^-^n] <= n/(n+1)   (seed 000, Lemma 1; ties count 1/2)

Because pi_n(y)/p(y) depends on y only through its reward level, KL and win rate depend
only on the distribution of the reward under p; that is what the Monte Carlo versions
(`bon_kl_mc`, `bon_win_rate_mc`) exploit: they are the exact values for the empirical
reward distribution of base samples. Soft best-of-n lives in `align/soft_bon.py`.
"""

from __future__ import annotations

import math

import numpy as np

from decodekit.align.pmf import RewardLevels, check_pmf, check_rewards, reward_levels
from decodekit.validate import check_n

__all__ = [
    "blockwise_kl_bound",
    "bon_kl",
    "bon_kl_bound",
    "bon_kl_estimate",
    "bon_kl_max",
    "bon_kl_mc",
    "bon_n_for_kl",
    "bon_pmf",
    "bon_win_rate",
    "bon_win_rate_bound",
    "bon_win_rate_mc",
]


def _levels(p, r) -> tuple[np.ndarray, RewardLevels]:
    p = check_pmf(p)
    return p, reward_levels(p, check_rewards(r, p.size))


def _log_cdfs(lv: RewardLevels) -> tuple[np.ndarray, np.ndarray]:
    """log F and log F^- per level [L], each from whichever side is accurate."""
    # np.where evaluates both sides; the unused one may see 1 - (1 + rounding) < 0.
    with np.errstate(divide="ignore", invalid="ignore"):
        at_most = lv.below + lv.mass  # F
        log_f = np.where(at_most < 0.5, np.log(at_most), np.log1p(-lv.above))
        log_g = np.where(lv.below < 0.5, np.log(lv.below), np.log1p(-(lv.above + lv.mass)))
    return log_f, log_g  # [L], [L]; log_g = -inf on the lowest level


def _log_ratio(lv: RewardLevels, n: int) -> np.ndarray:
    """log(pi_n(y) / p(y)) per level [L] = log((F^n - F^-^n) / (F - F^-)).

    F^n - F^-^n = F^n (1 - (1 - mass/F)^n); expm1/log1p keep it accurate when a level's
    mass is tiny compared to F or n is large.
    """
    log_f, _ = _log_cdfs(lv)
    f = lv.below + lv.mass
    with np.errstate(divide="ignore"):
        tail = -np.expm1(n * np.log1p(-lv.mass / f))  # 1 - (F^-/F)^n, in (0, 1]
    return n * log_f + np.log(tail) - np.log(lv.mass)


def bon_pmf(p, r, n: int) -> np.ndarray:
    """Exact best-of-n PMF [V] over the outcomes of p, ties broken uniformly."""
    p, lv = _levels(p, r)
    n = check_n(n)
    ratio = np.exp(_log_ratio(lv, n))  # [L]
    return np.where(lv.level >= 0, p * ratio[np.maximum(lv.level, 0)], 0.0)


def _kl(lv: RewardLevels, n: int) -> float:
    log_ratio = _log_ratio(lv, n)  # [L]; pi_n / p is constant within a level
    return float(max(np.sum(lv.mass * np.exp(log_ratio) * log_ratio), 0.0))


def bon_kl(p, r, n: int) -> float:
    """Exact KL(pi_n || p) in nats."""
    _, lv = _levels(p, r)
    return _kl(lv, check_n(n))


def bon_kl_max(p, r) -> float:
    """sup_n KL(pi_n || p) = -log p(top reward level): best-of-infinity keeps only the top."""
    _, lv = _levels(p, r)
    return float(-math.log(lv.mass[-1])) if lv.mass.size > 1 else 0.0  # -log 1 = 0 anyway


def bon_kl_bound(n: int) -> float:
    """log n - (n-1)/n: an upper bound on KL(pi_n || p), equal only for continuous rewards."""
    n = check_n(n)
    return math.log(n) - (n - 1) / n


def blockwise_kl_bound(num_blocks: int, k: int) -> float:
    """KL bound for blockwise best-of-k (controlled decoding, seed 000 "best-of-n++").

    Not stated in seed 000: it follows from the chain rule of KL. Conditioned on the prefix,
    each block is a best-of-k draw over p(block | prefix) scored by the value function, so
    its conditional KL is at most log k - (k-1)/k; the sequence KL is the sum over blocks.
    """
    return check_n(num_blocks, "num_blocks") * bon_kl_bound(k)


def bon_kl_estimate(eps, n: int):
    """Seed 000's estimator D^(eps) of KL(pi_n || p) from eps = p(y) of the selected y.

        D^ = (1-eps)^n (log n + (n-1) log(1-eps) - (n-1)/n)
             + (1 - (1-eps)^n) log((1 - (1-eps)^n) / eps)

    eps may be an array (one value per selected sample); average the result over samples.
    It decreases from the bound (eps -> 0) to 0 (eps = 1).
    """
    n = check_n(n)
    e = np.asarray(eps, dtype=np.float64)
    if not np.all((e > 0) & (e <= 1)):
        raise ValueError(f"eps must be probabilities in (0, 1], got {e.tolist()}")
    with np.errstate(divide="ignore", invalid="ignore"):
        log_a = n * np.log1p(-e)  # log (1-eps)^n, -inf at eps = 1
        a = np.exp(log_a)
        one_minus_a = -np.expm1(log_a)
        head = a * (math.log(n) + (n - 1) * np.log1p(-e) - (n - 1) / n)
        head = np.where(e < 1, head, 0.0)  # (1-eps)^n log(1-eps) -> 0 as eps -> 1
        out = head + one_minus_a * (np.log(one_minus_a) - np.log(e))
    return out if out.ndim else float(out)


def bon_win_rate(p, r, n: int) -> float:
    """Exact win rate of pi_n against p: P[r(y) > r(z)] + 1/2 P[r(y) = r(z)], y~pi_n, z~p.

    = 1 - 1/2 E_{z~p}[F(z)^n + F^-(z)^n] (seed 000, Lemma 1): best-of-n loses to z when all
    n draws are below r(z), and ties with it half of the time when the best equals r(z).
    """
    _, lv = _levels(p, r)
    n = check_n(n)
    log_f, log_g = _log_cdfs(lv)
    lose = 0.5 * np.sum(lv.mass * (np.exp(n * log_f) + np.exp(n * log_g)))
    return float(1.0 - lose)


def bon_win_rate_bound(n: int) -> float:
    """n / (n+1): the win rate of best-of-n when no two outcomes tie."""
    n = check_n(n)
    return n / (n + 1)


def bon_n_for_kl(kl: float, p=None, r=None, n_max: int = 2**50) -> int:
    """The smallest n whose best-of-n KL reaches `kl` nats.

    With p and r, the exact KL(pi_n || p) is used (it is nondecreasing in n and tends to
    -log p(top level), which a target must stay below); without them, the bound
    log n - (n-1)/n, which gives the fewest samples any base distribution needs.
    n - 1 is then the largest n that stays strictly under a KL budget of `kl`.
    """
    if isinstance(kl, bool) or not isinstance(kl, int | float) or math.isnan(kl) or kl < 0:
        raise ValueError(f"kl must be a number >= 0, got {kl!r}")
    if (p is None) != (r is None):
        raise ValueError("p and r must be given together (or neither, to use the bound)")
    if p is None:
        kl_of = bon_kl_bound
    else:
        _, lv = _levels(p, r)
        kl_max = -math.log(lv.mass[-1])
        if kl >= kl_max:
            raise ValueError(
                f"kl must be < {kl_max:.6g} = -log p(top reward level) for this p and r, "
                f"got {kl!r}: best-of-n never reaches it"
            )

        def kl_of(m: int) -> float:
            return _kl(lv, m)

    if kl_of(1) >= kl:
        return 1
    lo, hi = 1, 2  # kl_of(lo) < kl; grow hi until kl_of(hi) >= kl, then bisect
    while kl_of(hi) < kl:
        lo, hi = hi, hi * 2
        if hi > n_max:
            raise ValueError(f"kl={kl!r} needs n > n_max={n_max}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kl_of(mid) < kl else (lo, mid)
    return hi


def _empirical(rewards) -> tuple[np.ndarray, np.ndarray]:
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 1 or rewards.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D array, got shape {rewards.shape}")
    return np.full(rewards.size, 1.0 / rewards.size), rewards


def bon_kl_mc(rewards, n: int) -> float:
    """KL(pi_n || p) estimated from the rewards of i.i.d. samples of p (plug-in).

    The exact best-of-n KL of the empirical reward distribution: consistent as the number
    of samples grows; with continuous rewards it approaches log n - (n-1)/n from below.
    """
    return bon_kl(*_empirical(rewards), n)


def bon_win_rate_mc(rewards, n: int) -> float:
    """Win rate of best-of-n against p from the rewards of i.i.d. samples of p (plug-in)."""
    return bon_win_rate(*_empirical(rewards), n)
