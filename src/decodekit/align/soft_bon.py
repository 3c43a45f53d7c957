"""Soft best-of-n: draw n samples of p, return sample i with probability ∝ exp(r_i / lam).

lam -> 0 is best-of-n (ties broken uniformly), lam = inf is plain sampling from p; in
between it trades reward for KL more smoothly than best-of-n (Verdun et al. 2025,
"Soft best-of-n sampling"). `soft_bon_sample` is the policy used at generation time;
`soft_bon_pmf` is its exact output distribution for a discrete p.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from decodekit.align.bon import bon_pmf
from decodekit.align.pmf import check_pmf, check_rewards, reward_levels
from decodekit.sampling import draw
from decodekit.validate import check_n

__all__ = ["soft_bon_pmf", "soft_bon_sample"]

# Trapezoidal step in log t for the integral in `soft_bon_pmf`. The integrand is analytic
# in a strip |Im s| < pi/2 and decays fast on both sides, so the trapezoidal error falls
# like exp(-pi^2 / step): 0.05 is far below float64 rounding.
_LOG_T_STEP = 0.05


def _check_lam(lam) -> float:
    if isinstance(lam, bool) or not isinstance(lam, int | float) or math.isnan(lam) or lam < 0:
        raise ValueError(f"lam must be a number >= 0 (0 = best-of-n, inf = no selection), "
                         f"got {lam!r}")
    return float(lam)


def soft_bon_sample(rewards, lam: float, generator: torch.Generator | None = None):
    """Index of the chosen candidate: rewards [..., n] -> long tensor [...].

    Picks i with probability softmax(r / lam)_i; lam = 0 picks uniformly among the maximal
    rewards (best-of-n with uniform tie-breaking), lam = inf uniformly among all n.
    """
    lam = _check_lam(lam)
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.ndim == 0 or r.shape[-1] == 0:
        raise ValueError(f"rewards must have shape [..., n] with n >= 1, got {tuple(r.shape)}")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite")
    flat = r.reshape(-1, r.shape[-1])  # [B, n]
    if lam == 0:
        top = flat == flat.max(dim=-1, keepdim=True).values
        logits = torch.where(top, 0.0, -math.inf)
    elif math.isinf(lam):
        logits = torch.zeros_like(flat)
    else:
        logits = flat / lam
    probs = torch.softmax(logits, dim=-1)  # [B, n]
    index = draw(probs, generator)  # [B]
    return index.reshape(r.shape[:-1])


def soft_bon_pmf(p, r, n: int, lam: float) -> np.ndarray:
    """Exact output distribution [V] of soft best-of-n over a discrete p.

    With weights w = exp(r / lam) and S the sum of the other n-1 weights,
    pi(y) = n p(y) E[w(y) / (w(y) + S)]. Writing 1/x = ∫_0^inf e^{-tx} dt gives

        pi(y) = n p(y) ∫_0^inf w(y) e^{-t w(y)} M(t)^{n-1} dt,   M(t) = E_{z~p} e^{-t w(z)},

    a one-dimensional integral, computed by the trapezoidal rule in s = log t, where
    w e^{-tw} dt = exp(x - e^x) ds with x = s + log w: a bump of width ~1 around
    s = -log w(y). Working with log w keeps rewards far apart (r / lam ~ 1e4) exact.
    Absolute error below n * 1e-19 per outcome.
    """
    p = check_pmf(p)
    r = check_rewards(r, p.size)
    n = check_n(n)
    lam = _check_lam(lam)
    if lam == 0:
        return bon_pmf(p, r, n)
    if math.isinf(lam) or n == 1:
        return p.copy()
    lv = reward_levels(p, r)
    log_w = (lv.values - lv.values[-1]) / lam  # [L], <= 0, increasing
    # exp(x - e^x) < e^-45 for x < -45 and < e^-140 for x > 5: integrate each level over
    # s in [-log w - 45, -log w + 5], merged into segments where windows overlap. Each
    # segment is laid out around its first level k (x = local + (r - r_k) / lam), so that
    # far-apart rewards (r / lam ~ 1e7) keep their differences exact.
    segments: list[tuple[int, float]] = []  # (reference level k, local end)
    for k in range(log_w.size - 1, -1, -1):
        if segments:
            ref, end = segments[-1]
            offset = (lv.values[ref] - lv.values[k]) / lam  # -log w_k relative to ref
            if offset - 45.0 <= end:
                segments[-1] = (ref, offset + 5.0)
                continue
        segments.append((k, 5.0))
    ratio = np.zeros_like(log_w)  # [L]: pi(y) / p(y) for each level
    for ref, end in segments:
        local = np.linspace(-45.0, end, int(math.ceil((end + 45.0) / _LOG_T_STEP)) + 1)  # [G]
        x = local[:, None] + ((lv.values - lv.values[ref]) / lam)[None, :]  # [G, L]: log(tw)
        with np.errstate(over="ignore", divide="ignore"):
            tw = np.exp(x)
            log_m = np.log(np.exp(-tw) @ lv.mass)  # [G]
            integrand = np.exp(x - tw + (n - 1) * log_m[:, None])  # [G, L]
        step = local[1] - local[0]
        ratio += n * step * (integrand.sum(axis=0) - 0.5 * (integrand[0] + integrand[-1]))
    return np.where(lv.level >= 0, p * ratio[np.maximum(lv.level, 0)], 0.0)
