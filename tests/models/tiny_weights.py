"""Random weights for the tiny transformers models the parity tests compare NativeLM with."""

from __future__ import annotations

import torch


def randomize(
    model: torch.nn.Module, seed: int = 0, norm_center: float = 1.0, norm_spread: float = 0.1
) -> None:
    """Weights far from uniform attention, so a wrong mask, rotation or scale shows: each
    norm's weight norm_center + norm_spread x N(0, 1) (Gemma's (1 + w) norms: center 0), every
    other parameter 0.15 x N(0, 1), drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(norm_center + norm_spread * noise if "norm" in name else 0.15 * noise)
