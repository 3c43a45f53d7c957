"""Weight pruning: magnitude (unstructured and n:m) and SparseGPT.

Seed 000 ("Magnitude based pruning"): drop the weights closest to zero. Its optimal
brain surgeon slides show why that is crude: pruning w_p should pick the p with the
smallest w_p² / [H⁻¹]_pp and move the other weights by -H⁻¹_{:,p} w_p / [H⁻¹]_pp;
with H = I both are magnitude pruning. SparseGPT (Frantar & Alistarh, 2023) runs that
update column by column with the same Cholesky machinery as GPTQ (hessian.py), choosing
the mask adaptively: at the start of each block of `block_size` columns (unstructured)
or of each group of m columns (n:m), it prunes the weights with the lowest
w² / U_jj², where U = chol(H⁻¹)ᵀ, among the weights as updated so far; U_jj² is
[H_F⁻¹]_jj for F the columns >= j, so this is seed 000's saliency w_p² / [H⁻¹]_pp.

n:m sparsity here means n zeros in every m consecutive weights of a row (along the
input dimension): "2:4" keeps 2 of every 4, the pattern sparse tensor cores run.
"""

from __future__ import annotations

import torch

from decodekit.compress.hessian import dead_columns, inverse_hessian_cholesky
from decodekit.validate import check_range


def parse_n_m(n_m: str | tuple[int, int]) -> tuple[int, int]:
    """(n, m) from "2:4" or (2, 4): n zeros in every m weights, 0 < n < m."""
    if isinstance(n_m, str):
        parts = n_m.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"n_m must look like '2:4', got {n_m!r}")
        n, m = int(parts[0]), int(parts[1])
    else:
        n, m = n_m
    if not 0 < n < m:
        raise ValueError(f"n_m needs 0 < n < m, got {n}:{m}")
    return n, m


def _check_sparsity(sparsity: float) -> None:
    check_range("sparsity", sparsity, 0.0, 1.0, high_open=True)


def lowest_mask(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Bool mask (same shape) marking the `count` smallest scores of the whole tensor."""
    mask = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    if count > 0:
        mask[torch.topk(scores.flatten(), count, largest=False).indices] = True
    return mask.reshape(scores.shape)


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Bool mask [N, K] marking the n smallest scores in every group of m columns of a row."""
    rows, k = scores.shape
    if k % m:
        raise ValueError(f"n:m pruning needs in_features divisible by m={m}, got {k}")
    grouped = scores.reshape(rows, k // m, m)
    idx = torch.topk(grouped, n, dim=-1, largest=False).indices
    mask = torch.zeros_like(grouped, dtype=torch.bool).scatter_(-1, idx, True)
    return mask.reshape(rows, k)


def magnitude_mask(
    weight: torch.Tensor, sparsity: float = 0.5, n_m: str | tuple[int, int] | None = None
) -> torch.Tensor:
    """Bool mask [N, K] of the weights to prune (True = set to zero).

    Unstructured: the round(sparsity · N · K) smallest |w| of the whole layer. With n_m
    the n smallest |w| of every m consecutive weights of a row (sparsity is then unused).
    """
    scores = weight.detach().abs().to(torch.float32)
    if n_m is not None:
        return nm_mask(scores, *parse_n_m(n_m))
    _check_sparsity(sparsity)
    return lowest_mask(scores, round(sparsity * scores.numel()))


def prune_magnitude(
    weight: torch.Tensor, sparsity: float = 0.5, n_m: str | tuple[int, int] | None = None
) -> torch.Tensor:
    """Weight [N, K] with the smallest-magnitude entries set to zero (see `magnitude_mask`)."""
    return weight.masked_fill(magnitude_mask(weight, sparsity, n_m), 0.0)


def prune_sparsegpt(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: float = 0.5,
    n_m: str | tuple[int, int] | None = None,
    block_size: int = 128,
    damp: float = 0.01,
) -> torch.Tensor:
    """SparseGPT: prune weight [N, K] minimising ||W X - Ŵ X||² for H = 2 X Xᵀ [K, K].

    Returns the pruned, updated weight [N, K] float32 (zeros where pruned). Unstructured:
    round(sparsity · N · b) weights pruned in every block of b columns. n:m: n per group
    of m columns of every row, chosen when the loop reaches the group (sparsity unused).
    """
    n_rows, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(
            f"hessian must be [{k}, {k}] for weight [{n_rows}, {k}], got {tuple(hessian.shape)}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    nm = parse_n_m(n_m) if n_m is not None else None
    if nm is None:
        _check_sparsity(sparsity)
    else:
        if k % nm[1]:
            raise ValueError(f"n:m pruning needs in_features divisible by m={nm[1]}, got {k}")
        block_size = max(nm[1], block_size // nm[1] * nm[1])  # blocks hold whole n:m groups

    hessian = hessian.to(weight.device)
    w_all = weight.detach().to(torch.float32).clone()  # [N, K]
    w_all[:, dead_columns(hessian)] = 0.0
    u = inverse_hessian_cholesky(hessian, damp)  # [K, K] upper
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w_block = w_all[:, i1:i2].clone()  # [N, b]
        err_block = torch.zeros_like(w_block)
        u_block = u[i1:i2, i1:i2]
        u_diag = u_block.diagonal()  # [b]
        if nm is None:
            # Adaptive mask selection over the whole block (SparseGPT Sec. 3.3).
            scores = w_block**2 / u_diag.unsqueeze(0) ** 2
            prune = lowest_mask(scores, round(sparsity * scores.numel()))
        else:
            prune = torch.zeros_like(w_block, dtype=torch.bool)
        for i in range(i2 - i1):
            if nm is not None and i % nm[1] == 0:
                j = slice(i, i + nm[1])
                scores = w_block[:, j] ** 2 / u_diag[j].unsqueeze(0) ** 2
                prune[:, j] = nm_mask(scores, nm[0], nm[1])
            w = w_block[:, i]
            kept = w.masked_fill(prune[:, i], 0.0)
            err = (w - kept) / u_block[i, i]
            # Seed 000's OBS update w <- w - H⁻¹_{:,p} w_p / [H⁻¹]_pp, in Cholesky form.
            w_block[:, i:] -= err.unsqueeze(1) * u_block[i, i:].unsqueeze(0)
            w_block[:, i] = kept
            err_block[:, i] = err
        w_all[:, i1:i2] = w_block
        w_all[:, i2:] -= err_block @ u[i1:i2, i2:]  # lazy batch update
    return w_all
