"""Speculative decoding's verification rules (REFERENCES.md; seeds 000, 002-004): given the
target's p_1..p_{γ+1}, the drafter's q_1..q_γ and the draft x_1..x_γ, how many draft tokens τ
to keep and the extra token y, so that x_1..x_τ, y has the target's distribution exactly
(token: Leviathan et al. 2023, Chen et al. 2023; block: Sun et al. 2024, Algorithm 2; greedy
at temperature 0), and the exact distribution of τ each rule gives a draft (`tau_distribution`).
decode/speculative.py runs them; bench/speculative.py and the lab compare them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from decodekit.sampling import draw
from decodekit.sampling.processors import argmax_rows

# (p [γ+1, V], q [γ, V], draft [γ] long, generator) -> (τ accepted draft tokens, extra token y)
VerifyRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], tuple[int, int]]


def draft_ratios(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """p_i(x_i) / q_i(x_i) for i = 1..γ: [γ] float64."""
    gamma = len(draft)
    px = p[:gamma].double().gather(1, draft[:, None])[:, 0]
    qx = q.double().gather(1, draft[:, None])[:, 0]
    assert bool((qx > 0).all()), "a draft token must have positive draft probability"
    return px / qx


def token_acceptance(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """h_i = min(1, p_i(x_i) / q_i(x_i)): [γ]."""
    return draft_ratios(p, q, draft).clamp(max=1.0)


def block_acceptance(
    p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sun et al. 2024, Algorithm 2: (h [γ], weights P_0..P_γ [γ + 1]).

    P_i = min(P_{i-1} p_i(x_i) / q_i(x_i), 1); for i < γ, h_i = Z_i / (Z_i + 1 - P_i) with
    Z_i = Σ_x max(P_i p_{i+1}(x) - q_{i+1}(x), 0) (Eq. 4); h_γ = P_γ. Where Z_i = 0 and
    P_i = 1 the ratio is 0/0; then P_{i+1} = 1 and some later h_j = 1, so τ > i whatever
    h_i is, and we take h_i = 0 so the empty residual is never drawn from.
    """
    gamma = len(draft)
    ratios = draft_ratios(p, q, draft)
    weights = [1.0]
    for ratio in ratios.tolist():
        weights.append(min(weights[-1] * ratio, 1.0))
    P = torch.tensor(weights, dtype=torch.float64, device=p.device)  # [γ + 1]
    Z = (P[1:gamma, None] * p[1:gamma].double() - q[1:gamma].double()).clamp(min=0).sum(-1)
    denominator = Z + 1.0 - P[1:gamma]
    h = torch.where(denominator > 0, Z / denominator.clamp(min=1e-300), 0.0)
    return torch.cat([h, P[gamma:]]), P


def residual(p_next: torch.Tensor, q_next: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    """max(weight · p - q, 0), normalised: [V] float64 (weight 1 is token verification's)."""
    mass = (weight * p_next.double() - q_next.double()).clamp(min=0)
    if float(mass.sum()) <= 0:  # p == q up to rounding: the residual is p itself
        return p_next.double() / p_next.double().sum()
    return mass / mass.sum()


def token_verify(p, q, draft, generator) -> tuple[int, int]:
    """Token verification: accept x_i while η_i < h_i; y from the residual or p_{γ+1}."""
    gamma = len(draft)
    eta = uniforms(gamma, generator, p.device)
    tau = int((eta < token_acceptance(p, q, draft)).long().cumprod(0).sum()) if gamma else 0
    if tau == gamma:
        return tau, int(draw(p[gamma], generator))
    return tau, int(draw(residual(p[tau], q[tau]), generator))


def block_verify(p, q, draft, generator) -> tuple[int, int]:
    """Block verification: τ = the last i with η_i < h_i (0 if none)."""
    gamma = len(draft)
    if gamma == 0:
        return 0, int(draw(p[0], generator))
    h, P = block_acceptance(p, q, draft)
    eta = uniforms(gamma, generator, p.device)
    hits = (eta < h).nonzero()
    tau = int(hits[-1]) + 1 if len(hits) else 0
    if tau == gamma:
        return tau, int(draw(p[gamma], generator))
    return tau, int(draw(residual(p[tau], q[tau], float(P[tau])), generator))


def uniforms(count: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """`count` float64 uniforms from the request's (CPU) generator, on `device`: the same
    draws whatever the device (sampling/select.py `draw`)."""
    return torch.rand(count, generator=generator, dtype=torch.float64, device="cpu").to(device)


def greedy_verify(p: torch.Tensor, draft: torch.Tensor) -> tuple[int, int]:
    """Temperature 0: τ = how many x_i equal the target's argmax; y = the next argmax."""
    best = argmax_rows(p)  # [γ + 1]
    tau = int((draft == best[: len(draft)]).long().cumprod(0).sum()) if len(draft) else 0
    return tau, int(best[tau])


VERIFY_RULES: dict[str, VerifyRule] = {"token": token_verify, "block": block_verify}


def tau_distribution(rule: str, p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """P(τ = i | draft) for i = 0..γ [γ + 1] under "token" (stop at the first failed coin) or
    "block" (τ = the last successful coin, h_0 = 1) verification."""
    gamma = len(draft)
    if rule == "token":
        h = torch.cat([token_acceptance(p, q, draft), p.new_zeros(1, dtype=torch.float64)])
        survive = torch.cat([p.new_ones(1, dtype=torch.float64), torch.cumprod(h[:gamma], 0)])
        return survive * (1 - h)
    if rule != "block":
        raise ValueError(f"rule must be 'token' or 'block', got {rule!r}")
    h = torch.cat([p.new_ones(1, dtype=torch.float64), block_acceptance(p, q, draft)[0]])
    fail_after = torch.flip(torch.cumprod(torch.flip(1 - h, [0]), 0), [0])  # Π_{j >= i} (1 - h_j)
    return h * torch.cat([fail_after[1:], h.new_ones(1)])


def expected_accepted(rule: str, p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> float:
    """E[τ | draft]: the accepted draft tokens a rule keeps on average for this block."""
    dist = tau_distribution(rule, p, q, draft)
    return float((dist * torch.arange(len(dist), dtype=torch.float64, device=dist.device)).sum())
