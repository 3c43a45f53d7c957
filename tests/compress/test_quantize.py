import pytest
import torch

from decodekit.compress import (
    QuantSpec,
    clip_round,
    dequantize,
    gptq_quantize,
    hessian_from_inputs,
    quantize_rtn,
    round_half_away,
)


def test_seed_000_clipping_example_reproduces_exactly():
    # Seed 000, "Standard post-training quantization": clip to [-2, 2], round to 5 values.
    original = torch.tensor([[-1.2, -1.1, 0.5], [-100.0, 0.0, 0.2], [1.8, 1.6, 30.0]])
    clipped = torch.tensor([[-1.2, -1.1, 0.5], [-2.0, 0.0, 0.2], [1.8, 1.6, 2.0]])
    expected = torch.tensor([[-1.0, -1.0, 1.0], [-2.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    assert torch.equal(original.clamp(-2, 2), clipped)
    assert torch.equal(clip_round(original, clip=2.0), expected)


def test_round_half_away_from_zero():
    x = torch.tensor([0.5, -0.5, 1.5, 2.5, -2.5, 0.49, -1.51])
    assert round_half_away(x).tolist() == [1.0, -1.0, 2.0, 3.0, -3.0, 0.0, -2.0]


def test_rtn_hand_computed_per_channel_and_per_group():
    # 3 bits: qmax = 3. Row absmax 6 -> scale 2: 3/2 = 1.5 -> 2, 1/2 -> 1, 5/2 -> 3.
    w = torch.tensor([[3.0, -6.0, 1.0, 5.0]])
    codes, scales = quantize_rtn(w, QuantSpec(bits=3))
    assert codes.tolist() == [[2, -3, 1, 3]] and scales.tolist() == [[2.0]]
    # Groups of 2: [3, -6] has scale 2, [0.5, 1.5] has scale 0.5.
    w = torch.tensor([[3.0, -6.0, 0.5, 1.5]])
    codes, scales = quantize_rtn(w, QuantSpec(bits=3, group_size=2))
    assert codes.tolist() == [[2, -3, 1, 3]] and scales.tolist() == [[2.0, 0.5]]
    assert dequantize(codes, scales).tolist() == [[4.0, -6.0, 0.5, 1.5]]
    # 2 bits is ternary: qmax = 1, scale = absmax.
    codes, scales = quantize_rtn(torch.tensor([[1.0, -4.0, 2.0, 3.0]]), QuantSpec(bits=2))
    assert codes.tolist() == [[0, -1, 1, 1]] and scales.tolist() == [[4.0]]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("group_size", [None, 16, 32])
def test_rtn_error_is_at_most_half_a_step_per_group(bits, group_size):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(bits))
    spec = QuantSpec(bits, group_size)
    codes, scales = quantize_rtn(w, spec)
    groups = 1 if group_size is None else 128 // group_size
    assert codes.dtype == torch.int8 and scales.shape == (64, groups)
    assert codes.abs().max() == spec.qmax  # absmax lands exactly on the top level
    step = scales.repeat_interleave(128 // groups, dim=1)  # [N, K]
    error = (w - dequantize(codes, scales)).abs()
    assert torch.all(error <= step / 2 * (1 + 1e-5))


def test_all_zero_rows_quantise_to_zero():
    w = torch.zeros(2, 8)
    codes, scales = quantize_rtn(w, QuantSpec(4, group_size=4))
    assert torch.equal(dequantize(codes, scales), w)


def test_spec_validation_names_the_value():
    with pytest.raises(ValueError, match="bits must be in 2..8, got 9"):
        QuantSpec(bits=9)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        QuantSpec(bits=4, group_size=0)
    with pytest.raises(ValueError, match="group_size 48 must divide the layer's in_features 128"):
        quantize_rtn(torch.zeros(4, 128), QuantSpec(4, group_size=48))


def _naive_gptq(weight, hessian, bits, group_size, order, damp):
    """Seed 000's OBQ loop with explicit inverses of H restricted to the remaining columns."""
    w = weight.double().clone()
    k = w.shape[1]
    h = hessian.double() + damp * hessian.diagonal().mean().double() * torch.eye(k, dtype=torch.double)
    qmax = 2 ** (bits - 1) - 1
    scale = w.abs().amax(1) / qmax  # per channel, fixed up front
    codes = torch.zeros_like(w, dtype=torch.int8)
    for step, col in enumerate(order):
        if group_size is not None and col % group_size == 0:
            scale = w[:, col : col + group_size].abs().amax(1) / qmax
        q = round_half_away(w[:, col] / scale).clamp(-qmax, qmax)
        codes[:, col] = q.to(torch.int8)
        rest = order[step:]
        h_inv = torch.linalg.inv(h[rest][:, rest])
        err = (w[:, col] - q * scale) / h_inv[0, 0]
        w[:, rest] -= err.unsqueeze(1) * h_inv[0].unsqueeze(0)
    return codes


@pytest.mark.parametrize("block_size", [1, 8, 128])
@pytest.mark.parametrize(
    ("group_size", "act_order"), [(None, False), (8, False), (None, True)]
)
def test_gptq_matches_explicit_optimal_brain_quantisation(
    correlated_problem, block_size, group_size, act_order
):
    # The Cholesky form and the lazy block updates must not change the result.
    w, x = correlated_problem(1, 8, 24, samples=256)
    h = hessian_from_inputs(x)
    order = (
        torch.argsort(h.diagonal(), descending=True, stable=True).tolist()
        if act_order
        else list(range(24))
    )
    expected = _naive_gptq(w, h, 3, group_size, order, damp=0.01)
    codes, _ = gptq_quantize(w, h, QuantSpec(3, group_size), block_size, 0.01, act_order)
    assert torch.equal(codes, expected)


@pytest.mark.parametrize("group_size", [None, 32])
def test_gptq_with_identity_hessian_is_round_to_nearest(group_size):
    # With uncorrelated inputs there is nothing to compensate through (seed 000: H = I).
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    spec = QuantSpec(4, group_size)
    codes, scales = gptq_quantize(w, torch.eye(64), spec)
    rtn_codes, rtn_scales = quantize_rtn(w, spec)
    assert torch.equal(codes, rtn_codes) and torch.equal(scales, rtn_scales)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize(("group_size", "act_order"), [(None, False), (32, False), (32, True)])
def test_gptq_output_error_is_lower_than_rtn(
    correlated_problem, output_error, bits, group_size, act_order
):
    w, x = correlated_problem(0, 64, 128)
    spec = QuantSpec(bits, group_size)
    rtn = dequantize(*quantize_rtn(w, spec))
    gptq = dequantize(*gptq_quantize(w, hessian_from_inputs(x), spec, act_order=act_order))
    # Measured ratio is about 0.7; a wrong Hessian update makes GPTQ worse than RTN.
    assert output_error(w, gptq, x) < 0.85 * output_error(w, rtn, x)


def test_gptq_dead_input_features_are_zeroed():
    w = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(4))
    x[:, 2] = 0.0  # feature 2 never fires during calibration
    codes, scales = gptq_quantize(w, hessian_from_inputs(x), QuantSpec(4))
    assert torch.all(codes[:, 2] == 0) and torch.isfinite(scales).all()


def test_gptq_rejects_a_hessian_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"hessian must be \[8, 8\]"):
        gptq_quantize(torch.zeros(4, 8), torch.eye(7), QuantSpec(4))
