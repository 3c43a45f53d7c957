"""Weight quantisation: seed 000's clip-and-round, and GPTQ.

Seed 000 ("Standard post-training quantization"): clip the outliers, then quantise all
values to equally spaced bins. Its worked example clips to [-2, 2] and rounds to
{-2, -1, 0, 1, 2}, with 0.5 -> 1, so rounding is half away from zero (`round_half_away`;
`torch.round` rounds half to even and would give 0).

The integer grid the codes live on (`QuantSpec`: symmetric, one scale per channel or per
group), round-to-nearest absmax quantisation (`quantize_rtn`) and `dequantize` are
models/qlinear.py's, beside the `QuantizedLinear` layer that stores them, so that loading
a compressed model needs nothing from this package.

GPTQ (Frantar et al., 2022) is seed 000's optimal-brain-quantisation loop made fast:
columns are quantised in a fixed order, and the rounding error of column i is spread
over the columns after it through row i of U = chol(H⁻¹)ᵀ (hessian.py); updates are
applied lazily, one block of `block_size` columns at a time.
"""

from __future__ import annotations

import torch

from decodekit.compress.hessian import dead_columns, inverse_hessian_cholesky
from decodekit.models.quant_grid import QuantSpec, absmax_scales, round_half_away, scale_from_absmax


def clip_round(x: torch.Tensor, clip: float, step: float = 1.0) -> torch.Tensor:
    """Seed 000's post-training quantisation: clip to [-clip, clip], round to multiples of step."""
    if clip <= 0 or step <= 0:
        raise ValueError(f"clip and step must be > 0, got clip={clip}, step={step}")
    return round_half_away(x.clamp(-clip, clip) / step) * step


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: QuantSpec,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ: quantise weight [N, K] minimising ||W X - Ŵ X||² for H = 2 X Xᵀ [K, K].

    Returns codes int8 [N, K] and scales [N, G] in the original column order, so
    `dequantize` and `QuantizedLinear` treat them exactly like round-to-nearest output.

    - damp: λ = damp · mean(diag H) is added to H's diagonal (GPTQ uses 1 %).
    - act_order: quantise columns in order of decreasing H_ii (GPTQ's "act-order").
    - Scales: per channel they come from the whole row before the loop (as the GPTQ
      reference does). With groups and no act_order, a group's scale is taken when the
      loop reaches the group's first column, from the weights updated so far. With
      groups and act_order, the scales are fixed from the original weights before the
      loop ("static groups"), so every column keeps the scale of its own group and the
      codes need no group index.
    """
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(
            f"hessian must be [{k}, {k}] for weight [{n}, {k}], got {tuple(hessian.shape)}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    groups = spec.num_groups(k)
    group = k // groups
    qmax = spec.qmax
    hessian = hessian.to(weight.device)
    w_all = weight.detach().to(torch.float32).clone()  # [N, K]
    w_all[:, dead_columns(hessian)] = 0.0
    scales = absmax_scales(w_all, spec)  # [N, G]
    dynamic_groups = spec.group_size is not None and not act_order
    if dynamic_groups:
        # Blocks hold whole groups, so a group's columns are all up to date at its start.
        block_size = max(group, block_size // group * group)

    diagonal = hessian.diagonal()
    perm = torch.arange(k, device=diagonal.device)
    if act_order:
        perm = torch.argsort(diagonal, descending=True, stable=True)
    w_all = w_all[:, perm]
    u = inverse_hessian_cholesky(hessian[perm][:, perm], damp)  # [K, K] upper
    column_group = perm // group  # [K] group (scale column) of each permuted column
    codes = torch.zeros(n, k, dtype=torch.int8, device=w_all.device)

    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w_block = w_all[:, i1:i2].clone()  # [N, b]
        err_block = torch.zeros_like(w_block)  # [N, b] scaled errors, for the lazy update
        u_block = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if dynamic_groups and col % group == 0:
                absmax = w_block[:, i : i + group].abs().amax(-1)
                scales[:, col // group] = scale_from_absmax(absmax, qmax)
            s = scales[:, column_group[col]]  # [N]
            w = w_block[:, i]
            q = round_half_away(w / s).clamp(-qmax, qmax)
            codes[:, col] = q.to(torch.int8)
            err = (w - q * s) / u_block[i, i]
            # OBS update of the remaining columns of this block (seed 000's
            # w <- w - H⁻¹_{:,p} (w_p - q(w_p)) / [H⁻¹]_pp in Cholesky form).
            w_block[:, i:] -= err.unsqueeze(1) * u_block[i, i:].unsqueeze(0)
            err_block[:, i] = err
        # Lazy batch update: the columns after this block get all its updates at once.
        w_all[:, i2:] -= err_block @ u[i1:i2, i2:]

    inverse = torch.argsort(perm)
    return codes[:, inverse], scales
