import pytest
import torch

from decodekit.compress import (
    hessian_from_inputs,
    magnitude_mask,
    parse_n_m,
    prune_magnitude,
    prune_sparsegpt,
)


def test_magnitude_hand_example():
    w = torch.tensor([[0.1, -3.0, 0.2, 4.0], [-0.05, 1.0, 2.0, -0.3]])
    expected = torch.tensor([[0.0, -3.0, 0.0, 4.0], [0.0, 1.0, 2.0, 0.0]])
    assert torch.equal(prune_magnitude(w, sparsity=0.5), expected)


def test_magnitude_prunes_exact_count_of_smallest_weights():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    mask = magnitude_mask(w, sparsity=0.3)
    assert mask.sum().item() == round(0.3 * 64 * 128)
    assert w[mask].abs().max() <= w[~mask].abs().min()


def test_magnitude_n_m_hand_example():
    w = torch.tensor([[1.0, -0.2, 3.0, 0.1, 0.5, -2.0, 0.4, 6.0]])
    expected = torch.tensor([[1.0, 0.0, 3.0, 0.0, 0.0, -2.0, 0.0, 6.0]])
    assert torch.equal(prune_magnitude(w, n_m="2:4"), expected)


def _zeros_per_group(w: torch.Tensor, m: int) -> torch.Tensor:
    return (w == 0).reshape(w.shape[0], -1, m).sum(-1)


@pytest.mark.parametrize("n_m", ["2:4", "1:4", "4:8"])
def test_n_m_masks_have_exactly_n_zeros_in_every_group(correlated_problem, n_m):
    n, m = parse_n_m(n_m)
    w, x = correlated_problem(3, 32, 128, samples=512)
    for pruned in (prune_magnitude(w, n_m=n_m), prune_sparsegpt(w, hessian_from_inputs(x), n_m=n_m)):
        assert torch.all(_zeros_per_group(pruned, m) == n)


def test_parse_n_m():
    assert parse_n_m("2:4") == (2, 4) and parse_n_m((1, 4)) == (1, 4)
    for bad in ("4:2", "2-4", "0:4", "a:b"):
        with pytest.raises(ValueError, match="n_m"):
            parse_n_m(bad)


def test_sparsity_validation():
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\), got 1.0"):
        prune_magnitude(torch.ones(2, 4), sparsity=1.0)
    with pytest.raises(ValueError, match="divisible by m=4"):
        prune_magnitude(torch.ones(2, 6), n_m="2:4")


@pytest.mark.parametrize("n_m", [None, "2:4"])
def test_sparsegpt_with_identity_hessian_is_magnitude_pruning(n_m):
    # Seed 000: "If the Hessian is identity, this is same as magnitude based pruning".
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    pruned = prune_sparsegpt(w, torch.eye(64), 0.5, n_m, block_size=64)
    assert torch.equal(pruned, prune_magnitude(w, 0.5, n_m))


def test_sparsegpt_mask_is_lowest_w2_over_inverse_hessian_diagonal(correlated_problem):
    # One block: the mask is chosen up front from seed 000's saliency w_j² / [H_F⁻¹]_jj,
    # F = columns >= j (SparseGPT writes it w² / U_jj² with U = chol(H⁻¹)ᵀ).
    w, x = correlated_problem(4, 8, 16, samples=128)
    h = hessian_from_inputs(x).double()
    h_damped = h + 0.01 * h.diagonal().mean() * torch.eye(16, dtype=torch.double)
    inv_diag = torch.tensor([torch.linalg.inv(h_damped[j:, j:])[0, 0] for j in range(16)])
    scores = w.double() ** 2 / inv_diag
    expected = scores <= scores.flatten().kthvalue(64).values
    pruned = prune_sparsegpt(w, h.float(), 0.5, block_size=16)
    assert torch.equal(pruned == 0, expected)


@pytest.mark.parametrize("n_m", [None, "2:4"])
def test_sparsegpt_update_matches_explicit_optimal_brain_surgeon(correlated_problem, n_m):
    # Given SparseGPT's mask, its weights are seed 000's OBS updates applied column by
    # column with explicit inverses of H restricted to the remaining columns.
    w, x = correlated_problem(5, 8, 32, samples=256)
    h = hessian_from_inputs(x)
    pruned = prune_sparsegpt(w, h, 0.5, n_m, block_size=8)
    mask = pruned == 0
    ref = w.double().clone()
    h_damped = h.double() + 0.01 * h.diagonal().mean().double() * torch.eye(32, dtype=torch.double)
    for col in range(32):
        h_inv = torch.linalg.inv(h_damped[col:, col:])
        removed = torch.where(mask[:, col], ref[:, col], torch.zeros(8, dtype=torch.double))
        ref[:, col:] -= (removed / h_inv[0, 0]).unsqueeze(1) * h_inv[0].unsqueeze(0)
    assert torch.allclose(pruned.double(), ref, atol=1e-4)


@pytest.mark.parametrize("n_m", [None, "2:4"])
def test_sparsegpt_output_error_is_lower_than_magnitude(correlated_problem, output_error, n_m):
    # 256 inputs = two mask-selection blocks of 128, as SparseGPT uses on wide layers.
    # (With a single block spanning the whole layer and an ill-conditioned mixing, the
    # up-front mask piles onto early columns and the gain can vanish; SparseGPT Sec. 3.3.)
    w, x = correlated_problem(0, 64, 256)
    magnitude = prune_magnitude(w, 0.5, n_m)
    sparsegpt = prune_sparsegpt(w, hessian_from_inputs(x), 0.5, n_m)
    assert (sparsegpt == 0).float().mean().item() == 0.5
    # Measured ratio is about 0.8; without the weight update SparseGPT loses to magnitude.
    assert output_error(w, sparsegpt, x) < 0.9 * output_error(w, magnitude, x)
