"""The layer-wise Hessian shared by GPTQ and SparseGPT.

Seed 000 ("Optimal brain surgeon for pruning and quantization") compresses one layer
at a time under the loss ||W X - Ŵ X||², whose Hessian with respect to a row of W is
H = 2 X Xᵀ, the same for every row. Both algorithms need the upper Cholesky factor U
of H⁻¹ (Frantar et al., GPTQ, 2022, Sec. 3 "Cholesky reformulation"): row i of U,
divided by U[i, i], is the optimal-brain-surgeon update of the columns after i once
columns < i have been fixed, and U[i, i]² = [H_F⁻¹]_ii for the remaining set F.
"""

from __future__ import annotations

import torch


class HessianAccumulator:
    """Running H = (2 / n) Σ x xᵀ over the n input rows a linear layer has seen.

    The 1/n normalisation (as in the GPTQ reference code) keeps H's scale independent of
    the amount of calibration data; it changes nothing else because damping is relative.
    """

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.hessian = torch.zeros(in_features, in_features, device=device)  # [K, K] float32
        self.count = 0

    def add(self, inputs: torch.Tensor) -> None:
        """Add a batch of layer inputs [..., K] (every leading position is one sample)."""
        x = inputs.detach().reshape(-1, inputs.shape[-1]).to(self.hessian.device, torch.float32)
        if x.shape[1] != self.hessian.shape[0]:
            raise ValueError(
                f"inputs have {x.shape[1]} features, the layer has {self.hessian.shape[0]}"
            )
        n = x.shape[0]
        total = self.count + n
        self.hessian.mul_(self.count / total)
        self.hessian.addmm_(x.T, x, alpha=2.0 / total)
        self.count = total


def hessian_from_inputs(inputs: torch.Tensor) -> torch.Tensor:
    """H = (2 / n) X Xᵀ for inputs [n, K] given as rows (one sample per row). Returns [K, K]."""
    acc = HessianAccumulator(inputs.shape[-1], inputs.device)
    acc.add(inputs)
    return acc.hessian


def dead_columns(hessian: torch.Tensor) -> torch.Tensor:
    """Input features that were always zero in calibration (H_ii = 0). Returns [K] bool."""
    return hessian.diagonal() == 0


def inverse_hessian_cholesky(hessian: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Upper Cholesky factor U of (H + λI)⁻¹ with λ = damp · mean(diag H). Returns [K, K].

    Dead features get H_ii = 1 (their weights are zeroed by the caller), as in the GPTQ
    reference. If H is still not positive definite the damping grows tenfold, at most
    five times, before giving up.
    """
    if damp < 0:
        raise ValueError(f"damp must be >= 0, got {damp}")
    h = hessian.to(torch.float32).clone()
    dead = dead_columns(h)
    h[dead, dead] = 1.0
    mean_diag = h.diagonal().mean().item()
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    lam = damp * mean_diag
    for _ in range(6):
        lower, info = torch.linalg.cholesky_ex(h + lam * eye)
        if info.item() == 0:
            h_inv = torch.cholesky_inverse(lower)  # (H + λI)⁻¹
            upper, info = torch.linalg.cholesky_ex(h_inv, upper=True)
            if info.item() == 0:
                return upper
        lam = max(10.0 * lam, 1e-6 * mean_diag)
    raise ValueError("calibration Hessian is not positive definite even with extra damping")
